"""The relay's dashboard in a real browser (Debian's chromium, headless, driven by playwright).

Against a running collaboration -- a real relay process and two real peer processes -- the page
must load without console errors or failed requests, render the peers, the leaderboard, the plan
and the configuration, follow the run as rounds finish (without a reload), and say so plainly when
the relay goes away. A screenshot lands in ``test-artifacts/`` for a human to look at.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.moe import directory, overrides, start_host, stop
from tests.support.processes import REPO

pytestmark = pytest.mark.browser

CHROMIUM = Path("/usr/bin/chromium")
# playwright cannot download its own browsers here; Debian's build needs these flags in a container.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ARTIFACTS = REPO / "test-artifacts"
UI_TIMEOUT_MS = 20_000  # the machine is shared; polling is 1.5 s, a round well under a second


@dataclass
class PageProblems:
    """Everything the browser reports going wrong while the page runs."""

    console_errors: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)
    failed_requests: list[str] = field(default_factory=list)

    def snapshot(self) -> list[str]:
        return [*self.console_errors, *self.page_errors, *self.failed_requests]


@pytest.fixture(scope="module")
def chromium_browser() -> Iterator[object]:
    """One headless chromium for the module's tests (each launch is a browser's whole start-up);
    every test gets its own context (cookies, storage, cache) and page from it, so nothing a test
    did carries over. Under xdist each worker that runs some of them launches its own."""
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing: install Debian's chromium (apt-get install -y chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        launched = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture
def browser_page(chromium_browser) -> Iterator[tuple[object, PageProblems]]:
    """A fresh context and page of the module's browser, and what goes wrong on it."""
    problems = PageProblems()
    context = chromium_browser.new_context(viewport={"width": 1280, "height": 1100})
    try:
        page = context.new_page()
        page.on("console", lambda m: m.type == "error" and problems.console_errors.append(m.text))
        page.on("pageerror", lambda e: problems.page_errors.append(str(e)))
        page.on("requestfailed", lambda r: problems.failed_requests.append(f"{r.method} {r.url}: {r.failure}"))
        page.on("response", lambda r: r.status >= 400 and problems.failed_requests.append(f"{r.status} {r.url}"))
        yield page, problems
    finally:
        context.close()


def to_precision_4(x: float) -> str:
    """What the dashboard's ``n.toPrecision(4)`` shows for a loss: four significant digits, trailing
    zeros kept (5.310, where Python's ``.4g`` writes 5.31); ``#`` keeps them."""
    return f"{x:#.4g}"


def shown_step(page) -> int:
    return int(page.locator("#step").get_attribute("data-value") or -1)


