"""The solved plan: who computes, which contiguous slice each aggregator owns, and how an LP
solution becomes one (shares, predicted round time, a version every process derives alike).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from relay_server.planning.problem import PlanError, _Problem
from relay_server.planning.round_time import predict_round_s

# Shares below this fraction of the total are solver noise, not a role.
_MIN_SHARE = 1e-9


@dataclass(frozen=True)
class Plan:
    """A solved plan. ``aggregators`` (sorted by peer id) is also the order of the contiguous
    slices, so every process derives the same slices from the same plan."""

    steps_per_s: float
    fractions: dict[str, float]  # aggregator -> share of the vector, sums to 1
    computes: dict[str, float]  # every peer -> c_i
    version: str
    num_params: int
    predicted_round_s: float  # averaging seconds per round (.round_time)
    aggregators: tuple[str, ...] = field(default=())
    computing: tuple[str, ...] = field(default=())  # peers that send gradients and get parameters

    def slices(
        self, num_params: int | None = None, boundaries: Sequence[int] | None = None
    ) -> list[tuple[str, int, int]]:
        """``(peer_id, start, end)`` half-open ranges covering ``[0, num_params)`` with no gaps;
        sizes from ``fractions`` by largest remainder (exact integer sum). Empty slices are
        left out. ``boundaries`` (ascending offsets, 0 and ``num_params`` among them: where the
        model's tensors start and end): every cut moves to the nearest boundary, so each slice
        holds whole tensors -- what an optimizer with per-tensor quantities (LAMB's trust ratio)
        needs. A tensor bigger than a share goes whole to one owner; an owner keeps at least one
        tensor while there are as many tensors as owners (else some get none)."""
        n = self.num_params if num_params is None else int(num_params)
        if n < 0:
            raise PlanError(f"num_params must be >= 0, got {n}")
        sizes = _apportion(n, [self.fractions[p] for p in self.aggregators])
        cuts = np.cumsum([0, *sizes]).tolist()
        if boundaries is not None:
            cuts = snap_cuts(cuts, boundaries)
        return [(peer_id, a, b) for peer_id, a, b in zip(self.aggregators, cuts, cuts[1:]) if b > a]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form for the API and the dashboard."""
        return {
            "version": self.version,
            "steps_per_s": self.steps_per_s,
            "predicted_round_s": self.predicted_round_s,
            "num_params": self.num_params,
            "aggregators": list(self.aggregators),
            "fractions": dict(self.fractions),
            "computes": dict(self.computes),
            "computing": list(self.computing),
            "slices": [list(s) for s in self.slices()],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, allow_nan=False)


def _make_plan(
    prob: _Problem, xi: float, served: np.ndarray, computes: np.ndarray, senders: np.ndarray, receivers: np.ndarray
) -> Plan:
    """``served``: [nA] rate per aggregator (LP units) -> fractions; ``computes``: [n] c_i."""
    agg_ids = [prob.ids[i] for i in prob.aggregators]
    total = float(served.sum())
    if total <= 0:
        raise PlanError(
            "no aggregator can serve every computing peer; check the pairwise limits and the aggregators' upload"
        )
    keep = served > _MIN_SHARE * total
    share = served[keep] / served[keep].sum()
    fractions = dict(zip([p for p, k in zip(agg_ids, keep) if k], map(float, share)))
    computes_by_id = {pid: float(c) for pid, c in zip(prob.ids, computes)}
    computing = tuple(prob.ids[k] for k in senders)
    pairwise = {(a, b): t for a, b, t in prob.pairwise_raw}
    round_s = predict_round_s(
        prob.peers,
        fractions,
        prob.num_params,
        prob.bytes_per_param,
        pairwise,
        senders=computing,
        receivers=[prob.ids[j] for j in receivers],
    )
    steps = xi * prob.unit
    return Plan(
        steps_per_s=steps,
        fractions=fractions,
        computes=computes_by_id,
        version=_version(prob, steps, fractions, computes_by_id),
        num_params=prob.num_params,
        predicted_round_s=round_s,
        aggregators=tuple(fractions),
        computing=computing,
    )


def _version(prob: _Problem, steps: float, fractions: dict[str, float], computes: dict[str, float]) -> str:
    """sha256 over the canonical inputs and the rounded solution: equal plans, equal versions,
    in any process (float repr is exact; rounding to 9 digits hides last-bit solver noise)."""

    def r(v: float) -> str:
        return f"{v:.9g}"

    doc = {
        "peers": [
            [
                p.peer_id,
                repr(float(p.samples_per_s)),
                repr(float(p.upload)),
                repr(float(p.download)),
                p.can_receive,
                p.computes,
            ]
            for p in prob.peers
        ],
        "num_params": prob.num_params,
        "target_batch": repr(prob.target_batch),
        "bytes_per_param": repr(prob.bytes_per_param),
        "pairwise": [[a, b, repr(t)] for a, b, t in prob.pairwise_raw],
        "steps_per_s": r(steps),
        "fractions": [[k, r(v)] for k, v in fractions.items()],
        "computes": [[k, r(v)] for k, v in computes.items()],
    }
    blob = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def snap_cuts(cuts: Sequence[int], boundaries: Sequence[int]) -> list[int]:
    """``cuts`` (ascending, from 0 to the total) each moved to the nearest of ``boundaries``
    (ties to the lower), in order, leaving every later owner a boundary of its own when there
    are enough of them. The first and last cut stay."""
    bounds = sorted(set(int(b) for b in boundaries))
    if not cuts or bounds[0] != cuts[0] or bounds[-1] != cuts[-1]:
        raise PlanError(f"tensor boundaries {bounds[:1]}..{bounds[-1:]} do not span the cuts {cuts[:1]}..{cuts[-1:]}")
    k, last = len(cuts) - 1, len(bounds) - 1  # owners; index of the final boundary
    out, at = [cuts[0]], 0
    for i, cut in enumerate(cuts[1:-1], start=1):
        hi = max(last - (k - i), at)  # leave k - i boundaries after this one
        lo = min(at + 1, hi)
        j = int(np.searchsorted(bounds, cut))  # bounds[j - 1] < cut <= bounds[j]
        best = min(
            range(max(lo, j - 1), min(hi, j) + 1) or [min(max(j, lo), hi)], key=lambda x: (abs(bounds[x] - cut), x)
        )
        at = best
        out.append(bounds[at])
    out.append(cuts[-1])
    return out


def _apportion(total: int, shares: Sequence[float]) -> list[int]:
    """Largest-remainder split of ``total`` items by ``shares``; exact sum, ties to the earlier."""
    if not shares:
        return []
    w = np.asarray(shares, float)
    raw = w / w.sum() * total
    base = np.floor(raw).astype(np.int64)
    short = total - int(base.sum())
    order = np.lexsort((np.arange(w.size), -(raw - base)))  # biggest remainder first
    base[order[:short]] += 1
    return [int(v) for v in base]
