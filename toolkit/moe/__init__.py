"""The trainer side of a decentralized mixture-of-experts (Learning@home, Ryabinin & Gusev 2020).

Owns the math: the expert grid, product-key gating and the paper's beam search (``grid``), the
interface a trainer calls experts through and its in-process implementation (``calls``), the
mixture layers, remote and local reference (``layer``; the expert calls as an autograd node in
``dispatch``), what an expert is (``experts``: the paper's FFN block, how every process builds,
trains and checkpoints it; the relay imports it too), and the trainer that keeps J micro-batches
in flight to hide the calls' latency (``inflight``, which :func:`toolkit.join` uses). These import
only ``toolkit.errors``, ``toolkit.wire`` and torch: no HTTP, nothing from the relay, so
``toolkit.models`` can build a DMoE trainer model from a run's spec and the relay can import them
(they are in the shared layer, :mod:`toolkit`). The two modules that talk to the relay, expert
calls through it (``remote``) and the expert host (``host``), are peer-side units of their own.
"""

from toolkit.moe.calls import CallRecord, ExpertCaller, ExpertFailed, LoopbackCaller
from toolkit.moe.dispatch import MoEStats
from toolkit.moe.experts import FFNExpert, expert_seed
from toolkit.moe.grid import ExpertGrid, LiveIndex, ProductKeyGate, beam_search, beam_search_tensors
from toolkit.moe.layer import LocalMixtureOfExperts, RemoteMixtureOfExperts

__all__ = [
    "CallRecord",
    "ExpertCaller",
    "ExpertFailed",
    "ExpertGrid",
    "FFNExpert",
    "LiveIndex",
    "LocalMixtureOfExperts",
    "LoopbackCaller",
    "MoEStats",
    "ProductKeyGate",
    "RemoteMixtureOfExperts",
    "beam_search",
    "beam_search_tensors",
    "expert_seed",
]
