"""Time model: seconds per averaging round for a slicing of the vector.

The bandwidth bound the LP optimizes, evaluated for any shares: plans use it for
``predicted_round_s``, benchmarks for all-reduce and parameter-server baselines.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from relay_server.planning.problem import Pairwise, PeerCapacity, PlanError


def _participant_ids(peers: Iterable[PeerCapacity]) -> tuple[str, ...]:
    return tuple(p.peer_id for p in peers if p.samples_per_s > 0 and p.computes is not False)


def predict_round_s(
    peers: Sequence[PeerCapacity],
    fractions: Mapping[str, float],
    num_params: int,
    bytes_per_param: float = 4.0,
    pairwise: Pairwise | None = None,
    senders: Iterable[str] | None = None,
    receivers: Iterable[str] | None = None,
) -> float:
    """Seconds per averaging round when aggregator i owns ``fractions[i]`` of the vector.

    Every sender sends its gradient part f_i V to each aggregator i but itself; every
    aggregator sends its updated part f_i V to each receiver but itself (V = num_params *
    bytes_per_param). Transfers are pipelined and links full duplex, so the round lasts as long
    as the busiest link: the max over peers of upload bytes / upload and download bytes /
    download, and over pairs of bytes / t_ij. Latency, protocol overhead and compute are not
    modeled: this is the bandwidth bound the LP optimizes. Senders and receivers default to the
    peers with samples_per_s > 0 not pinned off. ``inf`` when a needed link has zero rate.
    """
    by_id = {p.peer_id: p for p in peers}
    default = _participant_ids(peers)
    send = set(default if senders is None else senders)
    recv = set(default if receivers is None else receivers)
    for pid, f in fractions.items():
        if pid not in by_id or not by_id[pid].can_receive:
            raise PlanError(f"{pid!r} has a share but is unknown or cannot receive")
        if not (math.isfinite(f) and f >= 0):
            raise PlanError(f"fraction of {pid!r} must be finite and >= 0, got {f!r}")
    total = float(sum(fractions.values()))
    if total <= 0:
        raise PlanError("fractions sum to zero: nobody aggregates")
    vec = float(num_params) * float(bytes_per_param)
    share = {pid: v / total for pid, v in fractions.items()}
    worst = 0.0
    for p in peers:
        f, sends, gets = share.get(p.peer_id, 0.0), p.peer_id in send, p.peer_id in recv
        up = (1.0 - f if sends else 0.0) + f * (len(recv) - gets)
        down = f * (len(send) - sends) + (1.0 - f if gets else 0.0)
        worst = max(worst, _seconds(up * vec, p.upload), _seconds(down * vec, p.download))
    for (src, dst), limit in (pairwise or {}).items():
        sent = (share.get(dst, 0.0) if src in send else 0.0) + (share.get(src, 0.0) if dst in recv else 0.0)
        worst = max(worst, _seconds(sent * vec, limit))
    return worst


def _seconds(nbytes: float, rate: float) -> float:
    if nbytes <= 1e-9:  # less than a byte: float noise from 1 - f
        return 0.0
    return math.inf if rate <= 0 else nbytes / rate


def allreduce_round_s(
    peers: Sequence[PeerCapacity], num_params: int, bytes_per_param: float = 4.0, pairwise: Pairwise | None = None
) -> float:
    """Butterfly all-reduce: every participant that can receive owns an equal share."""
    participants = set(_participant_ids(peers))
    owners = [p.peer_id for p in peers if p.can_receive and p.peer_id in participants]
    if not owners:
        raise PlanError("all-reduce needs a participant that can receive connections")
    return predict_round_s(peers, dict.fromkeys(owners, 1.0), num_params, bytes_per_param, pairwise)


def parameter_server_round_s(
    peers: Sequence[PeerCapacity], num_params: int, bytes_per_param: float = 4.0, pairwise: Pairwise | None = None
) -> tuple[str, float]:
    """The best single parameter server: ``(peer_id, seconds)`` over the peers that can receive."""
    best: tuple[str, float] | None = None
    for p in sorted(peers, key=lambda q: q.peer_id):
        if p.can_receive:
            t = predict_round_s(peers, {p.peer_id: 1.0}, num_params, bytes_per_param, pairwise)
            if best is None or t < best[1]:
                best = (p.peer_id, t)
    if best is None:
        raise PlanError("a parameter server needs a peer that can receive connections")
    return best
