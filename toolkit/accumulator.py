"""The peer's gradient accumulator: the sum of per-sample gradients since its last contribution.

Kept apart from :class:`toolkit.optimizer.CollaborativeOptimizer` because it is the one piece of
peer state with two homes: on the training device (fast adds, 4 B/param of device memory), or in
pinned host memory (``on_host=True``: the device then holds only parameters and gradients, and each
micro-batch's gradients are copied out without blocking the next forward). Both threads touch it
(the training loop adds, a failed round restores), so every access goes through its lock.

A gradient taken for a round becomes an :class:`Upload`: the raw sum (so it can be put back if
the round never used it) and its wire encoding, whole or one per slice of a sliced round.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from toolkit.wire.compression import Codec, ErrorFeedback
from toolkit.wire.protocol import GradientMeta, ParamSpec, PlanSlice

Encoded = list[tuple[str, np.ndarray]]


@dataclass(frozen=True)
class Upload:
    """One accumulated gradient on its way: the raw sum (kept to restore it) and its encoding:
    whole (``tensors``), or one encoding per slice of a sliced round (``parts``)."""

    meta: GradientMeta
    grad: np.ndarray  # (P,) float32 sum over meta.samples samples
    tensors: Encoded  # what went on the wire (the codec's encoding)
    parts: tuple[tuple[PlanSlice, Encoded], ...] = ()


class Accumulator:
    """Sum of per-micro-batch gradients times their sample counts, flat in the run's layout order."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        layout: Sequence[ParamSpec],
        num_params: int,
        codec: Codec,
        *,
        on_host: bool = False,
    ) -> None:
        device = params[0].device
        self.on_host = on_host or device.type == "cpu"
        self._sum = torch.zeros(num_params, dtype=torch.float32, device="cpu" if self.on_host else device)
        self._views = [self._sum[s.offset : s.offset + p.numel()].view_as(p) for s, p in zip(layout, params)]
        # Device gradients land in a pinned staging copy first (asynchronous DMA, no pageable bounce).
        self._staging: list[torch.Tensor] | None = None
        if self.on_host and device.type == "cuda":
            staging = torch.empty(num_params, dtype=torch.float32, pin_memory=True)
            self._staging = [staging[s.offset : s.offset + p.numel()].view_as(p) for s, p in zip(layout, params)]
        self.codec = codec
        self._feedback = None if codec.lossless else ErrorFeedback(codec, num_params)
        self.lock = threading.Lock()
        self.samples = 0  # in the sum, not yet sent
        self.loss_sum = 0.0
        self.version = 0  # the oldest parameters version any gradient in the sum was computed on

    @property
    def nbytes_on_device(self) -> int:
        return 0 if self.on_host else self._sum.numel() * 4

    def add(
        self, grads: list[torch.Tensor], samples: int, loss: float | None, version: int, *, weight: float | None = None
    ) -> None:
        """Add ``samples`` samples whose gradient sum is ``grads * weight``: ``weight`` defaults to
        ``samples`` (``grads`` are per-sample means, as a plain loop's ``.grad``); a loop whose
        backward was hooked (:mod:`toolkit.optim_base`) has ``.grad`` = sum / unit, so ``unit``."""
        if self._staging is not None and grads[0].is_cuda:
            for dst, g in zip(self._staging, grads):
                dst.copy_(g, non_blocking=True)  # queued behind the backward pass on the same stream
            torch.cuda.current_stream(grads[0].device).synchronize()
            grads = self._staging
        elif self.on_host:
            grads = [g.cpu() for g in grads]  # e.g. MPS/XLA: a plain copy
        with self.lock:
            # the oldest version in the sum: a trainer with micro-batches in flight may add one
            # computed before the one already added (toolkit.moe.inflight)
            self.version = version if self.samples == 0 else min(self.version, version)
            alpha = float(samples if weight is None else weight)
            torch._foreach_add_(self._views, [g.to(torch.float32) for g in grads], alpha=alpha)
            self.samples += samples
            self.loss_sum += loss * samples if loss is not None else 0.0

    def take(self, peer_id: str, step: int) -> tuple[GradientMeta, np.ndarray]:
        """Empty the accumulator into a contribution to round ``step``."""
        with self.lock:
            meta = GradientMeta(
                peer_id=peer_id, step=step, version=self.version, samples=self.samples, loss_sum=self.loss_sum
            )
            grad = self._sum.detach().to("cpu", copy=True).numpy()
            self._sum.zero_()
            self.samples, self.loss_sum = 0, 0.0
        return meta, grad

    def encode(self, meta: GradientMeta, grad: np.ndarray, slices: list[PlanSlice]) -> Upload:
        """The wire form of a gradient: whole, or per slice of a sliced round (error feedback runs
        over the whole vector either way: each slice carries its own range's residual)."""
        if not slices:
            return Upload(meta, grad, self._feedback.compress(grad) if self._feedback else self.codec.encode(grad))
        parts: list[tuple[PlanSlice, Encoded]] = []
        try:
            for s in slices:
                x = grad[s.start : s.end]
                parts.append(
                    (s, self._feedback.compress(x, start=s.start) if self._feedback else self.codec.encode(x))
                )
        except ValueError:
            for s, tensors in parts:  # the slices already encoded were never sent
                if self._feedback is not None:
                    self._feedback.undo(tensors, grad[s.start : s.end], start=s.start)
            raise
        return Upload(meta, grad, [], tuple(parts))

    def restore(self, upload: Upload) -> None:
        """Put an unsent gradient back (and take back what error feedback recorded as sent)."""
        meta, grad = upload.meta, upload.grad
        if self._feedback is not None:
            if upload.parts:
                for s, tensors in upload.parts:
                    self._feedback.undo(tensors, grad[s.start : s.end], start=s.start)
            else:
                self._feedback.undo(upload.tensors, grad)
        with self.lock:
            self.version = meta.version if self.samples == 0 else min(self.version, meta.version)
            self._sum.add_(torch.from_numpy(grad).to(self._sum.device))
            self.samples += meta.samples
            self.loss_sum += meta.loss_sum

    def discard(self) -> None:
        with self.lock:
            self._sum.zero_()
            self.samples, self.loss_sum = 0, 0.0
