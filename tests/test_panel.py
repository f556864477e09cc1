"""The live panel: the progress snapshot, throttling, the widget and tqdm panels, and join()'s
wiring of them against a real relay (in this process: the peer side is what is under test).

Also the join-to-first-contribution measure (``-m slow`` prints it for the demo model).
"""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.support.clock import Clock
from tests.support.progress import progress
from tests.support.relays import running_relay, status
from toolkit.errors import RelayUnreachable
from toolkit.notebook.panel import NullPanel, PeerProgress, TqdmPanel, WidgetPanel, open_panel
from toolkit.session import join
from toolkit.wire.protocol import CollabState


# --- the snapshot ----------------------------------------------------------------------------
def test_snapshot_is_built_from_the_optimizer_with_the_last_problem_and_its_hint() -> None:
    state = CollabState(
        step=5, target_batch=64, samples_accumulated=24, samples_per_s=80.0, eta_s=0.5, num_peers=2, round=None
    )
    opt = SimpleNamespace(
        collab_state=state,
        run=SimpleNamespace(total_steps=0),
        version=6,
        contributed_samples=96,
        samples_per_s=40.0,
        finished=False,
        last_error=RelayUnreachable("relay_unreachable", "POST /api/peers/join: timed out"),
    )
    snap = PeerProgress.from_optimizer(opt, loss=1.5, first_contribution_s=None)
    assert (snap.peers_online, snap.samples_per_s, snap.target_batch) == (2, 80.0, 64)
    # This peer already loaded step 6: the answer about step 5's accumulation is history.
    assert (snap.global_step, snap.samples_accumulated, snap.eta_s) == (6, 0, None)
    current = PeerProgress.from_optimizer(
        SimpleNamespace(**{**vars(opt), "version": 5}), loss=None, first_contribution_s=None
    )
    assert (current.global_step, current.samples_accumulated, current.eta_s) == (5, 24, 0.5)
    assert (snap.contributed_samples, snap.local_samples_per_s, snap.loss) == (96, 40.0, 1.5)
    assert snap.problem == "POST /api/peers/join: timed out" and "Kaggle: Settings -> Internet on" in snap.hint
    rows = dict(snap.rows())
    assert rows["global step"] == "6" and rows["first contribution"] == "waiting..."
    assert rows["last problem"].startswith(
        "POST /api/peers/join: timed out -- A relay that is restarting answers again"
    )


def test_rows_show_every_number_the_volunteer_needs() -> None:
    rows = dict(progress().rows())
    assert rows == {
        "peers online": "3",
        "collaboration": "123.4 samples/s",
        "global step": "17 / 100",
        "next step": "~4 s (40 / 64 samples)",
        "your contribution": "1,024 samples (12.5 samples/s)",
        "loss": "2.3456",
        "first contribution": "3.2 s after join",
        "last problem": "none",
    }
    assert (
        dict(progress(eta_s=None, total_steps=0, loss=None, finished=True).rows())["global step"]
        == "17 (run finished)"
    )


# --- throttling and the two panels -----------------------------------------------------------
def test_updates_render_at_most_twice_a_second_and_close_shows_the_latest() -> None:
    clock = Clock()
    panel = WidgetPanel("run: peer", clock=clock, show=False)
    for i in range(100):  # 100 local steps within one second
        clock.now = i / 100
        panel.update(progress(contributed_samples=i))
    assert panel.renders == 2  # at t=0 and t=0.5
    assert "50 samples" in panel.table.value
    panel.close()
    assert "99 samples" in panel.table.value and panel.renders == 3
    panel.update(progress(contributed_samples=1000))  # after close: ignored
    assert panel.renders == 3


def test_widget_models_hold_the_values_and_are_closed_at_the_end() -> None:
    panel = WidgetPanel("run: peer", show=False)
    panel.update(progress(samples_accumulated=40, target_batch=64))
    assert (panel.bar.max, panel.bar.value, panel.bar.bar_style) == (64, 40, "info")
    assert "<td>3</td>" in panel.table.value and "1,024 samples (12.5 samples/s)" in panel.table.value
    panel.update(progress(problem="round 3 ended without a result", hint="Nothing to do."))
    panel.close()
    assert panel.bar.bar_style == "warning"
    assert (
        "round 3 ended without a result -- Nothing to do." in panel.table.value and "color:#b00" in panel.table.value
    )
    assert all(w.comm is None for w in (panel.box, panel.bar, panel.table)), "widget models left open"


def test_tqdm_panel_writes_one_line_per_problem_and_starts_no_thread() -> None:
    out, clock = io.StringIO(), Clock()
    threads = set(threading.enumerate())
    panel = TqdmPanel("run: peer", file=out, clock=clock)
    problem = progress(problem="relay unreachable", hint="Check the relay URL.")
    for i in range(50):
        clock.now = i * 0.6  # every update renders
        panel.update(problem if 10 <= i < 40 else progress(global_step=i))
    panel.close()
    text = out.getvalue()
    assert text.count("problem: relay unreachable -- Check the relay URL.") == 1
    assert "peers 3 | 123.4 samples/s" in text and "you 1,024 samples" in text
    assert set(threading.enumerate()) == threads  # no tqdm monitor thread