def test_dashboard_follows_a_live_collaboration(start_relay, launch_peer, browser_page, serve_relay):
    """A sync run followed live, then (same browser) a local SGD run's outer round, inner steps
    and busy fractions, and the bytes per sample both ways the relay measured."""
    from playwright.sync_api import expect

    page, problems = browser_page
    relay = start_relay({"run": {"name": "dashboard-run", "target_batch": 32}, "rounds": {"peer_ttl_s": 10.0}})
    # Slow peers that never stop by themselves: rounds keep finishing while the page is open.
    for seed, name in enumerate(("alice", "bob")):
        launch_peer(
            relay.url,
            name,
            seed=seed,
            batch_size=4,
            steps=1_000_000,
            extra=("--sleep-per-batch", "0.05", "--wait-peers", "2"),
        )
    status = relay.wait_for(
        lambda s: s["step"] >= 2 and len(s["peers"]) == 2 and len(s["leaderboard"]) == 2,
        what="two peers on the leaderboard",
    )
    usernames = {p["name"]: p["username"] for p in status["peers"]}  # open mode: "anonymous:<name>"

    page.goto(relay.url + "/")
    page.evaluate("window.__sameDocument = true")  # disappears if anything reloads the page
    expect(page.locator("#connection")).to_have_text("live", timeout=UI_TIMEOUT_MS)
    expect(page.locator("#run-name")).to_have_text("dashboard-run")
    peers = page.locator("#peers tbody")
    assert sorted(usernames) == ["alice", "bob"]
    for name, username in usernames.items():
        expect(peers).to_contain_text(name)
        expect(peers).to_contain_text(username)
        expect(page.locator("#leaderboard tbody")).to_contain_text(username)
    expect(page.locator("#leaderboard tbody tr")).to_have_count(2)
    expect(page.locator("#plan tbody")).to_contain_text("relay")
    expect(page.locator("#plan tbody")).to_contain_text("100 %")
    expect(page.locator("#config")).to_contain_text("toolkit.models:MLP")
    expect(page.locator("#open-warning")).to_be_visible()  # auth.mode = "open" must be loud
    expect(page.locator("#auth-mode")).to_have_text("open")
    expect(page.locator("#loss")).not_to_have_text("–")
    expect(page.locator("#loss-chart polyline")).to_have_count(1)
    expect(page.locator("#pipeline-panel")).to_be_hidden()  # not a [pipeline] run: no Pipeline panel
    expect(page.locator("#refused-steps")).to_be_hidden()  # no step refused: no warning

    first_step = shown_step(page)
    first_points = int(page.locator("#loss-chart").get_attribute("data-points"))
    assert first_step >= 2, first_step
    page.wait_for_function(
        "s => Number(document.getElementById('step').dataset.value) > s", arg=first_step, timeout=UI_TIMEOUT_MS
    )
    later_step = shown_step(page)
    assert later_step > first_step
    assert page.evaluate("window.__sameDocument") is True, "the page reloaded instead of updating in place"
    assert int(page.locator("#loss-chart").get_attribute("data-points")) > first_points
    assert relay.status()["step"] >= later_step  # the page shows the relay's step, not an invention
    expect(page.locator("#throughput-chart polyline.rounds")).to_have_count(1)
    expect(page.locator("#last-applied")).to_contain_text(
        re.compile(
            r"Step \d+ applied \d+ of target 32 samples "
            r"from \d peers\."
        )
    )
    for way in ("up", "down"):  # every run: the training bytes per applied sample, measured on the relay
        expect(page.locator(f"#bytes-{way}")).to_have_text(re.compile(r"^\d+(\.\d)? (B|KB|MB)$"))
    expect(page.locator("#step-label")).to_have_text("Global step")  # a sync run: no local SGD figures
    expect(page.locator("#busy-card")).to_be_hidden()
    expect(page.locator("#peers th.local-sgd")).to_have_count(2)
    expect(page.locator("#peers th.local-sgd").first).to_be_hidden()

    ARTIFACTS.mkdir(exist_ok=True)
    screenshot = ARTIFACTS / "dashboard.png"
    page.screenshot(path=str(screenshot), full_page=True)
    print(f"dashboard screenshot: {screenshot}")
    assert problems.snapshot() == [], problems

    relay.kill()  # a relay that died (or a network gone) is shown, not a blank page or a stuck spinner
    expect(page.locator("#unreachable")).to_be_visible(timeout=UI_TIMEOUT_MS)
    expect(page.locator("#unreachable")).to_contain_text("Cannot reach the relay")
    expect(page.locator("#connection")).to_have_text("relay unreachable")
    expect(page.locator("#peers tbody")).to_contain_text("alice")  # the last data stays readable
    page.screenshot(path=str(ARTIFACTS / "dashboard-unreachable.png"), full_page=True)
    assert page.evaluate("window.__sameDocument") is True
    # A relay that is down costs nothing to ask again: after several failed polls the page still
    # asks at its normal cadence (no 15 s backoff), so it is live within one poll of the restart.
    page.wait_for_timeout(5000)
    expect(page.locator("#unreachable")).to_contain_text("retrying every 1.5 s")
    relay.start()
    expect(page.locator("#connection")).to_have_text("live", timeout=UI_TIMEOUT_MS)
    expect(page.locator("#unreachable")).to_be_hidden()
    assert page.evaluate("window.__sameDocument") is True
    show_a_local_sgd_run(page, problems, serve_relay)


