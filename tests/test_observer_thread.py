"""The observers' thread (``relay_server.observers.events.ObserverThread``) delivers steps in order
and never holds the relay's shutdown: an observer stuck on its service (a W&B or Hub endpoint that
never answers) with a full queue once made ``close()`` wait forever for room for its end marker."""

from __future__ import annotations

import logging
import threading

import pytest

from relay_server.observers.events import ObserverThread, StepEvent
from toolkit.wire.protocol import RoundRecord, RunSummary, StatusReport


def event(step: int) -> StepEvent:
    record = RoundRecord(
        step=step, contributors=1, samples=8, loss=1.0, duration_s=1.0, deadline_s=0.0, finalized_by="target"
    )
    summary = RunSummary(
        model="m", num_params=10, optimizer="sgd", lr=0.1, schedule="constant", target_batch=8,
        max_staleness=0, precision=None, compression="none", auth_mode="open", mode="data_parallel",
    )  # fmt: skip
    status = StatusReport(
        run_name="r", step=step, total_steps=0, finished=False, target_batch=8, num_params=10,
        samples_accumulated=0, samples_per_s=1.0, eta_s=None, loss=1.0, num_peers=1, peers=[],
        recent_rounds=[record], round=None, auth_mode="open", uptime_s=1.0, plan=None, config=summary,
    )  # fmt: skip
    return StepEvent(step=step, record=record, status=status, state_path=None)


class Recorder:
    """An observer that records the steps it saw; with ``gate`` it hangs in a step until released."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.steps: list[int] = []
        self.gate, self.closed, self.entered = gate, False, threading.Event()

    def on_step(self, event: StepEvent) -> None:
        self.entered.set()
        if self.gate is not None:
            self.gate.wait()
        self.steps.append(event.step)

    def close(self) -> None:
        self.closed = True


def test_every_queued_step_is_delivered_in_order_before_close_returns() -> None:
    recorder = Recorder()
    thread = ObserverThread([recorder])
    for step in range(1, 11):
        thread.publish(event(step))
    thread.close()
    assert recorder.steps == list(range(1, 11)) and recorder.closed


def test_an_observer_stuck_with_a_full_queue_does_not_hold_close(caplog: pytest.LogCaptureFixture) -> None:
    gate = threading.Event()
    recorder = Recorder(gate)
    before = set(threading.enumerate())
    thread = ObserverThread([recorder], max_pending=4)
    (observers,) = [t for t in threading.enumerate() if t not in before and t.name == "relay-observers"]
    thread.publish(event(1))
    assert recorder.entered.wait(30)  # step 1 in hand, stuck
    for step in range(2, 6):
        thread.publish(event(step))  # the queue is full
    with caplog.at_level(logging.WARNING, logger="relay_server.observers.events"):
        thread.close(timeout_s=0.2)  # returned: it used to wait here for ever
    assert "4 queued steps not delivered" in caplog.text, caplog.text
    assert recorder.closed
    gate.set()  # the service answers at last: the thread ends after the step in hand
    observers.join(30)
    assert not observers.is_alive() and recorder.steps == [1]
