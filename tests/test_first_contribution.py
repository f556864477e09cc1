""" "First contribution" means one thing everywhere: seconds from a peer's join to the relay
accepting its first gradient, measured by the relay. The volunteer's panel, the end-of-session
summary and the dashboard (``/api/status``) show that same number; and the summary is a
sentence, not a dataclass repr."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import requests

from toolkit import JoinResult, join
from toolkit.notebook.panel import PeerProgress

TINY_BYTE_LM = {
    "run": {"target_batch": 8},
    "dataset": {"kind": "demo_corpus"},
    "model": {
        "factory": "toolkit.models:ByteTransformer",
        "kwargs": {"seq_len": 16, "d_model": 32, "n_layer": 1, "n_head": 2, "d_ff": 64},
    },
}


class DashboardWatcher:
    """A panel that, when the peer first shows a first contribution, reads what the dashboard's
    report says of this peer at that moment (the peer is still online)."""

    def __init__(self, relay_url: str) -> None:
        self.relay_url = relay_url
        self.shown: list[PeerProgress] = []
        self.dashboard: list[dict[str, Any]] = []

    def update(self, progress: PeerProgress) -> None:
        self.shown.append(progress)
        if progress.first_contribution_s is not None and not self.dashboard:
            self.dashboard = requests.get(self.relay_url + "/api/status", timeout=10).json()["peers"]

    def close(self) -> None:
        pass


def test_the_panel_the_summary_and_the_dashboard_show_the_relays_one_number(serve_relay) -> None:
    relay = serve_relay(TINY_BYTE_LM)
    watcher = DashboardWatcher(relay.url)
    result = join(relay.url, panel=watcher, max_steps=2, batch_size=4)  # two micro-batches a step
    assert result.contributed_samples == 16 and result.first_contribution_s is not None
    [peer] = [p for p in watcher.dashboard if p["peer_id"] == result.peer_id]
    assert peer["first_contribution_s"] == result.first_contribution_s  # the same float, not a close one
    shown = [p.first_contribution_s for p in watcher.shown if p.first_contribution_s is not None]
    assert set(shown) == {result.first_contribution_s}
    # Before the first accepted gradient was counted, the panel waits instead of guessing.
    assert watcher.shown[0].first_contribution_s is None
    assert dict(watcher.shown[0].rows())["first contribution"] == "waiting..."
    assert dict(watcher.shown[-1].rows())["first contribution"] == f"{result.first_contribution_s:.1f} s after join"
    assert f"(first contribution {result.first_contribution_s:.1f} s after joining)" in result.summary()


RESULT = JoinResult(
    peer_id="p",
    final_step=12,
    contributed_samples=4096,
    local_steps=64,
    last_loss=2.5,
    seconds=41.2,
    finished=False,
    device="cpu",
    precision="fp32",
    first_contribution_s=11.04,
    joined_step=10,
)


@pytest.mark.parametrize(
    ("result", "sentence"),
    [
        (
            RESULT,
            "Contributed 4,096 samples over 2 steps (first contribution 11.0 s after joining); left at step 12 "
            "after 41 s.",
        ),
        (
            replace(RESULT, finished=True, final_step=11, seconds=4000),
            "Contributed 4,096 samples over 1 step (first contribution 11.0 s after joining); the run finished at step 11 "
            "after 67 min.",
        ),
        (
            replace(RESULT, contributed_samples=0, first_contribution_s=None, local_steps=3, final_step=10),
            "No samples contributed yet (3 micro-batches computed over 0 steps); left at step 10 after 41 s.",
        ),
        (
            replace(RESULT, hosted_experts=True, local_steps=250, seconds=7200),
            "Hosted experts for 2.0 h: 250 tasks served.",
        ),
    ],
)
def test_a_session_ends_with_a_sentence(result: JoinResult, sentence: str) -> None:
    assert result.summary() == sentence
    assert repr(result).startswith("JoinResult(")  # the repr stays a repr, for debugging
