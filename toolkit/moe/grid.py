"""The expert grid, product-key gating and the paper's beam search (Learning@home s3.2, App. C).

Experts sit on a d-dimensional grid of size ``M_i`` per dimension; an expert's uid is
``f"{prefix}.{u_0}.{u_1}..."``. The gate predicts one score vector per dimension and an expert's
logit is the sum of its coordinates' scores, so it never iterates over all ``prod(M_i)`` experts.
:func:`beam_search` is Algorithm 1 over the set of live experts (a directory snapshot): start from
the best first coordinates that have a live expert, extend one dimension at a time, keep the best
``beam_size`` prefixes. On a full grid it returns the exact top-k (a top-k expert's prefix is
always among the top-k prefixes, because every prefix has the same best completion); on a sparse
grid it may miss some of the true top-k, and it never returns a dead or duplicate uid.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from math import prod

import torch
from torch import nn

Coords = tuple[int, ...]


@dataclass(frozen=True)
class ExpertGrid:
    """Names of the experts of one mixture: ``uid_prefix`` and the grid's size per dimension."""

    uid_prefix: str
    size: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.size or any(m < 1 for m in self.size):
            raise ValueError(f"grid size {self.size!r} needs at least one dimension, each >= 1")
        if not self.uid_prefix or self.uid_prefix.split(".")[-1].isdigit():
            # "ffn.3" as a prefix would make "ffn.3.1.2" ambiguous between grids.
            raise ValueError(f"uid prefix {self.uid_prefix!r} must be non-empty and not end in a number part")

    @property
    def num_experts(self) -> int:
        return prod(self.size)

    def uid(self, coords: Sequence[int]) -> str:
        """``(3, 1) -> "ffn.3.1"``; raises ValueError for coordinates outside the grid."""
        coords = tuple(int(c) for c in coords)
        if len(coords) != len(self.size) or any(not 0 <= c < m for c, m in zip(coords, self.size)):
            raise ValueError(f"coordinates {coords} are not on grid {self.size}")
        return ".".join([self.uid_prefix, *map(str, coords)])

    def coords(self, uid: str) -> Coords:
        """``"ffn.3.1" -> (3, 1)``; raises ValueError for a uid of another grid (or malformed)."""
        head, _, tail = uid.partition(self.uid_prefix + ".")
        parts = tail.split(".") if not head else []
        if len(parts) != len(self.size) or not all(p.isdigit() for p in parts):
            raise ValueError(f"{uid!r} is not an expert of grid {self.uid_prefix!r} {self.size}")
        coords = tuple(int(p) for p in parts)
        if any(c >= m for c, m in zip(coords, self.size)):
            raise ValueError(f"{uid!r} lies outside grid {self.uid_prefix!r} {self.size}")
        return coords

    def owns(self, uid: str) -> bool:
        try:
            self.coords(uid)
        except ValueError:
            return False
        return True

    def all_uids(self) -> list[str]:
        """Every uid of the full grid, in row-major order of coordinates."""
        return [self.uid(c) for c in all_coords(self.size)]

    def live_coords(self, live_uids: Iterable[str]) -> list[Coords]:
        """The coordinates of a directory snapshot's uids that belong to this grid (others ignored)."""
        return sorted(self.coords(u) for u in live_uids if self.owns(u))


def all_coords(size: Sequence[int]) -> list[Coords]:
    grids = torch.meshgrid(*[torch.arange(m) for m in size], indexing="ij")
    return [tuple(row) for row in torch.stack([g.reshape(-1) for g in grids], 1).tolist()]


class ProductKeyGate(nn.Module):
    """One linear projection ``in_features -> sum(M_i)``, split into d score vectors (the
    paper's ``g_0 .. g_{d-1}``); the mixture's only trainable parameters."""

    def __init__(self, in_features: int, size: Sequence[int]) -> None:
        super().__init__()
        self.size = tuple(size)
        self.proj = nn.Linear(in_features, sum(self.size))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        """``x [n, in] -> [scores_i [n, M_i] for each dimension i]``."""
        return list(self.proj(x).split(self.size, dim=-1))


def expert_logits(scores: Sequence[torch.Tensor], coords: torch.Tensor) -> torch.Tensor:
    """``g(x, f) = sum_i scores_i[x, u_i]``: ``coords [n, k, d]`` (any valid index where unused)
    -> logits ``[n, k]``, differentiable in the scores."""
    logits = scores[0].gather(1, coords[..., 0])
    for i in range(1, len(scores)):
        logits = logits + scores[i].gather(1, coords[..., i])
    return logits