def show_a_local_sgd_run(page, problems: PageProblems, serve_relay) -> None:
    """Two hand-driven peers (exact bytes): carol finished her H = 3 inner steps and uploads her
    pseudo-gradient, the outer round applies it, one full download follows; then carol is at inner
    step 1 of round 2 and dave at step 2 of round 1. The page shows those numbers as the relay does."""
    import numpy as np
    import requests
    from playwright.sync_api import expect

    from relay_server.harness.process import wait_until
    from tests.support.local_sgd import BATCH, PATIENT, SGD1, local_run
    from tests.support.peers import RawPeer

    seen = len(problems.snapshot())  # the sync relay's outage above was reported, as it should be
    local = serve_relay(local_run(SGD1, inner_steps=3) | {"rounds": {**PATIENT, "peer_ttl_s": 600.0}}, name="local")
    carol, dave = RawPeer(local).join("carol"), RawPeer(local).join("dave")
    assert dave.heartbeat(0, inner_steps=2, busy_fraction=0.45).ok
    assert carol.heartbeat(BATCH, inner_steps=3, busy_fraction=0.75).ok  # her budget ended: she holds the target
    wait_until(lambda: local.status()["round"], 30, "the outer round")
    upload = carol.container(np.full(local.status()["num_params"], 0.01, np.float32), carol.meta(samples=BATCH))
    assert carol.upload(upload).ok
    download = requests.get(local.url + "/api/params", params={"min_step": 1, "wait": 30}, timeout=60)
    assert download.status_code == 200 and download.headers["X-Collab-Step"] == "1"
    assert carol.heartbeat(0, version=1, inner_steps=1, busy_fraction=0.75).ok

    page.goto(local.url + "/")
    expect(page.locator("#connection")).to_have_text("live", timeout=UI_TIMEOUT_MS)
    expect(page.locator("#step-label")).to_have_text("Outer round")
    expect(page.locator("#step")).to_have_text("1")
    expect(page.locator("#inner-budget")).to_have_text("H = 3 inner steps")
    expect(page.locator("#peers th.local-sgd").first).to_be_visible()
    rows = page.locator("#peers tbody tr")
    expect(rows).to_have_count(2)
    for i, (name, steps, busy) in enumerate([("carol", "1 of 3", "75 %"), ("dave", "2 of 3", "45 %")]):
        expect(rows.nth(i).locator("td").first).to_have_text(name)
        expect(rows.nth(i).locator("td.inner-steps")).to_have_text(steps)
        expect(rows.nth(i).locator("td.busy")).to_have_text(busy)
    expect(page.locator("#busy-fraction")).to_have_text("60 %")  # the mean over the peers online
    expect(page.locator("#inner-last-round")).to_have_text("3.0 inner steps per peer in the last outer round")
    for way, body in (("up", upload), ("down", download.content)):  # all the relay moved, over the round's samples
        expect(page.locator(f"#bytes-{way}")).to_have_attribute("data-value", re.compile(r"."))
        assert float(page.locator(f"#bytes-{way}").get_attribute("data-value")) == pytest.approx(len(body) / BATCH)
    expect(page.locator("#config")).to_contain_text("local SGD: H = 3 inner steps per outer round")
    page.screenshot(path=str(ARTIFACTS / "dashboard-local-sgd.png"), full_page=True)
    assert problems.snapshot()[seen:] == [], problems


def test_dashboard_shows_the_experts_of_a_mixture_run(start_relay, browser_page, tmp_path):
    """A run with [moe]: the Experts panel says how many experts have a host and who hosts them."""
    from playwright.sync_api import expect

    from relay_server.harness.process import wait_until

    page, problems = browser_page
    relay = start_relay(overrides(0))
    page.goto(relay.url + "/")
    expect(page.locator("#connection")).to_have_text("live", timeout=UI_TIMEOUT_MS)
    expect(page.locator("#experts-panel")).to_be_visible()
    expect(page.locator("#experts-summary")).to_contain_text("0 of 8 experts live")
    host = start_host(relay.url, "gpu-volunteer", 8, tmp_path / "host.log")
    try:
        wait_until(lambda: len(directory(relay.url)["live"]) == 8, 60, "the host's experts")
        expect(page.locator("#experts-summary")).to_contain_text("8 of 8 experts live", timeout=UI_TIMEOUT_MS)
        expect(page.locator("#experts tbody")).to_contain_text("gpu-volunteer")
        expect(page.locator("#experts tbody")).to_contain_text("8")
    finally:
        stop([host])
    assert problems.snapshot() == [], problems


