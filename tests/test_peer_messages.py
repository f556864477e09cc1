"""What a peer says to its volunteer (issue 35): what it recovers from by itself is logged at
debug and kept off the panel; what it cannot fix is one line saying what to do.

The round_closed case is made for real: two peers on a real relay, one of them behind a real TCP
proxy that adds seconds of latency, so its gradient reaches the relay after the round it was
sent to closed at its deadline with the other peer's gradient.
"""

from __future__ import annotations

import logging
import threading

from relay_server.harness.latency_proxy import LatencyProxy
from tests.support.training import regression_step
from toolkit.errors import CollabError, handled_by_peer, volunteer_line
from toolkit.models import build_model
from toolkit.optimizer import CollaborativeOptimizer
from toolkit.wire.protocol import ModelSpec

SPEC = ModelSpec(factory="toolkit.models:MLP", kwargs={"sizes": [8, 16, 1]})
DELAY_S = 4.0  # the slow peer's round trip (through the proxy)
DEADLINE_S = 6.0
"""The round opens when the slow peer's report lands (half a round trip in); its last report before
uploading lands one round trip later (4 s after the opening: the round still open), its gradient
one more round trip later (8 s after: the round closed at 6 s, with the fast peer's gradient)."""


def test_a_round_that_closed_before_the_gradient_arrived_is_not_shown(serve_relay, caplog) -> None:
    relay = serve_relay(
        {
            "run": {"target_batch": 8, "max_staleness": 1},
            # heartbeats far apart: the slow peer's reports are its steps' own, in order
            "rounds": {
                "peer_ttl_s": 60.0,
                "heartbeat_interval_s": 30.0,
                "deadline_floor_s": DEADLINE_S,
                "deadline_initial_s": DEADLINE_S,
            },
            "optimizer": {"name": "sgd", "lr": 0.01, "weight_decay": 0.0, "schedule": "constant"},
        }
    )
    caplog.set_level(logging.DEBUG, logger="toolkit")
    fast_model, slow_model = build_model(SPEC), build_model(SPEC)
    with (
        LatencyProxy(relay.port) as proxy,
        CollaborativeOptimizer(fast_model, relay.url, batch_size_per_step=4, report_interval_s=0.0) as fast,
        CollaborativeOptimizer(slow_model, proxy.url, batch_size_per_step=4, report_interval_s=0.0) as slow,
    ):
        regression_step(fast, fast_model, 0)  # 4 of the 8 samples: no round yet
        proxy.delay_s = DELAY_S  # read per chunk: from now on
        failed: list[BaseException] = []

        def slow_job() -> None:
            try:
                regression_step(slow, slow_model, 1)
            except BaseException as exc:  # surfaced below
                failed.append(exc)

        slow_step = threading.Thread(target=slow_job)
        slow_step.start()  # its report opens the round; its gradient comes seconds later
        relay.wait_for(lambda s: s["round"] is not None, 30, "the round the slow peer's report opens")
        regression_step(fast, fast_model, 2)  # uploads at once; the round closes at its deadline with it alone
        slow_step.join(timeout=60)
        assert not slow_step.is_alive() and not failed, failed
        assert fast.version == 1 and relay.status()["step"] == 1
        assert slow.last_error is None  # nothing on the panel
    refusals = [r for r in caplog.records if r.name.startswith("toolkit") and "round_closed" in r.getMessage()]
    assert refusals and all(r.levelno == logging.DEBUG for r in refusals), [
        (r.levelname, r.getMessage()) for r in refusals
    ]
    assert "round 0 is not accepting gradients" in refusals[0].getMessage()
    shown = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert not any("not accepting gradients" in m for m in shown), shown


def test_a_problem_the_peer_cannot_fix_is_one_line_saying_what_to_do() -> None:
    line = volunteer_line(CollabError("stale_gradient", "dropped a micro-batch of 4 samples", "Train faster."))
    assert line == "dropped a micro-batch of 4 samples. What to do: Train faster." and "\n" not in line
    assert not handled_by_peer(CollabError("stale_gradient", "x")) and handled_by_peer(
        CollabError("round_closed", "x")
    )