def test_tqdm_rate_counts_steps_since_joining_and_the_last_line_prints_once() -> None:
    out, clock = io.StringIO(), Clock()
    panel = TqdmPanel("run: peer", file=out, clock=clock)
    for i in range(11):  # joined a run at global step 500
        clock.now = i * 0.6
        panel.update(progress(global_step=500 + i))
    meter = panel.bar.format_dict
    assert (meter["initial"], meter["n"]) == (500, 510)  # tqdm's rate is (n - initial) / elapsed
    panel.close()
    draws = [line for line in out.getvalue().replace("\r", "\n").splitlines() if line.strip()]
    assert sum(line.startswith("run: peer: 510step") for line in draws) == 1, draws[-3:]
    assert out.getvalue().endswith("\n")

    out = io.StringIO()  # the last snapshot not drawn yet (throttled): close() draws it, once
    panel = TqdmPanel("run: peer", file=out, clock=Clock())
    panel.update(progress(global_step=7))
    panel.update(progress(global_step=8))
    panel.close()
    draws = [line for line in out.getvalue().replace("\r", "\n").splitlines() if line.strip()]
    assert [sum(f" {n}/100 " in line for line in draws) for n in (7, 8)] == [1, 1], draws


def test_auto_picks_tqdm_only_on_a_terminal_outside_jupyter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert isinstance(open_panel("auto", "t"), NullPanel)
    monkeypatch.setattr("toolkit.notebook.panel._is_terminal", lambda stream: True)
    panel = open_panel("auto", "t")
    assert isinstance(panel, TqdmPanel)
    panel.close()
    custom = NullPanel()
    assert open_panel(custom, "t") is custom
    with pytest.raises(ValueError, match="panel must be"):
        open_panel("fancy", "t")  # type: ignore[arg-type]


# --- join() with a real relay ----------------------------------------------------------------
def started_by_the_peer_side(thread: threading.Thread) -> bool:
    """Threads of toolkit or tqdm code (the relay in this process has threads of its own)."""
    code = getattr(thread, "_target", None) or type(thread)
    module = getattr(code, "__module__", "") or ""
    return thread.name.startswith("collab") or module.startswith(("toolkit", "tqdm"))


class RecordingPanel:
    """A Panel that keeps every snapshot and, at the first contribution, asks the relay for its
    own measure of the same event."""

    def __init__(self, url: str) -> None:
        self.url, self.updates, self.closed = url, [], 0
        self.relay_first: float | None = None

    def update(self, progress: PeerProgress) -> None:
        if progress.first_contribution_s is not None and self.relay_first is None:
            peers = status(self.url)["peers"]
            self.relay_first = next(p["first_contribution_s"] for p in peers if p["name"] == "first")
        self.updates.append(progress)

    def close(self) -> None:
        self.closed += 1


@pytest.mark.integration
def test_join_twice_in_one_process_leaves_no_thread_and_measures_the_first_contribution(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    token = "hf_panelTestTokenNeverLogged42"
    with running_relay(tmp_path) as relay:
        before = set(threading.enumerate())
        recorder = RecordingPanel(relay.url)
        first = join(relay.url, token=token, max_steps=2, panel=recorder, peer_name="first")
        second = join(relay.url, token=token, max_steps=2, panel="tqdm", peer_name="second")
        leftover = [t.name for t in set(threading.enumerate()) - before if started_by_the_peer_side(t)]
        assert leftover == [], "join left threads behind"
        board = {e["username"]: e["samples"] for e in status(relay.url)["leaderboard"]}

    assert board == {"anonymous:first": first.contributed_samples, "anonymous:second": second.contributed_samples}
    assert first.contributed_samples == second.contributed_samples == 32  # alone: 2 steps x 16 samples
    assert recorder.closed == 1 and len(recorder.updates) == first.local_steps
    steps = [u.global_step for u in recorder.updates]
    assert steps == sorted(steps) and steps[-1] == first.final_step
    firsts = {u.first_contribution_s for u in recorder.updates if u.first_contribution_s is not None}
    assert firsts == {first.first_contribution_s}  # measured once, then shown unchanged
    # The relay's clock starts after join() did and stops at the upload, before the peer has the result.
    assert 0 < recorder.relay_first <= first.first_contribution_s < first.seconds
    assert token not in caplog.text and token not in repr(first)


# --- the measure -----------------------------------------------------------------------------
MEASURE = """
import json, sys, time
import torch
torch.set_num_threads(2)
from toolkit.session import join
url = sys.argv[1]
cold = join(url, batch_size=8, max_steps=1, panel="none", peer_name="cold")
warm = join(url, batch_size=8, max_steps=1, panel="none", peer_name="warm")
print(json.dumps({"cold": cold.first_contribution_s, "warm": warm.first_contribution_s}))
"""


@pytest.mark.integration
@pytest.mark.slow
def test_measure_join_to_first_contribution_on_the_demo_model(tmp_path: Path) -> None:
    """The demo model as shipped (demo.toml, ~3.3M parameters), one peer, target batch 8 = one
    micro-batch of 8: a fresh Python process imports the toolkit (torch), then times join() from
    its call to the first applied gradient; "cold" is the process's first join (it pays torch's
    lazy ``torch._dynamo`` import in the first ``torch.optim.Optimizer``), "warm" a second one."""
    with running_relay(
        tmp_path,
        {
            "model": {"kwargs": {"seq_len": 64, "d_model": 256, "n_layer": 4, "n_head": 4, "d_ff": 1024}},
            "run": {"target_batch": 8},
        },
    ) as relay:
        out = subprocess.run([sys.executable, "-c", MEASURE, relay.url], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\njoin -> first contribution, demo model: cold {measured['cold']:.2f} s, warm {measured['warm']:.2f} s")
    assert measured["warm"] < 5.0
