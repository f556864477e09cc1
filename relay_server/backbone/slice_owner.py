"""One slice ``[start, end)`` of the flat vector and everything that lives with it.

The master parameters and optimizer state of the slice (:class:`MasterState`), the streaming
reduction of gradient uploads into it (:class:`Reducer`) and its published versions
(:class:`Publisher`). The relay owns one -- the whole vector when no aggregator is registered,
which is the single-relay path unchanged -- and each aggregator owns the one its plan assigns
(DESIGN.md s3, s6). Both run the same code: this module.

Ticketed uploads (aggregator rounds, ``toolkit.wire.protocol.Ticket``): the relay decides who may
upload; the owner checks the ticket names this slice, this step, this plan and the very header
it receives, then reduces part-wise (every chunk weighted by the samples that delivered it).
A round the owner hears of is open until the relay asks it to finalize; a new round id for the
same step means the relay abandoned the previous one (it closed with no complete gradient), so
its partial sums are dropped.

With global-norm clipping the relay closes a round in two calls: :meth:`SliceOwner.grad_sq_norm`
closes it (no upload enters it afterwards) and turns the sum into the mean, once; then
:meth:`SliceOwner.finalize` steps with the global norm the relay summed from every owner.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from relay_server.core.config import OptimizerSection
from relay_server.core.errors import ApiError, round_closed
from relay_server.rounds.master import MasterState, NonFiniteStep, StepReport
from relay_server.rounds.membership import RoundClosedMidUpload
from relay_server.rounds.publisher import Publisher, Version
from relay_server.rounds.reducer import Reducer, UploadProgress
from relay_server.rounds.robust import CenteredClipConfig
from relay_server.rounds.store import Store
from toolkit.errors import ProtocolError
from toolkit.wire.compression import RunCodecs
from toolkit.wire.protocol import GradientMeta, ParamSpec, Ticket, UploadReceipt
from toolkit.wire.tensor_container import AsyncContainerReader

log = logging.getLogger(__name__)

TransferHook = Callable[[str, str, int, int, float], None]  # peer_id, "up"/"down", step, bytes, started


@dataclass
class SliceRound:
    """What one owner knows of a round: who uploaded, and whether it was finalized."""

    step: int
    round_id: str
    uploading: set[str] = field(default_factory=set)
    received: dict[str, int] = field(default_factory=dict)
    partial: set[str] = field(default_factory=set)
    closed: bool = False
    meaned: bool = False  # the sum became the mean (grad_sq_norm, carried_mean or add_to_mean, before finalize)
    sq_norm: float | None = None  # the mean's squared norm, once asked (grad_sq_norm)
    added: bool = False  # another owner's carried values were added into the mean (add_to_mean)
    refused: bool = False  # the step was refused and the slice published unchanged


class SliceOwner:
    def __init__(
        self,
        layout: list[ParamSpec],
        state: dict[str, np.ndarray],
        *,
        start: int,
        end: int,
        step: int,
        optimizer: OptimizerSection,
        total_steps: int,
        codecs: RunCodecs,
        store: Store,
        fsync: bool = False,
        robust: CenteredClipConfig | None = None,
        run_name: str = "",
        plan_version: str = "",
        on_transfer: TransferHook | None = None,
        adopt: bool = False,
        download_feedback: float = 1.0,
        carry: int = 0,
    ) -> None:
        """``state``: ``params`` (end - start,) and optionally ``opt.*``/``opt_scalar.*``
        (:meth:`MasterState.export_state`) and ``public`` (lossy codecs: what peers hold).
        ``adopt``: ``params`` is a fresh float32 vector the master may keep (no copy). ``codecs.up``
        decodes uploads, ``codecs.down`` encodes the published deltas. ``carry``: values every
        upload carries past the slice, reduced with it (whole or nothing) but never stepped here:
        their round's mean goes to the owner of what they are a gradient of (:meth:`carried_mean`;
        a pipeline's tied head, :mod:`relay_server.pipeline.tied`)."""
        self.start, self.end, self.codecs, self.store = start, end, codecs, store
        self.run_name, self.plan_version, self.carry = run_name, plan_version, carry
        # the round's sum: the slice's, then the carry. Written zeros (torch's), not np.zeros's lazy
        # calloc: the buffer is resident from the start, as the relay's memory prediction counts it
        buffer = torch.zeros(end - start + carry).numpy()
        self.master = MasterState(
            layout,
            state["params"],
            optimizer,
            total_steps,
            step=step,
            start=start,
            end=end,
            adopt=adopt,
            grad=buffer[: end - start],
        )
        if any(name.startswith("opt") for name in state):
            self.master.import_state(state, step)
        # uploads in flight wait for their last chunk in unlinked files on the data disk, not in /tmp (often RAM)
        self.reducer = Reducer(buffer, codecs.up, robust=robust, spool_dir=str(store.dir))
        self.publisher = Publisher(
            store, codecs.down, self.master, public=state.get("public"), fsync=fsync, feedback=download_feedback
        )
        self.on_transfer = on_transfer
        self.refused_steps = 0  # steps that would have made this slice non-finite, published unchanged
        self.round: SliceRound | None = None
        self._abandoned: set[str] = set()  # round ids the relay gave up on (bounded below)
        self._finalized: dict[
            str, tuple[Version, float, bool]
        ] = {}  # round id -> (version, norm, refused): idempotent
        self._switch = asyncio.Lock()

    def close(self) -> None:
        self.reducer.close()

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def upload_numel(self) -> int:
        """The values one upload carries: the slice's and the :attr:`carry`."""
        return self.numel + self.carry

    @property
    def step(self) -> int:
        """The published version of this slice."""
        return self.publisher.latest.step if self.publisher.latest else self.master.step

    def meta(self, **extra: str) -> dict[str, str]:
        return {"run": self.run_name, "start": str(self.start), "end": str(self.end), **extra}

    # --- writing versions (reducer thread) -----------------------------------------------------
    def write_initial(self, *, delta: bool = False) -> Version:
        """Persist the state as it is now as version ``master.step`` (a new owner's first version;
        ``delta=False``: peers download it whole)."""
        return self.publisher.write(self.master.step, self.meta(), delta=delta)

    def apply_round(self, meaned: bool = False, global_norm: float | None = None) -> tuple[Version, StepReport]:
        """Reducer thread, after every add of the round: mean (unless ``meaned``), optimizer step
        (clipping by ``global_norm`` when given), persist. The sum is zeroed after publishing
        (``reducer.submit(reducer.reset)``), off the critical path."""
        if not meaned:
            self.reducer.finish_mean()
        try:
            report = self.publisher.apply_step(global_norm)
        except NonFiniteStep as exc:
            # Nothing non-finite is published. The owners of a sliced round step in
            # lock-step (the relay commits version step + 1 of every slice together), so this
            # slice publishes its state unchanged -- exactly as before the step -- as that version.
            self.refused_steps += 1
            log.error(
                "step %d refused on slice [%d, %d): %s; the slice is published unchanged",
                self.master.step + 1,
                self.start,
                self.end,
                exc,
            )
            self.master.step += 1
            report = StepReport(self.master.step, 0.0, 0.0, refused=True)
        return self.publisher.write(report.step, self.meta()), report

    def export(self) -> tuple[int, dict[str, np.ndarray]]:
        """Reducer thread: the slice's state (master ``params``, optimizer, lossy ``public``)."""
        state = self.master.export_state()
        if not self.codecs.down.lossless:
            state["public"] = self.publisher.public.copy()
        return self.master.step, state

    # --- ticketed rounds (event loop) ----------------------------------------------------------
    async def receive(
        self,
        ticket: Ticket,
        head: bytes,
        reader: AsyncContainerReader,
        verify: Callable[[np.ndarray], Awaitable[None]] | None = None,
    ) -> UploadReceipt:
        """Reduce one ticketed slice upload whose container header ``head`` was already read
        (``verify``: an audit of the whole decoded slice before it commits, :meth:`Reducer.reduce`)."""
        started = time.monotonic()
        r = await self._round_for(ticket)
        peer_id = ticket.peer_id
        if peer_id in r.received or peer_id in r.uploading or peer_id in r.partial:
            raise ApiError(
                409,
                "duplicate_upload",
                f"peer already sent this slice for round {ticket.step}",
                "Keep accumulating; the next round takes the new samples.",
            )
        digest = next((d for d in ticket.slices if (d.start, d.end) == (self.start, self.end)), None)
        if digest is None:
            raise ApiError(
                409,
                "wrong_slice",
                f"this server owns [{self.start}, {self.end}), which the ticket does not name",
                "Fetch the plan again (GET /api/plan); the slices moved.",
            )
        if hashlib.sha256(head).hexdigest() != digest.header_sha256:
            raise ApiError(403, "ticket_mismatch", "the upload is not the container the ticket was issued for")
        header = await reader.read_header()
        self.reducer.check(header)
        meta = gradient_meta(header.metadata)
        if (meta.peer_id, meta.step, meta.version, meta.samples) != (
            peer_id,
            ticket.step,
            ticket.version,
            ticket.samples,
        ):
            raise ApiError(422, "bad_meta", "gradient metadata does not match the ticket")
        r.uploading.add(peer_id)

        def commit() -> None:
            """The reducer's commit point: the slice counts whole or not at all."""
            r.uploading.discard(peer_id)
            r.received[peer_id] = ticket.samples

        progress = UploadProgress(on_commit=commit)
        try:
            await self.reducer.reduce(
                reader, header, ticket.samples, lambda: not r.closed, progress, peer_id, verify=verify
            )
        except BaseException as exc:
            if not progress.committed:
                r.uploading.discard(peer_id)
            if isinstance(exc, RoundClosedMidUpload):
                raise round_closed(ticket.step, self.step) from None
            raise
        if self.on_transfer is not None:
            self.on_transfer(peer_id, "up", ticket.step, header.header_bytes + header.data_bytes, started)
        return UploadReceipt(step=ticket.step, accepted_samples=ticket.samples, received_peers=len(r.received))

    def receipt(self, ticket: Ticket) -> UploadReceipt | None:
        """The receipt of ``ticket``'s upload if it committed in the current round (an upload cut
        by a deadline while its commit ran still counts, and must be answered as counted)."""
        r = self.round
        if r is None or r.round_id != ticket.round_id or ticket.peer_id not in r.received:
            return None
        return UploadReceipt(
            step=ticket.step, accepted_samples=r.received[ticket.peer_id], received_peers=len(r.received)
        )

    async def _round_for(self, ticket: Ticket) -> SliceRound:
        if ticket.plan_version != self.plan_version:
            raise ApiError(
                409,
                "plan_changed",
                f"the ticket is for plan {ticket.plan_version}, this server follows {self.plan_version}",
                "Fetch the plan again; the round will follow it.",
            )
        async with self._switch:  # checked under the lock: a finalize may be moving the step
            if ticket.step != self.step or ticket.round_id in self._abandoned or ticket.round_id in self._finalized:
                raise round_closed(ticket.step, self.step)
            r = self.round
            if r is None or r.round_id != ticket.round_id:
                await self._abandon(r)
                r = self.round = SliceRound(step=ticket.step, round_id=ticket.round_id)
            elif r.closed:  # between grad_sq_norm and finalize: the mean is taken
                raise round_closed(ticket.step, self.step)
            return r

    async def _close(self, step: int, round_id: str) -> SliceRound:
        """Under ``_switch``: round ``round_id``, closed (a fresh one if no upload reached us)."""
        r = self.round
        if r is None or r.round_id != round_id:  # no upload reached this slice in this round
            await self._abandon(r)
            r = self.round = SliceRound(step=step, round_id=round_id)
        r.closed = True
        return r

    async def _abandon(self, r: SliceRound | None) -> None:
        """The relay moved on from ``r`` without finalizing it: drop what it reduced."""
        if r is None:
            return
        r.closed = True
        self._abandoned.add(r.round_id)
        if len(self._abandoned) > 256:
            self._abandoned.pop()
        if r.received or r.partial or r.uploading:
            log.info("round %s of step %d abandoned by the relay; dropping its partial sums", r.round_id, r.step)
        await self.reducer.run(self.reducer.reset)  # after any chunk already handed to the thread

    async def grad_sq_norm(self, step: int, round_id: str) -> float:
        """Close round ``round_id`` and answer its mean gradient's squared norm, without stepping
        (global-norm clipping: :meth:`finalize` follows with the global norm). Idempotent."""
        if round_id in self._finalized:
            return self._finalized[round_id][1] ** 2
        if step != self.step:
            raise ApiError(409, "wrong_step", f"grad norm for step {step}, but this slice is at {self.step}")
        async with self._switch:
            r = await self._close(step, round_id)
            if r.sq_norm is None:
                await self._mean(r)
                r.sq_norm = await self.reducer.run(self.master.grad_sq_norm)
            return r.sq_norm

    async def _mean(self, r: SliceRound) -> None:
        """Under ``_switch``, the round closed: its sum becomes its mean, once."""
        if not r.meaned:
            await self.reducer.run(self.reducer.finish_mean)
            r.meaned = True

    async def carried_mean(self, step: int, round_id: str) -> np.ndarray | None:
        """Close round ``round_id`` and answer the mean of what its uploads carried past the slice
        (:attr:`carry` values, a copy); None once the round is finalized (its carry was handed
        over before). Idempotent."""
        if round_id in self._finalized:
            return None
        if step != self.step:
            raise ApiError(409, "wrong_step", f"carried mean for step {step}, but this slice is at {self.step}")
        async with self._switch:
            r = await self._close(step, round_id)
            await self._mean(r)
            return await self.reducer.run(lambda: self.reducer.sum[self.numel :].copy())

    async def add_to_mean(self, step: int, round_id: str, offset: int, values: np.ndarray) -> None:
        """Close round ``round_id`` and add ``values`` into its mean gradient at ``offset`` of the
        slice: another owner's :meth:`carried_mean` for this slice, before the norm and the step
        see the mean. Once per round: a repeated call (the relay retrying a finalize) adds nothing."""
        if round_id in self._finalized:
            return
        if step != self.step:
            raise ApiError(409, "wrong_step", f"add to the mean for step {step}, but this slice is at {self.step}")
        if offset < 0 or offset + values.size > self.numel:
            raise ValueError(f"values [{offset}, {offset + values.size}) fall outside the slice's {self.numel}")
        async with self._switch:
            r = await self._close(step, round_id)
            if r.added:
                return
            if r.sq_norm is not None:
                raise RuntimeError("carried values must be added before the mean's norm is taken")
            await self._mean(r)
            segment = self.master.grad.numpy()[offset : offset + values.size]
            await self.reducer.run(np.add, segment, values.astype(np.float32, copy=False), segment)
            r.added = True

    async def finalize(
        self, step: int, round_id: str, global_norm: float | None = None
    ) -> tuple[Version, SliceRound, float]:
        """Close round ``round_id``, apply the step to this slice and publish the new version;
        ``global_norm``: the whole mean gradient's norm to clip by (else the slice's own).
        Idempotent: a repeated finalize (the relay retrying) answers with the same version.
        Returns the version, the round and the slice's mean-gradient norm (before clipping)."""
        if round_id in self._finalized:
            version, norm, refused = self._finalized[round_id]
            return version, SliceRound(step=step, round_id=round_id, closed=True, refused=refused), norm
        if step != self.step:
            raise ApiError(409, "wrong_step", f"finalize for step {step}, but this slice is at {self.step}")
        async with self._switch:
            r = await self._close(step, round_id)
            self.round = None
            version, report = await self.reducer.run(self.apply_round, r.meaned, global_norm)
        self.publisher.publish(version)
        self.reducer.submit(self.reducer.reset)  # before any add of the next round
        r.refused = report.refused
        self._finalized[round_id] = (version, report.grad_norm, report.refused)
        if len(self._finalized) > 8:
            self._finalized.pop(next(iter(self._finalized)))
        return version, r, report.grad_norm


class HeadedStream:
    """A body stream whose first bytes (the container head) were already read: serves them, then
    the rest of the stream (``readexactly``, what :class:`AsyncContainerReader` needs): aiohttp's
    ``StreamReader``, or a wrapper that verifies it."""

    def __init__(self, head: bytes, stream: Any) -> None:
        self._head, self._stream = memoryview(head), stream
        if hasattr(stream, "readany"):  # offered only where the stream has it (not digest-checked ones)
            self.readany = self._readany

    async def readexactly(self, n: int) -> bytes:
        if not self._head:
            return await self._stream.readexactly(n)
        take = bytes(self._head[:n])
        self._head = self._head[len(take) :]
        if len(take) < n:
            take += await self._stream.readexactly(n - len(take))
        return take

    async def _readany(self) -> bytes:
        """Whatever is buffered (the zero-copy receive path, ``AsyncContainerReader``)."""
        if self._head:
            take, self._head = bytes(self._head), memoryview(b"")
            return take
        return await self._stream.readany()


def gradient_meta(metadata: dict[str, str]) -> GradientMeta:
    if "collab" not in metadata:
        raise ProtocolError("bad_meta", "gradient container lacks the 'collab' metadata entry")
    return GradientMeta.loads(metadata["collab"])