def test_a_dmoe_run_shows_the_samples_per_s_its_rounds_measured_and_its_expert_hosts_as_hosts(browser_page):
    """Issue 35: a DMoE run's dashboard showed 32,574 samples/s "reported by peers" while its rounds
    applied 0.8, and listed its expert hosts as trainers (device unknown, 0.0 samples/s, first
    contribution not yet). The DMoE demo (two expert hosts, two trainers with micro-batches in
    flight): the headline figure is the rounds' own rate, the trainers' self-reports are labelled
    as such, and each host is listed as a host with the experts it holds."""
    import json
    import signal
    import subprocess
    import sys
    import urllib.request

    from playwright.sync_api import expect

    from relay_server.rounds.throughput import RATE_WINDOW

    page, problems = browser_page
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "relay_server.cli",
            "demo",
            "--recipe",
            "dmoe-lm-tiny",
            "--peers",
            "2",
            "--steps",
            "1000",
            "--target-batch",
            "16",
            "--batch-size",
            "4",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        url = None
        for line in proc.stdout:  # type: ignore[union-attr]
            url = url or (re.match(r"relay:\s+(\S+)", line) or [None, None])[1]
            step = re.match(r"step\s+(\d+)/", line)
            if step and int(step[1]) > RATE_WINDOW + 1:
                break  # a full window of rounds behind it
        assert url, "the demo printed no relay line"
        with urllib.request.urlopen(url + "/api/status", timeout=30) as answer:
            status = json.load(answer)
        rounds = status["recent_rounds"]
        elapsed = rounds[-1]["finalized_at"] - rounds[-1 - RATE_WINDOW]["finalized_at"]
        measured = sum(r["samples"] for r in rounds[-RATE_WINDOW:]) / elapsed
        assert status["samples_per_s_rounds"] == RATE_WINDOW
        assert status["samples_per_s"] == pytest.approx(measured, rel=0.10), (status["samples_per_s"], measured)
        roles = {p["name"]: p for p in status["peers"]}
        for host in ("host-0", "host-1"):
            assert roles[host]["role"] == "expert_host" and roles[host]["experts_hosted"] == 16, roles[host]
        assert {roles[name]["role"] for name in ("peer-0", "peer-1")} == {"trainer"}
        trainers = sum(p["samples_per_s"] for p in status["peers"] if p["role"] == "trainer")
        assert status["reported_samples_per_s"] == pytest.approx(trainers)

        page.goto(url + "/")
        expect(page.locator("#connection")).to_have_text("live", timeout=UI_TIMEOUT_MS)
        expect(page.locator("#samples-per-s-basis")).to_have_text(f"measured over the last {RATE_WINDOW} rounds")
        expect(page.locator("#samples-per-s-reported")).to_contain_text("trainers report ")
        chart = page.locator("#throughput-chart")
        expect(chart).to_have_attribute("data-rounds-rate", re.compile(r"."), timeout=UI_TIMEOUT_MS)
        card = page.locator("#samples-per-s")
        # One poll: the card's figure (the relay's) and the chart's rounds line (the page's own sum over the
        # same rounds) agree, where the peers' reports had been 10^4 times the rounds' rate.
        shown, rounds_rate = page.evaluate("""() => [Number(document.getElementById('samples-per-s').dataset.value),
            Number(document.getElementById('throughput-chart').dataset.roundsRate)]""")
        assert shown == pytest.approx(rounds_rate, rel=0.10), (shown, rounds_rate)
        expect(card).not_to_have_text("–")
        rows = {
            name: page.locator("#peers tbody tr", has=page.locator("td", has_text=name))
            for name in ("host-0", "host-1", "peer-0", "peer-1")
        }
        for host in ("host-0", "host-1"):
            expect(rows[host].locator("td.role")).to_have_text("expert host · 16 experts")
            # device, precision, samples/s, contributed, first contribution: a host has none of them
            expect(rows[host].locator("td.na")).to_have_text(["–"] * 5)
            cells = " | ".join(rows[host].locator("td").all_inner_texts())
            assert "unknown" not in cells and "not yet" not in cells, cells
        for trainer in ("peer-0", "peer-1"):
            expect(rows[trainer].locator("td.role")).to_have_text("trainer")
            expect(rows[trainer].locator("td.reported")).to_have_text(re.compile(r"^(≤ )?\d"))
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "dashboard-dmoe.png"), full_page=True)
        assert problems.snapshot() == [], problems
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=120)
    finally:
        proc.kill()


def test_loss_chart_draws_chance_level_and_the_unigram_entropy(browser_page):
    """An organizer's trial of the byte-level demo run: the loss chart carries a labelled
    dashed line per reference the relay computed, and the summary under it names them."""
    import json
    import signal
    import subprocess
    import sys
    import urllib.request

    from playwright.sync_api import expect

    page, problems = browser_page
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "relay_server.cli",
            "trial",
            "--config",
            str(REPO / "relay_server/defaults/demo.toml"),
            "--threads",
            "1",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        url = None
        for line in proc.stdout:  # type: ignore[union-attr]
            url = url or (re.match(r"relay:\s+(\S+)", line) or [None, None])[1]
            if line.startswith("step    1 "):
                break
        assert url, "the trial printed no relay line"
        with urllib.request.urlopen(url + "/api/status", timeout=30) as answer:
            references = json.load(answer)["loss_references"]
        assert [r["name"] for r in references] == ["chance", "unigram"]
        page.goto(url + "/")
        expect(page.locator("#connection")).to_have_text("live", timeout=UI_TIMEOUT_MS)
        expect(page.locator("#loss-chart line.ref")).to_have_count(2, timeout=UI_TIMEOUT_MS)
        labels = page.locator("#loss-chart text.ref-label")
        expect(labels).to_have_text([f"{r['label']} = {to_precision_4(r['value'])}" for r in references])
        expect(page.locator("#loss-summary")).to_contain_text(
            "References: chance: ln 256 (bytes) = 5.545; unigram entropy of the demo text (bytes) = "
        )
        # Each line sits at its value on the chart's scale: the chance line above the entropy one.
        chance_y, unigram_y = (float(page.locator("#loss-chart line.ref").nth(i).get_attribute("y1")) for i in (0, 1))
        assert chance_y < unigram_y
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "dashboard-loss-references.png"), full_page=True)
        assert problems.snapshot() == [], problems
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=120)
        assert proc.returncode == 0
    finally:
        proc.kill()


