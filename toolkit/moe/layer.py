"""The mixture layers: :class:`RemoteMixtureOfExperts` (experts behind an :class:`ExpertCaller`)
and :class:`LocalMixtureOfExperts` (the same math with experts as submodules: the reference).

One forward (Learning@home s3.1-3.2): the gate's score vectors for each row; beam search over the
live experts for the top ``k``; the chosen experts' outputs averaged with softmax weights of their
logits. A (row, expert) pair whose call failed is excluded and the softmax renormalised over the
survivors (the live-system semantics: the failure is learnt after selection, so no other expert
takes its place); a row with fewer than ``k_min`` survivors outputs zero and is counted in
``stats.dropped_rows``. Inputs of any shape ``[..., in_features]`` are treated as independent rows.

Balancing loss (``layer.balancing_loss`` after each forward): Switch-Transformer style, per grid
dimension ``i``: ``M_i * sum_j f_ij * P_ij`` where ``f_ij`` is the fraction of chosen (row, expert)
pairs whose coordinate ``i`` is ``j`` (load, no gradient) and ``P_ij`` the mean over rows of the
softmax of the gate's scores for dimension ``i`` (importance, differentiable); averaged over
dimensions. It is 1 when load and importance are uniform and grows as they concentrate; balancing
coordinates per dimension balances the hosts, which lease experts spread over the grid.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from toolkit.moe.calls import ExpertCaller, ExpertFailed
from toolkit.moe.dispatch import CallPlan, Group, MoEStats, call_experts, group_by_expert
from toolkit.moe.grid import ExpertGrid, LiveIndex, ProductKeyGate, beam_search_tensors, expert_logits

DEFAULT_BEAM_FACTOR = 4
"""Beam width per grid dimension, in multiples of k (see RemoteMixtureOfExperts)."""


class _Mixture(nn.Module):
    """Gating, selection and the weighted average, shared by the remote and the local layer."""

    def __init__(
        self,
        in_features: int,
        grid: Sequence[int],
        k: int,
        uid_prefix: str,
        k_min: int,
        out_features: int | None,
        beam_size: int | None,
    ) -> None:
        super().__init__()
        if not 1 <= k_min <= k:
            raise ValueError(f"k_min = {k_min} must be between 1 and k = {k}")
        self.grid = ExpertGrid(uid_prefix, tuple(grid))
        self.gate = ProductKeyGate(in_features, self.grid.size)
        self.in_features, self.out_features = in_features, out_features or in_features
        self.k, self.k_min = k, k_min
        self.beam_size = beam_size if beam_size is not None else DEFAULT_BEAM_FACTOR * k
        self.stats = MoEStats()
        # Trainer threads may run micro-batches through one layer at once: each thread reads the
        # balancing loss of its own forward, and the snapshot cache is swapped as one tuple.
        self._local = threading.local()
        self._index: tuple[frozenset[str], LiveIndex] | None = None
        strides = [1] * len(self.grid.size)
        for i in range(len(strides) - 2, -1, -1):
            strides[i] = strides[i + 1] * self.grid.size[i + 1]
        self._strides = torch.tensor(strides, dtype=torch.long)

    def __getstate__(self) -> dict[str, Any]:
        # copy.deepcopy and pickle: a thread-local cannot be copied, and a snapshot cache need not be.
        state = dict(self.__dict__, _index=None)
        state.pop("_local", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._local = threading.local()

    @property
    def balancing_loss(self) -> torch.Tensor | None:
        """The balancing loss of this thread's last forward (None before the first)."""
        return getattr(self._local, "balancing_loss", None)

    def live_index(self, live: frozenset[str]) -> LiveIndex:
        """The prefix index of a directory snapshot, rebuilt only when the snapshot changes."""
        cached = self._index
        if cached is None or cached[0] != live:
            cached = self._index = (live, LiveIndex.build(self.grid.live_coords(live), self.grid.size))
        return cached[1]

    def select(
        self, x: torch.Tensor, live: frozenset[str]
    ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor, list[Group]]:
        """``x [n, in]`` -> (scores, logits [n, k], valid [n, k], flat expert index [n, k], groups)."""
        scores = self.gate(x)
        coords, valid = beam_search_tensors(scores, self.live_index(live), self.k, self.beam_size)
        coords, valid = coords.to(x.device), valid.to(x.device)
        flat = (coords * self._strides.to(x.device)).sum(-1)
        uid_of = {
            f: self.grid.uid([f // s % m for s, m in zip(self._strides.tolist(), self.grid.size)])
            for f in torch.unique(flat[valid]).tolist()
        }
        self._local.balancing_loss = self._balancing(scores, coords, valid)
        return scores, expert_logits(scores, coords), valid, flat, group_by_expert(flat, valid, uid_of)

    def combine(self, logits: torch.Tensor, alive: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Softmax over the surviving experts of each row, weighted sum of ``y [n, k, out]``."""
        survivors = alive.sum(1)
        dropped = survivors < self.k_min
        self.stats.add(dropped_rows=int(dropped.sum()))
        keep = alive & ~dropped[:, None]
        # A row with no survivor would be softmax([-inf]*k) = NaN: give it finite logits, weight 0.
        masked = logits.masked_fill(~alive, float("-inf")).masked_fill(dropped[:, None], 0.0)
        weights = torch.softmax(masked, dim=1) * keep
        return (weights[..., None] * y).sum(1)

    def _balancing(self, scores: list[torch.Tensor], coords: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        pairs = valid.sum().clamp(min=1)
        terms = []
        for i, s in enumerate(scores):
            load = F.one_hot(coords[..., i][valid], s.shape[1]).sum(0).to(s.dtype) / pairs
            importance = torch.softmax(s, dim=1).mean(0)
            terms.append(s.shape[1] * (load * importance).sum())
        return torch.stack(terms).mean()

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"mixture input has {x.shape[-1]} features, the layer was built for {self.in_features}")
        return x.reshape(-1, self.in_features)


class RemoteMixtureOfExperts(_Mixture):
    """A DMoE layer whose experts run elsewhere, reached through ``caller``; its only parameters
    are the gate's projection (``gate.proj``), so only the gate is in a run's dense layout.

    ``timeout_s`` bounds the wait for all forward calls of one micro-batch together (a pending
    call then counts as failed); with ``timeout_after_k_min_s`` the wait ends that long after
    every row has ``k_min`` answers (hivemind's semantics; default: wait for all, up to
    ``timeout_s``). ``backward_timeout_s`` (default ``timeout_s``) bounds the backward calls.
    ``beam_size`` is the beam search's width per grid dimension (default ``4 * k``; the paper's
    is ``k``, sized to save DHT lookups): on a sparse grid a wider beam finds more of the true
    top-k (recall of the top-4 at 90% empty: 0.71 at width k, 0.99 at 4k; tests/test_moe_layer.py
    prints it) at no extra cost here, because every live prefix is scored anyway, and a width >=
    the number of live experts is the exact top-k over them. ``caller`` may be None
    while the model is only built for its parameter layout (the relay does so); set
    ``layer.caller`` before the first forward.
    """

    def __init__(
        self,
        in_features: int,
        grid: Sequence[int],
        k: int,
        caller: ExpertCaller | None,
        uid_prefix: str,
        k_min: int = 1,
        timeout_s: float = 30.0,
        *,
        backward_timeout_s: float | None = None,
        timeout_after_k_min_s: float | None = None,
        out_features: int | None = None,
        beam_size: int | None = None,
    ) -> None:
        super().__init__(in_features, grid, k, uid_prefix, k_min, out_features, beam_size)
        self.caller = caller
        self.timeout_s = timeout_s
        self.backward_timeout_s = backward_timeout_s if backward_timeout_s is not None else timeout_s
        self.timeout_after_k_min_s = timeout_after_k_min_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in] -> [..., out]``."""
        if self.caller is None:
            raise ExpertFailed(
                "no_expert_caller",
                f"mixture {self.grid.uid_prefix!r} has no expert caller",
                "Set layer.caller (or model.attach_caller(caller)) before the forward pass: "
                "toolkit.moe.remote provides the relay's caller, LoopbackCaller runs experts here.",
            )
        rows = self._rows(x)
        _, logits, valid, _, groups = self.select(rows, self.caller.live())
        if rows.device.type != "cpu":  # the node below indexes its CPU copy of the rows with these
            groups = [Group(g.uid, g.rows.cpu(), g.slots.cpu()) for g in groups]
        plan = CallPlan(
            self.caller,
            groups,
            self.k,
            self.out_features,
            self.timeout_s,
            self.backward_timeout_s,
            self.stats,
            self.k_min,
            self.timeout_after_k_min_s,
        )
        # The calls' autograd node works on a CPU copy of the rows (their bytes leave from the CPU
        # anyway): a node on an accelerator runs its backward on that device's single autograd
        # thread, where the backward waits of micro-batches in flight on other threads queue behind
        # each other (4 threads, a 1 s wait each: 4.0 s on an H100, 1.0 s with the CPU copy); on
        # the CPU each backward runs in the thread that called it (toolkit.moe.inflight).
        y, answered = call_experts(rows.to("cpu"), plan)
        y, answered = y.to(rows.device), answered.to(rows.device)
        alive = valid & answered
        self.stats.add(masked_pairs=int((valid & ~answered).sum()))
        return self.combine(logits, alive, y).reshape(*x.shape[:-1], self.out_features)


class LocalMixtureOfExperts(_Mixture):
    """The reference: the same gate, selection and average, with ``experts`` (uid -> module) as
    submodules trained by plain autograd. The live set is the experts given.

    ``forward(x, masked=None, detached=())`` reproduces the remote layer's failure semantics for
    tests: ``masked [n, num_experts]`` (bool, rows of the flattened input, grid-flat expert index)
    marks selected (row, expert) pairs to exclude from the average, as a failed forward call does;
    the outputs of experts in ``detached`` carry no gradient, as after a failed backward call.
    """

    def __init__(
        self,
        in_features: int,
        grid: Sequence[int],
        k: int,
        experts: Mapping[str, nn.Module],
        uid_prefix: str,
        k_min: int = 1,
        *,
        out_features: int | None = None,
        beam_size: int | None = None,
    ) -> None:
        super().__init__(in_features, grid, k, uid_prefix, k_min, out_features, beam_size)
        for uid in experts:
            self.grid.coords(uid)  # ValueError for a uid of another grid
        self.uids = sorted(experts)
        # ModuleDict keys cannot hold ".", so experts are stored in uid order.
        self.experts = nn.ModuleList(experts[u] for u in self.uids)
        self._position = {u: i for i, u in enumerate(self.uids)}

    def expert(self, uid: str) -> nn.Module:
        return self.experts[self._position[uid]]

    def forward(
        self, x: torch.Tensor, masked: torch.Tensor | None = None, detached: Collection[str] = ()
    ) -> torch.Tensor:
        rows = self._rows(x)
        _, logits, valid, flat, groups = self.select(rows, frozenset(self.uids))
        y = rows.new_zeros(rows.shape[0], self.k, self.out_features)
        for g in groups:
            out = self.expert(g.uid)(rows[g.rows])
            y = y.index_put((g.rows, g.slots), out.detach() if g.uid in detached else out)
        alive = valid.clone()
        if masked is not None:
            alive &= ~masked.to(valid.device).gather(1, flat)
        self.stats.add(masked_pairs=int((valid & ~alive).sum()))
        return self.combine(logits, alive, y).reshape(*x.shape[:-1], self.out_features)
