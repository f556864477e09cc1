"""Held-out evaluation of the published versions, off the round's path.

An :class:`Evaluator` is an observer like W&B and Hub checkpoints, but scoring a version takes
seconds of CPU, so it does not score on the observers' thread. ``on_step`` only hard-links the
version's file (the store prunes old ones) and marks it as the latest due version; a thread of its
own hands the latest one to an **evaluator process** and waits for its record. Versions published
while the process is busy are skipped, never queued: the evaluation follows the run at its own
pace. The process (:func:`worker_main`) runs at a lower priority with ``evaluation.threads``
torch threads -- a bound per process, which a thread inside the relay could not have (torch's
thread count is process-wide and the relay's optimizer step uses it).

Each record is appended to ``<data_dir>/evaluation.jsonl`` (read back at start, so the curve
survives a restart), shown in ``/api/status`` (``StatusReport.evaluations``) and passed to the
``listeners`` (W&B's eval/ metrics and samples table, the Hub model card). The samples are the
model's own output on the stated version, nothing else: prompts come from the configuration only,
and nothing an observer sends reaches the evaluator.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relay_server.core.config import RelayConfig
from relay_server.observers.events import StepEvent
from toolkit.wire.protocol import EvalRecord

log = logging.getLogger(__name__)

RECORDS_FILE = "evaluation.jsonl"
PENDING_DIR = "evaluation-pending"
STATUS_RECORDS = 200  # records in /api/status: the dashboard's chart spans about as many steps
START_TIMEOUT_S = 600.0  # reading the validation source (a Hub stream) and building the model
NICENESS = 10


def worker_main(config: RelayConfig, jobs: Any, results: Any) -> None:
    """The evaluator process: build the model and batches once, then score each (step, file) job."""
    import torch

    from relay_server.observers.eval_model import VersionScorer
    from relay_server.observers.pretrained import master_params

    try:
        os.nice(NICENESS)
    except OSError:
        pass
    torch.set_num_threads(config.evaluation.threads)
    try:
        scorer = VersionScorer(config)
    except Exception as exc:
        results.put(("error", f"evaluation cannot start: {type(exc).__name__}: {exc}"))
        return
    results.put(("ready", len(scorer.batches)))
    while (job := jobs.get()) is not None:
        step, path = job
        try:
            record = scorer.evaluate(step, master_params(Path(path)))
            results.put(("record", record.dumps().decode()))
        except Exception as exc:
            results.put(("failed", f"step {step}: {type(exc).__name__}: {exc}"))


class Schedule:
    """Which published versions are due: ``every_steps`` after the last due one, or ``every_s``
    seconds after it, the first one, the run's last one, and any after a rollback."""

    def __init__(
        self,
        every_steps: int,
        every_s: float,
        last_step: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.every_steps, self.every_s, self.clock = every_steps, every_s, clock
        self.last: tuple[int, float] | None = None if last_step is None else (last_step, clock())

    def due(self, step: int, finished: bool = False) -> bool:
        now, last = self.clock(), self.last
        due = (
            last is None
            or finished
            or step < last[0]
            or (self.every_steps > 0 and step - last[0] >= self.every_steps)
            or (self.every_s > 0 and now - last[1] >= self.every_s)
        )
        if due:
            self.last = (step, now)
        return due


class Evaluator:
    """Observer scoring the latest due version in its own process (``[evaluation]`` is set)."""

    def __init__(self, config: RelayConfig) -> None:
        self.config, self.section = config, config.evaluation
        self.data_dir = Path(config.server.data_dir)
        self.pending_dir = self.data_dir / PENDING_DIR
        shutil.rmtree(self.pending_dir, ignore_errors=True)  # a crash's leftovers: versions nobody waits for
        self.listeners: list[Callable[[EvalRecord], None]] = []
        self.records: list[EvalRecord] = load_records(self.data_dir / RECORDS_FILE)
        self.schedule = Schedule(
            self.section.every_steps, self.section.every_s, last_step=self.records[-1].step if self.records else None
        )
        self._latest: tuple[int, Path] | None = None
        self._lock = threading.Condition()
        self._closing = False
        self.process: Any = None
        self._thread = threading.Thread(target=self._run, name="relay-evaluator", daemon=True)
        self._thread.start()

    # --- the observers' thread: cheap, never waits on the evaluator ---------------------------
    def on_step(self, event: StepEvent) -> None:
        if event.state_path is None or not self.schedule.due(event.step, event.status.finished):
            return
        self.pending_dir.mkdir(parents=True, exist_ok=True)
        link = self.pending_dir / f"{event.step}.safetensors"
        link.unlink(missing_ok=True)
        try:
            os.link(event.state_path, link)  # the store may prune the version before it is scored
        except FileNotFoundError:
            return  # already pruned (the observers fell behind): the next due version is scored
        except OSError:  # no hard links here: copy
            shutil.copyfile(event.state_path, link)
        with self._lock:
            if self._latest is not None:
                self._latest[1].unlink(missing_ok=True)  # skipped: the evaluator is behind
            self._latest = (event.step, link)
            self._lock.notify()

    # --- the evaluator's thread ----------------------------------------------------------------
    def _run(self) -> None:
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no relay threads or sockets
        jobs, results = context.Queue(), context.Queue()
        self.process = context.Process(
            target=worker_main, args=(self.config, jobs, results), name="relay-evaluator", daemon=True
        )
        self.process.start()
        if not self._started(results):
            return
        while True:
            with self._lock:
                while self._latest is None and not self._closing:
                    self._lock.wait()
                if self._closing:
                    break
                step, link = self._latest  # type: ignore[misc]  # the wait above ends on one, or on closing
                self._latest = None
            jobs.put((step, str(link)))
            answer = self._answer(results)
            link.unlink(missing_ok=True)
            if answer is None:
                break
            kind, payload = answer
            if kind == "record":
                self._record(EvalRecord.loads(payload.encode()))
            else:
                log.error("evaluation failed on %s", payload)
        jobs.put(None)

    def _started(self, results: Any) -> bool:
        answer = self._answer(results, START_TIMEOUT_S)
        if answer is None or answer[0] != "ready":
            log.error(
                "%s; fix [evaluation] (the run goes on without it)",
                answer[1] if answer else "the evaluator process did not start",
            )
            return False
        log.info("evaluator ready: %d validation batches, every %s", answer[1], self._every())
        return True

    def _answer(self, results: Any, timeout_s: float | None = None) -> tuple[str, Any] | None:
        """The process's next message, or None once closing or the process died."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._closing and (deadline is None or time.monotonic() < deadline):
            try:
                return results.get(timeout=0.5)
            except queue.Empty:
                if not self.process.is_alive():
                    log.error("the evaluator process exited (code %s); evaluation is off", self.process.exitcode)
                    return None
        return None

    def _every(self) -> str:
        parts = [
            f"{self.section.every_steps} steps" if self.section.every_steps else "",
            f"{self.section.every_s:g} s" if self.section.every_s else "",
        ]
        return " or ".join(p for p in parts if p)

    def _record(self, record: EvalRecord) -> None:
        with open(self.data_dir / RECORDS_FILE, "a") as f:
            f.write(record.dumps().decode() + "\n")
        with self._lock:
            self.records = [r for r in self.records if r.step != record.step] + [record]
            del self.records[: -STATUS_RECORDS * 5]
        log.info(
            "step %d: validation loss %.4f (%d targets, %.1fs)",
            record.step,
            record.loss,
            record.targets,
            record.duration_s,
        )
        for listener in self.listeners:
            try:
                listener(record)
            except Exception:
                log.exception("evaluation listener %s failed on step %d", listener, record.step)

    # --- what /api/status shows -----------------------------------------------------------------
    def status_records(self) -> list[EvalRecord]:
        """Recent records, oldest first; only the last keeps its samples."""
        with self._lock:
            recent = self.records[-STATUS_RECORDS:]
        return [*(dataclasses.replace(r, samples=[]) for r in recent[:-1]), *recent[-1:]]

    def close(self) -> None:
        with self._lock:
            self._closing = True
            self._lock.notify()
        self._thread.join(10)
        if self.process is not None and self.process.is_alive():
            self.process.terminate()
            self.process.join(10)


def load_records(path: Path) -> list[EvalRecord]:
    """The records a previous run of this data dir wrote (a torn last line is skipped)."""
    if not path.is_file():
        return []
    records: dict[int, EvalRecord] = {}
    for line in path.read_text().splitlines():
        try:
            record = EvalRecord.loads(line.encode())
        except Exception:
            continue
        records[record.step] = record
    return sorted(records.values(), key=lambda r: r.step)[-STATUS_RECORDS * 5 :]