def test_dashboard_shows_validation_the_chance_line_and_what_the_model_says(
    start_relay, launch_peer, browser_page, tmp_path, demo_tokenizer
):
    """An ``[evaluation]`` run: the loss chart draws the training and the validation curve over the
    chance line, and "What the model says now" lists the fixed prompts with the model's own answers
    for the step the relay reports."""
    from playwright.sync_api import expect

    from tests.support.evaluation import PROMPTS, albert_run, train_until_evaluated

    page, problems = browser_page
    relay = start_relay(albert_run(tmp_path, demo_tokenizer))
    status = train_until_evaluated(relay, launch_peer, 2)
    page.goto(relay.url + "/")
    expect(page.locator("#connection")).to_have_text("live", timeout=UI_TIMEOUT_MS)
    chart = page.locator("#loss-chart")
    expect(chart.locator("polyline.loss")).to_have_count(1, timeout=UI_TIMEOUT_MS)
    expect(chart.locator("polyline.validation")).to_have_count(1)
    assert chart.get_attribute("data-validation-points") == str(len(status["evaluations"]))
    expect(chart.locator("text.ref-label").first).to_have_text("chance: ln 200 (tokens) = 5.298")
    expect(page.locator("#validation-key")).to_be_visible()
    last = status["evaluations"][-1]
    expect(page.locator("#loss-summary")).to_contain_text(
        f"Validation loss {to_precision_4(last['loss'])} at step {last['step']}"
    )

    expect(page.locator("#samples-panel")).to_be_visible()
    expect(page.locator("#h-samples")).to_have_text(f"What the model says now (step {last['step']})")
    expect(page.locator("#samples tbody td.prompt")).to_have_text(PROMPTS)
    answers = page.locator("#samples tbody td.answer")
    for i, sample in enumerate(last["samples"]):  # the relay's record of the model's output, token by token
        expect(answers.nth(i).locator("span.token")).to_have_text(sample["tokens"])
    page.screenshot(path=str(tmp_path / "dashboard-evaluation.png"), full_page=True)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "dashboard-evaluation.png"), full_page=True)
    assert (tmp_path / "dashboard-evaluation.png").stat().st_size > 10_000
    assert problems.snapshot() == [], problems


