"""The stage worker: what a volunteer's machine runs in a pipeline run (``toolkit.join`` on one).

It asks the relay for a stage (by its memory and speed), builds only that stage
(:func:`toolkit.pipeline.stages.build_stage`), downloads only that stage's slice of the published
version, then pulls tasks until stopped:

* ``first`` -- a micro-batch of its own data through stage 0; sends the output and the data (a
  ``replay`` task carries the data instead: a rollback undid its batch, and the relay replays the
  micro-batch on the data first read for it);
* ``forward`` -- the stage on the input the relay sends; sends the output;
* ``last`` -- forward, loss and backward at once; sends the gradient of the stage's input;
* ``backward`` -- recomputes the stage from the stored input (or its own cached copy: the relay
  leaves the input out when this worker ran the forward and still holds it) and sends the
  gradient of the stage's input.

Every forward, and every forward a backward recomputes, runs as :mod:`toolkit.pipeline.compute`
says: with the dropout masks of its (micro-batch, stage), whichever worker runs it, and under the
run's precision.

The loss is scaled by the micro-batch's samples, so every gradient is a *sum* over samples, as a
data-parallel peer's is (the relay divides by the batch). A task's parameter gradient is kept
apart until the relay accepts its result: the first result of a task wins, and a worker whose
result came second drops that gradient, so no micro-batch is ever counted twice. When the batch
is complete the relay lists the micro-batches whose stage gradient this worker holds; it uploads
their sum with a ticket naming exactly them, through the ticketed slice upload every sliced run
uses.

A tied input/output embedding (GPT-2's default): the last stage's head reads a copy of stage 0's
range of the matrix, downloaded with each version its tasks compute on, and its upload carries
the head's gradient of it after the stage's own (:mod:`relay_server.pipeline.tied` folds it into
stage 0's before the step).

Every task names the version it computes on. With delayed parameter updates
(``run.max_staleness = 1``) batch ``b``'s tasks compute on version ``b - 1`` while batch
``b + 1``'s compute on ``b``, so the worker keeps its stage of two versions and a stage-gradient
sum per batch (:mod:`toolkit.pipeline.held`), and fetches each version by its exact step (the
relay serves a version while a batch in flight uses it).

The worker is a member of the run as every role is (:mod:`toolkit.run_membership`): the membership
heartbeats for it, joins again when the relay forgot its peer id (the worker then asks for a stage
again), and its backoff paces the retries while the relay is out of reach.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from toolkit.errors import CollabError, RelayRejected, volunteer_line
from toolkit.pipeline import compute
from toolkit.pipeline.batch_data import batch_tensors, carried_batch, from_tensors, to_device
from toolkit.pipeline.held import BatchSums, StageVersions
from toolkit.pipeline.stages import Stage, build_stage, cut_stages, units_of
from toolkit.pipeline.worker_memory import CACHE_INPUTS
from toolkit.run_membership import Membership, waits_out
from toolkit.runtime.precision import PrecisionPolicy
from toolkit.transfer import slice_part
from toolkit.wire import payloads
from toolkit.wire.compression import boundary_codec, get_codec
from toolkit.wire.protocol import (
    GradientMeta,
    Heartbeat,
    JoinResponse,
    PipelineDone,
    PipelineResult,
    PipelineRoundCall,
    PipelineTask,
    PipelineTicketRequest,
    PlanSlice,
    RunInfo,
    StageAssignment,
    StageRequest,
)

log = logging.getLogger(__name__)
STAGE_LOST = frozenset({"no_stage", "stage_mismatch", "stage_moved", "batch_restarted"})
"""The relay's answers that mean it no longer knows this worker's stage (a rejoin, a restart that
lost it, a re-plan) or that what it holds is void (its batch restarted after a liar was banned):
the worker asks for a stage again, dropping what it held."""
FINAL = frozenset({"stage_too_large"})
"""Refusals no retry changes (this machine cannot hold any stage): the worker ends, saying so."""


@dataclass
class WorkerProgress:
    stage: int
    num_stages: int
    step: int
    tasks_done: int
    tasks_refused: int
    microbatches_held: int
    last_loss: float | None
    uploads: int


class StageWorker:
    def __init__(
        self,
        membership: Membership,
        run: RunInfo,
        batches: Iterator[Any],
        *,
        device: str | torch.device = "cpu",
        memory_bytes: int = 0,
        on_first: Callable[[int, Any], None] | None = None,
        precision: PrecisionPolicy | None = None,
    ) -> None:
        """``membership``: this worker's, joined (the worker supplies its heartbeat and what to do
        on a rejoin). ``on_first(microbatch, batch)``: called when the relay accepted this worker's
        first-stage result for ``microbatch`` (which data went into which batch: tests replay it).
        ``precision``: what the stage computes in; by default the run's pin (fp32 when it pins
        none: :func:`toolkit.pipeline.compute.stage_precision`)."""
        self.membership, self.client, self.info, self.batches = membership, membership.client, run, batches
        self._stage_lost = threading.Event()
        self.on_first = on_first
        self.device, self.memory_bytes = torch.device(device), memory_bytes
        self.precision = precision or compute.stage_precision(run.precision, self.device)
        self.codec = boundary_codec(run.pipeline.get("boundary_codec", "none"))
        self.units = units_of(run.model)
        self.assignment: StageAssignment | None = None
        self.stage: Stage | None = None
        self.version = -1
        self.versions = StageVersions()
        self.cache: OrderedDict[int, Any] = OrderedDict()  # micro-batch -> the stage input it ran forward on
        self._reset_sum()
        self.tasks_done = self.tasks_refused = self.uploads = 0
        self.last_loss: float | None = None
        self.samples_per_s = 0.0
        self._stop = threading.Event()
        # last: the membership may be heartbeating already (from the join on), and reports from now
        membership.play(report=self._report, on_rejoin=self._on_rejoin)

    @property
    def peer_id(self) -> str:
        """This worker's id in the run (its membership's: a new one after the relay forgot it)."""
        return self.membership.peer_id

    # --- the stage ------------------------------------------------------------------------------
    def _take_stage(self) -> None:
        self.assignment = a = self.client.pipeline.stage(
            self.peer_id, StageRequest(memory_bytes=self.memory_bytes, samples_per_s=self.samples_per_s)
        )
        cut = cut_stages(self.units, a.layers_per_stage)[a.stage]
        if (cut.start, cut.end) != (a.start, a.end):
            raise CollabError(
                "stage_mismatch",
                f"the relay's stage {a.stage} is [{a.start}, {a.end}), this toolkit cuts [{cut.start}, {cut.end})",
                "Install the relay's collabtrain version.",
            )
        self.stage = build_stage(self.info.model, cut, self.device)
        self.params = list(self.stage.parameters())
        self.version = -1
        self.versions = StageVersions()
        self.cache.clear()
        self._reset_sum()
        log.info(
            "pipeline stage %d of %d: layers %s, %d parameters",
            a.stage,
            a.num_stages,
            a.layers_per_stage,
            a.end - a.start,
        )

    def _ensure_version(self, version: int) -> None:
        """The stage's parameters of exactly ``version`` in the module: kept, or fetched by its
        step (never "the latest": with delayed updates a task computes on the version before it);
        :class:`_Stale` when the relay serves it no more (no batch in flight uses it)."""
        if self.version == version:
            return
        a, tied = self.assignment, self.stage.tied
        flat = self.versions.get(version)
        if flat is None:  # the stage's slice, then (a tied head) its copy of stage 0's matrix, of one version
            own = a.end - a.start
            flat = np.zeros(own + (tied[1] - tied[0] if tied else 0), dtype=np.float32)
            try:
                self.client.pipeline.download_stage_at(self.peer_id, a.start, a.end, flat[:own], step=version)
                if tied is not None:
                    self.client.pipeline.download_stage_at(self.peer_id, *tied, flat[own:], step=version)
            except RelayRejected as exc:
                if exc.code == "version_gone":
                    raise _Stale(version) from None
                raise
            self.versions.keep(version, flat)
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(torch.from_numpy(flat[offset : offset + p.numel()]).view_as(p))
                offset += p.numel()
        if tied is not None:
            self.stage.load_tied(flat[offset:])
        self.version = version

    def _reset_sum(self) -> None:
        self.sums = BatchSums(self.info.max_staleness)

    @property
    def held(self) -> list[int]:
        """The micro-batches whose stage gradient this worker holds (of every batch)."""
        return self.sums.held

    # --- the loop ---------------------------------------------------------------------------------
    def stop(self) -> None:
        self._stop.set()

    def run(
        self,
        *,
        until: Callable[[], bool] = lambda: False,
        on_progress: Callable[[WorkerProgress], None] | None = None,
        wait_s: int = 5,
    ) -> None:
        """Serve tasks until ``until()`` or :meth:`stop`, heartbeating meanwhile; the caller leaves
        (``membership.leave()``) once this returns."""
        self.membership.keep_alive(self.info.heartbeat_interval_s)
        self._stage_lost.set()  # the first stage is taken inside the loop: a relay away then is waited out too
        try:
            while not self._stop.is_set() and not until():
                try:
                    if self._stage_lost.is_set():  # the first, a new peer id, or a relay that forgot the stage
                        self._stage_lost.clear()
                        try:
                            self._take_stage()
                        except BaseException:
                            self._stage_lost.set()  # still without a stage: ask again next time
                            raise
                    self._serve_once(wait_s)
                    self.membership.succeeded()
                except CollabError as exc:
                    self._recover(exc)
                if on_progress is not None:
                    try:
                        on_progress(self.progress())
                    except CollabError as exc:  # the display is cosmetic: never the end of a worker
                        log.info("progress not shown this time: %s", exc.message)
        finally:
            self._stop.set()
            self.membership.stop(timeout_s=self.info.heartbeat_interval_s + 30)  # never mid-request at exit

    def _recover(self, exc: CollabError) -> None:
        """What the loop does about a failed call: ask for a stage again when the relay no longer
        knows this worker's; go on at once past a task or round that ended meanwhile; wait out what
        :func:`~toolkit.run_membership.waits_out` says can be (the membership's backoff, joining
        again on ``unknown_peer``); raise anything else (a refusal no retry changes)."""
        refused = exc if isinstance(exc, RelayRejected) else None
        if exc.code == "wrong_slice" or (refused is not None and exc.code in STAGE_LOST):
            log.debug("the relay no longer knows this worker's stage (%s): asking again", exc.code)
            self._stage_lost.set()
        elif exc.code == "no_version" or (
            refused is not None and refused.status in (409, 410) and exc.code not in FINAL
        ):
            log.debug("what this worker held is over (%s): going on", exc)
        elif waits_out(exc):
            if exc.code != "unknown_peer":  # a blip or a relay restart: the transport retried already
                log.warning("%s; trying again", volunteer_line(exc))
            self.membership.recover(exc, self._stop.wait)  # unknown_peer: joined again, _on_rejoin flags it
        else:
            raise exc

    def _serve_once(self, wait_s: int) -> None:
        work, tensors = self.client.pipeline.work(self.peer_id, wait_s=wait_s, cached=list(self.cache))
        if work.stage != self.assignment.stage:
            self._take_stage()
            return
        if work.round is not None:
            self._upload(work.round)
        for i, task in enumerate(work.tasks):
            try:
                self._ensure_version(task.version)
            except _Stale:
                continue  # the batch moved on; its tasks are gone
            self._do(task, {k[len(f"{i}.") :]: v for k, v in tensors.items() if k.startswith(f"{i}.")})

    def progress(self) -> WorkerProgress:
        a = self.assignment
        return WorkerProgress(
            stage=a.stage if a else -1,
            num_stages=a.num_stages if a else 0,
            step=self.version,
            tasks_done=self.tasks_done,
            tasks_refused=self.tasks_refused,
            microbatches_held=len(self.held),
            last_loss=self.last_loss,
            uploads=self.uploads,
        )

    def _report(self) -> Heartbeat:
        return Heartbeat(version=max(0, self.version), samples=0, samples_per_s=self.samples_per_s)

    def _on_rejoin(self, joined: JoinResponse) -> None:
        """The relay forgot this worker (it lost its data dir): the old id's stage is gone, and
        the parameters may be older than the ones this worker holds."""
        self.version = -1
        self._stage_lost.set()

    # --- tasks ------------------------------------------------------------------------------------
    def _do(self, task: PipelineTask, inputs: Mapping[str, np.ndarray]) -> None:
        started = time.monotonic()
        stage, a = self.stage, self.assignment
        out: dict[str, np.ndarray] = {}
        loss_sum, grads = 0.0, None
        if task.kind == "first":
            batch = carried_batch(inputs, a.microbatch_size, self.device) if task.replay else next(self.batches)
            y = compute.forward(stage, stage.inputs(to_device(batch, self.device)), task.microbatch, self.precision)
            out.update(self._rows("y", y))
            out.update(batch_tensors(batch))
            self._remember(task.microbatch, batch)
        elif task.kind == "forward":
            x = self._boundary(inputs, "x")
            y = compute.forward(stage, x, task.microbatch, self.precision)
            out.update(self._rows("y", y))
            self._remember(task.microbatch, x)
        else:
            batch = from_tensors(inputs, self.device) if any(k.startswith("batch") for k in inputs) else None
            if task.input_cached:
                x_in = self.cache[task.microbatch]
            else:
                x_in = batch if stage.first else self._boundary(inputs, "x")
            x = stage.inputs(to_device(x_in, self.device)) if stage.first else x_in
            result = compute.backward(
                stage,
                x,
                task.microbatch,
                self.precision,
                grad_output=None if task.kind == "last" else self._boundary(inputs, "g"),
                batch=batch,
                samples=a.microbatch_size,
            )
            if result.loss is not None:
                self.last_loss = result.loss
                loss_sum = result.loss * a.microbatch_size
            grads = result.params if result.tied is None else [*result.params, result.tied]  # the head's last
            if result.input is not None and not task.redo:
                out.update(self._rows("g", result.input))
        try:
            ack = self.client.pipeline.result(
                self.peer_id, PipelineResult(task_id=task.task_id, loss_sum=loss_sum), out
            )
        except RelayRejected as exc:
            if exc.status not in (409, 410):
                raise
            log.debug("result for %s refused (%s): dropped", task.task_id, exc.code)
            self.tasks_refused += 1
            return
        if not ack.accepted:
            self.tasks_refused += 1
            return
        self.tasks_done += 1
        if task.kind == "first" and self.on_first is not None:
            self.on_first(task.microbatch, self.cache.get(task.microbatch))
        elapsed = max(time.monotonic() - started, 1e-6)
        self.samples_per_s = (
            0.8 * self.samples_per_s + 0.2 * a.microbatch_size / elapsed
            if self.samples_per_s
            else a.microbatch_size / elapsed
        )
        if grads is not None:
            self.sums.add(task.batch, task.microbatch, grads, loss_sum)

    def _remember(self, microbatch: int, x: Any) -> None:
        self.cache[microbatch] = x
        while len(self.cache) > CACHE_INPUTS:
            self.cache.popitem(last=False)

    def _rows(self, name: str, h: torch.Tensor) -> dict[str, np.ndarray]:
        return payloads.encode_rows(
            name, h.detach().to("cpu", torch.float32).reshape(-1, h.shape[-1]).numpy(), self.codec
        )

    def _boundary(self, inputs: Mapping[str, np.ndarray], name: str) -> torch.Tensor:
        width = self.assignment.width
        rows = payloads.read_rows(inputs, name, None, width, self.codec)
        b = self.assignment.microbatch_size
        return torch.from_numpy(rows.copy()).to(self.device).view(b, rows.shape[0] // b, width)

    # --- rounds -----------------------------------------------------------------------------------
    def _upload_numel(self) -> int:
        """The values an upload carries: the stage's slice, then a tied head's gradient of stage 0's matrix."""
        a, tied = self.assignment, self.stage.tied
        return a.end - a.start + (tied[1] - tied[0] if tied is not None else 0)

    def _stage_gradient(self, grads: list[torch.Tensor] | None) -> np.ndarray:
        """What an upload carries: the held sum's values in the upload's layout (zeros when it holds none)."""
        if grads is None:
            return np.zeros(self._upload_numel(), dtype=np.float32)
        return torch.cat([g.reshape(-1) for g in grads]).to("cpu", torch.float32).numpy()

    def _upload(self, call: PipelineRoundCall) -> None:
        a = self.assignment
        mine = self.sums.pop(call.step)  # round ``step`` steps with batch ``step``'s gradient
        if sorted(mine.microbatches) != call.microbatches or mine.grads is None:
            log.debug(
                "the relay expects micro-batches %s of stage %d, this worker holds %s: its ticket request "
                "says so, and the relay recomputes them",
                call.microbatches,
                call.stage,
                sorted(mine.microbatches),
            )
        vector = self._stage_gradient(mine.grads)
        run_codec = get_codec(self.info.compression)
        tensors = list(run_codec.encode(vector))
        plan = PlanSlice(
            aggregator_id=f"stage{a.stage}", name=f"stage {a.stage}", start=a.start, end=a.end, fraction=0.0
        )
        held = sorted(mine.microbatches)
        meta = GradientMeta(
            peer_id=call.contributor,
            step=call.step,
            version=call.step,
            samples=max(1, len(held)) * a.microbatch_size,
            loss_sum=mine.loss_sum,
        )
        part = slice_part(plan, tensors, meta, run_codec.name, signed=self.client.signed)
        # popped above: whatever happens next, this sum is sent once or recomputed by the relay's choice
        try:
            ticket = self.client.pipeline.ticket(
                self.peer_id,
                call.step,
                PipelineTicketRequest(
                    round_id=call.round_id,
                    stage=a.stage,
                    microbatches=held,
                    loss_sum=meta.loss_sum,
                    header_sha256=part.header_sha256,
                ),
            )
        except RelayRejected as exc:
            log.debug("ticket refused (%s): this stage gradient is dropped and recomputed", exc)
            return
        error = self.client.params.upload_slices(call.step, ticket, [part])[0]
        if error is None:
            self.uploads += 1
        else:
            log.debug("stage gradient upload failed (%s): the relay recomputes its micro-batches", error)
        self.client.pipeline.done(
            self.peer_id,
            call.step,
            PipelineDone(round_id=call.round_id, contributor=call.contributor, delivered=error is None),
        )


class _Stale(Exception):
    """A newer version than the task's was published: the task's batch is over."""