@dataclass
class LiveIndex:
    """The prefix -> suffix structure of App. C (Fig. 7) for one directory snapshot, as tensors.

    Level ``i`` lists every distinct live prefix of length ``i + 1`` in sorted order:
    ``last[i]`` its last coordinate and ``parent[i]`` the position of its parent prefix in level
    ``i - 1``. A prefix is listed only when some live expert extends it, so a beam never holds a
    dead end. ``table`` holds the live experts' coordinates, in the order of the last level.
    """

    size: tuple[int, ...]
    last: list[torch.Tensor] = field(default_factory=list)  # [n_i] last coordinate of each prefix
    parent: list[torch.Tensor] = field(default_factory=list)  # [n_i] index into level i - 1
    table: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0, dtype=torch.long))  # [N, d] live coords

    @classmethod
    def build(cls, live: Iterable[Sequence[int]], size: Sequence[int]) -> LiveIndex:
        size = tuple(size)
        coords = torch.tensor([tuple(c) for c in live], dtype=torch.long).reshape(-1, len(size))
        bad = (coords < 0) | (coords >= torch.tensor(size))
        if bad.any():
            raise ValueError(f"live coordinates {coords[bad.any(1)][0].tolist()} are not on grid {size}")
        index = cls(size)
        # Row-major codes sort like the coordinate tuples; a prefix's code is code // (its suffix span).
        span = [prod(size[depth:]) for depth in range(len(size) + 1)]
        codes = torch.unique((coords * torch.tensor(span[1:], dtype=torch.long)).sum(1))  # sorted, deduplicated
        index.table = torch.stack([codes // span[i + 1] % size[i] for i in range(len(size))], 1).reshape(-1, len(size))
        parent_of_row = torch.zeros(len(codes), dtype=torch.long)  # every row's prefix at depth - 1
        for depth in range(1, len(size) + 1):
            level, inverse = torch.unique_consecutive(codes // span[depth], return_inverse=True)
            index.last.append(level % size[depth - 1])
            index.parent.append(torch.zeros(len(level), dtype=torch.long).scatter_(0, inverse, parent_of_row))
            parent_of_row = inverse
        return index

    def __len__(self) -> int:
        return self.table.shape[0]


def beam_search(
    scores: Sequence[torch.Tensor], live: LiveIndex | Iterable[Sequence[int]], k: int, beam_size: int | None = None
) -> list[list[Coords]]:
    """Algorithm 1, batched over rows: ``scores = [scores_i [n, M_i]]`` -> per row the chosen
    live coordinates, best first, ``min(k, live experts)`` of them, no duplicates.

    ``beam_size`` (default ``k``, the paper's) is the number of prefixes kept per dimension; a
    wider beam raises recall on sparse grids. The search scores every live prefix of each
    dimension in one tensor operation (O(rows x live experts)), so the width costs nothing: the
    paper's beam saves DHT lookups, which a local directory snapshot does not need. Pure
    function: no gradients.
    """
    coords, valid = beam_search_tensors(scores, live, k, beam_size)
    return [[tuple(c) for c, ok in zip(row_c, row_v) if ok] for row_c, row_v in zip(coords.tolist(), valid.tolist())]


def beam_search_tensors(
    scores: Sequence[torch.Tensor], live: LiveIndex | Iterable[Sequence[int]], k: int, beam_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`beam_search` as tensors: ``coords [n, k, d]`` (0 where unused) and ``valid [n, k]``
    (False past the live experts found for that row), on the CPU; chosen experts best first."""
    size = tuple(s.shape[-1] for s in scores)
    index = live if isinstance(live, LiveIndex) else LiveIndex.build(live, size)
    if index.size != size:
        raise ValueError(f"scores are for grid {size} but the live index is for {index.size}")
    if k < 1:
        raise ValueError(f"k = {k} must be >= 1")
    width = max(k, beam_size or k)
    n = scores[0].shape[0]
    with torch.no_grad():
        # float64: the ranking does not hinge on float32 rounding of the d-term sums; CPU: the
        # index and the uids live there.
        scores = [s.detach().to("cpu", torch.float64) for s in scores]
        total = torch.zeros(n, 1, dtype=torch.float64)  # score of the one empty prefix
        for depth, (last, parent) in enumerate(zip(index.last, index.parent)):
            if last.numel() == 0:
                return torch.zeros(n, k, len(size), dtype=torch.long), torch.zeros(n, k, dtype=torch.bool)
            # [n, n_depth]: a prefix competes only if its parent survived the previous TopK.
            cand = total[:, parent] + scores[depth][:, last]
            keep = min(k if depth == len(size) - 1 else width, cand.shape[1])
            best, pos = cand.topk(keep, dim=1)
            total = torch.full_like(cand, float("-inf")).scatter_(1, pos, best)
    chosen = index.table[pos]  # [n, keep, d]: after the last level, positions are live experts
    valid = torch.isfinite(best)
    pad = k - chosen.shape[1]
    if pad:
        chosen = torch.cat([chosen, chosen.new_zeros(n, pad, len(size))], 1)
        valid = torch.cat([valid, valid.new_zeros(n, pad)], 1)
    return chosen * valid[..., None], valid