def test_dashboard_shows_the_stages_of_a_pipeline_run(start_relay, launch_stage_worker, browser_page):
    """A ``[pipeline]`` run (ByteTransformer, 2 stages, 4 real stage workers): the Pipeline panel
    shows a row per stage with its layers, parameters and workers by name, the batch in flight,
    the measured time per batch beside the (not yet planned) predicted one, and the samples each
    stage counted per round: exactly the batch's."""
    from playwright.sync_api import expect

    from tests.support.pipeline import pipeline_overrides
    from tests.support.pipeline_models import BYTE_SPEC

    page, problems = browser_page
    relay = start_relay(pipeline_overrides(BYTE_SPEC, stages=2))
    # Workers that keep training while the page is checked (one that reaches its last step leaves
    # the registry, and its name with it); a short sleep per task spares the shared CPUs.
    for i in range(4):
        launch_stage_worker(relay.url, f"w{i}", seed=i, until_step=1_000_000, extra=("--sleep-per-task", "0.05"))
    status = relay.wait_for(
        lambda s: s["step"] >= 1 and sum(len(st["workers"]) for st in s["pipeline"]["stages"]) == 4,
        timeout_s=120,
        what="a pipeline step with 4 stage workers",
    )
    p = status["pipeline"]
    names = {peer["peer_id"]: peer["name"] for peer in status["peers"]}
    assert sorted(names[w] for st in p["stages"] for w in st["workers"]) == ["w0", "w1", "w2", "w3"]
    stage_of = {w: st["stage"] for st in p["stages"] for w in st["workers"]}  # each peer in its role, with its stage
    assert {peer["peer_id"]: (peer["role"], peer["stage"]) for peer in status["peers"]} == {
        w: ("stage_worker", k) for w, k in stage_of.items()
    }

    page.goto(relay.url + "/")
    expect(page.locator("#connection")).to_have_text("live", timeout=UI_TIMEOUT_MS)
    expect(page.locator("#pipeline-panel")).to_be_visible()
    rows = page.locator("#pipeline-stages tbody tr")
    expect(rows).to_have_count(2)
    for k, stage in enumerate(p["stages"]):
        cells = rows.nth(k).locator("td")
        expect(cells.nth(0)).to_have_text(f"Stage {k}")
        expect(cells.nth(1)).to_have_text(f"{stage['layers'][0]}–{stage['layers'][1]}")
        expect(cells.nth(2)).to_have_text(f"{stage['params']:,}")
        for worker in stage["workers"]:  # by display name, the peer id in its tooltip
            expect(cells.nth(3).locator(f'span[title="{worker}"]')).to_have_text(names[worker])
        expect(cells.nth(8)).to_contain_text("8")  # the batch's samples, counted by this stage's server
    assert p["stages"][0]["layers"][1] == p["stages"][1]["layers"][0]  # contiguous stages
    expect(page.locator("#peers td.role")).to_have_text([re.compile(r"^stage worker · stage [01]$")] * 4)
    expect(page.locator("#pipeline-summary")).to_have_text(
        re.compile(r"Batch \d+: [0-4] of 4 micro-batches finished(\.|; its round is open)")
    )
    assert page.locator("#pipeline-progress").get_attribute("max") == "4"
    expect(page.locator("#pipeline-measured")).to_have_text(re.compile(r"^\d+(\.\d)? (ms|s)$"))
    predicted = page.locator("#pipeline-predicted")
    if relay.status()["pipeline"]["predicted_batch_s"] is None:  # the planner has not measured the workers yet
        expect(predicted).to_have_text("—")
        expect(predicted).to_have_attribute("title", "the planner predicts it once workers are measured")
    else:
        expect(predicted).to_have_text(re.compile(r"^\d+(\.\d)? (ms|s)$"))
    expect(page.locator("#pipeline-counted")).to_have_text(
        re.compile(r"every stage counted exactly the batch's 8 samples in (the last round|each of the last \d rounds)")
    )
    expect(page.locator("#pipeline-boundary")).to_have_text(
        re.compile(r"in memory, .+ spilled to disk, \d+(\.\d)? (B|KB|MB) per sample")
    )
    expect(page.locator("#pipeline-recovery")).to_contain_text(re.compile(r"\d+ tasks? re-dispatched"))
    expect(page.locator("#pipeline-recovery")).to_contain_text(re.compile(r"\d+ uploads? cut at the hold deadline"))
    expect(page.locator("#pipeline-trust")).to_have_text("not checked (pipeline.check_share = 0)")

    ARTIFACTS.mkdir(exist_ok=True)
    page.locator("#pipeline-panel").screenshot(path=str(ARTIFACTS / "dashboard-pipeline.png"))
    page.screenshot(path=str(ARTIFACTS / "dashboard-pipeline-page.png"), full_page=True)
    assert problems.snapshot() == [], problems


def test_the_dashboard_says_when_the_relay_refused_a_step(relay_factory, browser_page):
    """Two accepted uploads whose step at lr 1e30 would overflow the parameters: the relay refuses
    the step (``refused_steps`` in ``/api/status``), and the page says so beside the round, not only
    the JSON."""
    import numpy as np
    from playwright.sync_api import expect

    from tests.support.peers import SignedPeer
    from toolkit.wire.protocol import Heartbeat

    page, problems = browser_page
    relay = relay_factory(
        model={"factory": "toolkit.models:Vector", "kwargs": {"numel": 64}},
        optimizer={"name": "sgd", "lr": 1e30, "weight_decay": 0.0, "momentum": 0.0},
    )
    peers = [SignedPeer.login(relay, name).join(f"{name}-nb") for name in ("alice", "bob")]
    for peer in peers:
        peer.client.heartbeat(peer.peer_id, Heartbeat(version=0, samples=5, samples_per_s=10.0))
    for peer in peers:
        assert peer.upload(np.full(64, 1e10, np.float32), samples=5).status_code == 200
    relay.wait_for(lambda s: s["refused_steps"] == 1, what="the refused step")
    page.goto(relay.url + "/")
    expect(page.locator("#connection")).to_have_text("live", timeout=UI_TIMEOUT_MS)
    expect(page.locator("#refused-steps")).to_be_visible()
    expect(page.locator("#refused-steps")).to_contain_text("1 step refused")
    expect(page.locator("#step")).to_have_text("0")
    assert problems.snapshot() == []


# --- a pipeline run's figures, read off the page as an observer reads them -----------------------

