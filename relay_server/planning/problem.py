"""The planner's input: peers as measured, validated and converted to LP units.

:func:`_normalize` turns :class:`PeerCapacity` records into a :class:`_Problem` that the LPs of
:mod:`.planner` and :mod:`.lp` read; :class:`PlanError` is what every stage raises when there is
no plan, saying which input to change.

Units: inside the LPs every rate is in vectors per second (bytes/s over ``num_params *
bytes_per_param``; compute as steps/s = samples/s / B), divided by the fastest link so all
matrix coefficients are O(1) (bytes/s near 1e8 against P near 1e8 would leave HiGHS comparing
numbers 16 orders apart; compute only bounds xi). ``Plan.steps_per_s`` is in steps/s,
``predicted_round_s`` in seconds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

Pairwise = Mapping[tuple[str, str], float]


class PlanError(ValueError):
    """No valid plan for these inputs; the message says which input to change."""


@dataclass(frozen=True)
class PeerCapacity:
    """One peer as the planner sees it: measured compute and link rates.

    ``upload``/``download`` in bytes/s. ``can_receive=False`` is a client-mode peer (behind NAT):
    it can never aggregate. ``computes`` None lets the planner choose; True/False pins it.
    """

    peer_id: str
    samples_per_s: float
    upload: float
    download: float
    can_receive: bool
    computes: bool | None = None


@dataclass(frozen=True)
class _Problem:
    """Validated inputs in LP units (see module docstring). Arrays are indexed like ``ids``."""

    ids: tuple[str, ...]  # sorted peer ids
    peers: tuple[PeerCapacity, ...]  # same order
    s: np.ndarray  # [n] steps/s each peer adds when computing (s_i / B), LP units
    u: np.ndarray  # [n] upload, LP units
    d: np.ndarray  # [n] download, LP units
    recv: np.ndarray  # [n] bool, may aggregate
    pin: np.ndarray  # [n] int8: -1 free, 0 pinned off, 1 pinned on
    pairs: dict[tuple[int, int], float]  # (sender idx, receiver idx) -> limit, LP units
    unit: float  # one LP rate unit in vectors/s (= steps/s)
    vector_bytes: float
    num_params: int
    target_batch: float
    bytes_per_param: float
    pairwise_raw: tuple[tuple[str, str, float], ...]

    @property
    def aggregators(self) -> np.ndarray:
        return np.flatnonzero(self.recv)

    @property
    def participants(self) -> np.ndarray:
        return np.flatnonzero((self.s > 0) & (self.pin != 0))

    @property
    def xi_cap(self) -> float:
        return float(self.s[self.participants].sum())


def _finite_nonneg(value: float, what: str) -> float:
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise PlanError(f"{what} must be a finite number >= 0, got {value!r}")
    return value


def _normalize(
    peers: Sequence[PeerCapacity],
    num_params: int,
    target_batch: float,
    bytes_per_param: float,
    pairwise: Pairwise | None,
) -> _Problem:
    if not peers:
        raise PlanError("no peers: a plan needs at least one peer")
    if int(num_params) != num_params or num_params < 1:
        raise PlanError(f"num_params must be a positive integer, got {num_params!r}")
    for what, value in (("target_batch", target_batch), ("bytes_per_param", bytes_per_param)):
        if not (math.isfinite(float(value)) and value > 0):
            raise PlanError(f"{what} must be a finite number > 0, got {value!r}")
    ordered = sorted(peers, key=lambda p: p.peer_id)
    ids = tuple(p.peer_id for p in ordered)
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise PlanError(f"duplicate peer ids: {dup[:5]}")
    for p in ordered:
        for what in ("samples_per_s", "upload", "download"):
            _finite_nonneg(getattr(p, what), f"{p.peer_id}.{what}")
        if p.computes is True and p.samples_per_s == 0:
            raise PlanError(f"{p.peer_id} is pinned computes=True but has samples_per_s == 0")
    vector_bytes = float(num_params) * float(bytes_per_param)
    s = np.array([p.samples_per_s for p in ordered], float) / float(target_batch)
    u = np.array([p.upload for p in ordered], float) / vector_bytes
    d = np.array([p.download for p in ordered], float) / vector_bytes
    pin = np.array([-1 if p.computes is None else int(p.computes) for p in ordered], np.int8)
    index = {pid: k for k, pid in enumerate(ids)}
    pairs_raw: dict[tuple[int, int], float] = {}  # bytes/s
    for (src, dst), limit in sorted((pairwise or {}).items()):
        if src not in index or dst not in index:
            raise PlanError(f"pairwise limit {(src, dst)} names an unknown peer")
        if src == dst:
            raise PlanError(f"pairwise limit {(src, dst)}: self-traffic is free, drop it")
        pairs_raw[(index[src], index[dst])] = _finite_nonneg(limit, f"pairwise{(src, dst)}")
    # One LP unit = the fastest link (compute enters only as a bound on xi, whatever its size;
    # scaling by it would push every link below HiGHS's 1e-7 tolerance when compute is huge).
    links = np.concatenate([u, d, np.array(list(pairs_raw.values())) / vector_bytes])
    unit = float(links.max()) if links.size else 0.0
    if unit <= 0:
        unit = float(s[(s > 0) & (pin != 0)].sum())
    if unit <= 0:
        raise PlanError("every rate is zero: no compute and no bandwidth measured yet")
    return _Problem(
        ids=ids,
        peers=tuple(ordered),
        s=s / unit,
        u=u / unit,
        d=d / unit,
        recv=np.array([p.can_receive for p in ordered], bool),
        pin=pin,
        pairs={k: v / vector_bytes / unit for k, v in pairs_raw.items()},
        unit=unit,
        vector_bytes=vector_bytes,
        num_params=int(num_params),
        target_batch=float(target_batch),
        bytes_per_param=float(bytes_per_param),
        pairwise_raw=tuple((ids[a], ids[b], t) for (a, b), t in pairs_raw.items()),
    )


def _check_solvable(prob: _Problem) -> None:
    if not prob.recv.any():
        raise PlanError(
            "no peer can receive connections, so nobody can aggregate: start the relay "
            "or an aggregator server with a reachable address"
        )
    if prob.participants.size == 0:
        raise PlanError(
            "no peer computes (all have samples_per_s == 0 or are pinned "
            "computes=False): wait for a peer with an accelerator"
        )