BYTE_UNITS = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
READ_PAGE = """() => {
  const t = (id) => document.getElementById(id).textContent;
  const bar = document.getElementById("round-progress");
  const mode = [...document.querySelectorAll("#config dt")].find((dt) => dt.textContent === "Mode");
  return {
    samplesPerS: t("samples-per-s"), bytesUp: t("bytes-up"), bytesDown: t("bytes-down"),
    reportedHidden: document.getElementById("samples-per-s-reported").hidden,
    roundLabel: t("round-label"), roundText: t("round-text"), barValue: bar.value, barMax: bar.max,
    mode: mode ? mode.nextElementSibling.textContent : null,
    planHidden: document.getElementById("plan-panel").hidden,
    tasksHeaderHidden: document.querySelector("#peers th.pipeline").hidden,
    peers: [...document.querySelectorAll("#peers tbody tr")].map((tr) => ({
      name: tr.cells[0].textContent,
      contributed: tr.querySelector("td.contributed") && tr.querySelector("td.contributed").textContent,
      tasks: tr.querySelector("td.tasks") && tr.querySelector("td.tasks").textContent,
    })),
    wasted: [...document.querySelectorAll("#pipeline-wasted tbody tr")].map((tr) =>
      [...tr.cells].map((td) => td.textContent)),
  };
}"""


def page_number(text: str) -> float:
    """A figure as the page prints it: "1,234", "1.6", "43 KB", "3.7 MB"."""
    value, _, unit = text.strip().partition(" ")
    return float(value.replace(",", "")) * BYTE_UNITS.get(unit, 1)


def within_10_percent(shown: float, truth: float) -> bool:
    return abs(shown - truth) <= 0.1 * abs(truth) + 1e-9


def pipeline_figures_differ(page, relay, *, frozen: bool) -> list[str]:
    """Every figure the page shows for a pipeline run against ``/api/status`` and ``/api/pipeline``
    read just after it: what differs by more than 10% (empty: all agree). ``frozen``: the workers
    are stopped, so the batch's progress and its wasted work stand still and are compared too."""
    import requests

    shown = page.evaluate(READ_PAGE)
    status, pipe = relay.status(), requests.get(relay.url + "/api/pipeline", timeout=10).json()
    wrong: list[str] = []

    def check(what: str, shown_value: float, truth: float) -> None:
        if not within_10_percent(shown_value, truth):
            wrong.append(f"{what}: the page shows {shown_value}, the relay {truth}")

    check("samples/s", page_number(shown["samplesPerS"]), status["samples_per_s"])
    check("bytes up per sample", page_number(shown["bytesUp"]), status["traffic"]["up_bytes_per_sample"])
    check("bytes down per sample", page_number(shown["bytesDown"]), status["traffic"]["down_bytes_per_sample"])
    names = {p["peer_id"]: p["name"] for p in status["peers"]}
    rows = {row["name"]: row for row in shown["peers"]}
    for worker in pipe["workers"]:
        row = rows.get(names[worker["peer_id"]])
        if row is None or row["contributed"] is None or row["tasks"] is None:
            wrong.append(f"worker {names[worker['peer_id']]}: no contributed/tasks cells on the page ({row})")
            continue
        check(f"{row['name']} contributed", page_number(row["contributed"]), worker["samples"])
        check(f"{row['name']} tasks", page_number(row["tasks"]), worker["tasks"])
    stages, micro = len(pipe["stages"]), pipe["microbatches"]
    expected_mode = f"pipeline: {stages} stages, {micro} micro-batches of {status['target_batch'] // micro} per batch"
    for what, ok in [
        (f"mode {shown['mode']!r}", shown["mode"] == expected_mode),
        ("the averaging-plan panel hidden", shown["planHidden"]),
        ("no trainers' samples/s", shown["reportedHidden"]),
        ("the Tasks column shown", not shown["tasksHeaderHidden"]),
        (f"round label {shown['roundLabel']!r}", shown["roundLabel"] == "Current batch"),
        (f"bar max {shown['barMax']} = tasks per batch {pipe['tasks_total']}", shown["barMax"] == pipe["tasks_total"]),
        (f"round text {shown['roundText']!r}", "micro-batch tasks" in shown["roundText"]),
    ]:
        if not ok:
            wrong.append(what)
    if frozen:
        progress = status["progress"]
        check("tasks done", shown["barValue"], progress["done"])
        if (
            progress["done"] < progress["total"]
            and f"{progress['done']} of {progress['total']}" not in shown["roundText"]
        ):
            wrong.append(f"round text {shown['roundText']!r} vs {progress}")
        now, total = pipe["wasted_now"], ["All batches", pipe["redispatched"], pipe["redone"], pipe["refused_results"]]
        table = {row[0]: [page_number(x) for x in row[1:]] for row in shown["wasted"]}
        expected = {
            f"Batch {now['batch']} (in flight)": now,
            **{f"Batch {w['batch']}": w for w in pipe["wasted"][-5:]},
        }
        for label, w in expected.items():
            if table.get(label) != [w["redispatched"], w["recomputed"], w["refused"]]:
                wrong.append(f"wasted work {label}: the page shows {table.get(label)}, the relay {w}")
        if table.get(total[0]) != total[1:]:
            wrong.append(f"wasted work in all batches: the page shows {table.get(total[0])}, the relay {total[1:]}")
    return wrong


def test_the_dashboard_shows_a_pipeline_run_s_figures_as_the_relay_counts_them(
    start_relay, launch_stage_worker, browser_page
):
    """A live pipeline run (2 stages, 3 real stage workers): every figure the dashboard shows --
    samples/s, each worker's contributed samples and tasks, bytes per sample both ways, the mode,
    the batch's progress in micro-batch tasks, the wasted work per batch -- within 10% of
    ``/api/status`` and ``/api/pipeline``, first while it trains, then with the workers stopped
    (SIGSTOP: their leases lapse, so the batch in flight shows re-dispatched tasks), and no
    averaging-plan panel. The relay's own figures are checked against the run itself: samples/s
    from the committed batches' times, contributions summing to the leaderboard's."""
    import os
    import signal

    from playwright.sync_api import expect

    from relay_server.harness.process import wait_until
    from tests.support.pipeline import pipeline_overrides
    from tests.support.pipeline_models import BYTE_SPEC

    page, problems = browser_page
    overrides = pipeline_overrides(BYTE_SPEC, stages=2)
    overrides["rounds"] = {"peer_ttl_s": 600.0}  # stopped workers stay listed while their figures are read
    relay = start_relay(overrides)
    workers = [
        launch_stage_worker(relay.url, f"w{i}", seed=i, until_step=1_000_000, extra=("--sleep-per-task", "0.05"))
        for i in range(3)
    ]
    status = relay.wait_for(
        lambda s: s["samples_per_s_rounds"] >= 2 and len(s["peers"]) == 3,
        timeout_s=180,
        what="three committed batches with three stage workers",
    )
    rounds = status["recent_rounds"][-1 - status["samples_per_s_rounds"] :]  # the relay's samples/s, from its batches
    span = rounds[-1]["finalized_at"] - rounds[0]["finalized_at"]
    assert 0 < status["samples_per_s"] <= sum(r["samples"] for r in rounds[1:]) / span * 1.000001

    page.goto(relay.url + "/")
    expect(page.locator("#connection")).to_have_text("live", timeout=UI_TIMEOUT_MS)
    expect(page.locator("#plan-panel")).to_be_hidden()
    wrong: list[str] = []

    def agree(frozen: bool) -> bool:
        wrong[:] = pipeline_figures_differ(page, relay, frozen=frozen)
        return not wrong

    try:
        wait_until(lambda: agree(False), 60, "the dashboard's figures to match the relay's while it trains")
    except TimeoutError:
        pytest.fail(f"the dashboard's figures differ from the relay's: {wrong}")
    board = relay.status()["leaderboard"]
    pipe = page.request.get(relay.url + "/api/pipeline").json()
    assert sum(w["samples"] for w in pipe["workers"]) == sum(e["samples"] for e in board)  # one count, two views

    def stop_workers(stop: bool) -> None:
        for worker in workers:
            os.kill(worker.proc.pid, signal.SIGSTOP if stop else signal.SIGCONT)

    try:
        # Only a lease held when the workers stop can lapse; stopped between tasks (none held,
        # as a clean-clone CI run once caught them) they are let go on and stopped again.
        for _ in range(10):
            stop_workers(True)
            try:
                relay.wait_for(
                    lambda s: s["pipeline"]["wasted_now"]["redispatched"] > 0,
                    timeout_s=15,  # leases are 2 s
                    what="a lapsed lease re-dispatched",
                )
                break
            except TimeoutError:
                stop_workers(False)
                time.sleep(0.5)
        else:
            pytest.fail("ten times the stopped workers held no lease that could lapse")
        try:
            wait_until(lambda: agree(True), 30, "the dashboard's figures to match the relay's, the workers stopped")
        except TimeoutError:
            pytest.fail(f"the dashboard's figures differ from the relay's: {wrong}")
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "dashboard-pipeline-figures.png"), full_page=True)
    finally:
        stop_workers(False)
    assert problems.snapshot() == [], problems
