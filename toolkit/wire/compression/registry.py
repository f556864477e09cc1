"""Codecs by their run-config names: the dense "none", "float16", "int8", the sparse family
"topk2-<K>" (gradients and parameters) and the boundary family "lowrank-<r>" (pipeline boundaries
only: :func:`boundary_codec`)."""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.wire.compression.base import Codec
from toolkit.wire.compression.codecs import CODECS
from toolkit.wire.compression.lowrank import LowRankCodec, lowrank_rank
from toolkit.wire.compression.sparse import TopK2Codec, topk2_keep

CHOICES = "none, float16, int8 or topk2-<K> (K values kept per 4096: a multiple of 4 from 4 to 2048, e.g. topk2-64)"
DENSE_CHOICES = tuple(CODECS)
BOUNDARY_CHOICES = "none, float16, int8 or lowrank-<r> (the rank kept, 1..1024, e.g. lowrank-32)"


def get_codec(name: str) -> Codec:
    """A fresh codec by its run-config name; ValueError (one line, naming the choices) otherwise."""
    if name in CODECS:
        return CODECS[name]()
    k = topk2_keep(name) if isinstance(name, str) else None
    if k is None:
        raise ValueError(f"unknown compression codec {name!r}; choose {CHOICES}")
    return TopK2Codec(k)


def boundary_codec(name: str) -> Codec:
    """How a pipeline run's boundaries travel (``[pipeline] boundary_codec``): a dense codec or
    ``lowrank-<r>``; ValueError (one line, naming the choices) otherwise -- a sparse codec cannot
    carry rows, and ``lowrank-<r>`` nothing but rows."""
    rank = lowrank_rank(name)
    if rank is not None:
        return LowRankCodec(rank)
    if name not in CODECS:
        raise ValueError(f"boundary codec {name!r} is not one of {BOUNDARY_CHOICES}")
    return CODECS[name]()


@dataclass(frozen=True)
class RunCodecs:
    """A run's two codecs: ``up`` encodes gradient and pseudo-gradient uploads, ``down`` the
    parameter deltas the relay broadcasts (``run.download_compression``; by default ``up``: the mean
    of sparse uploads is denser than one of them, so a run may want the broadcast denser)."""

    up: Codec
    down: Codec


def run_codecs(compression: str, download_compression: str = "") -> RunCodecs:
    """The codecs of a run configured with these names ("" for the download: the same as the upload)."""
    up = get_codec(compression)
    return RunCodecs(up, get_codec(download_compression) if download_compression else up)


def codec_error(name: str) -> str | None:
    """Why ``name`` is not a codec a run may use (one line), or None when it is."""
    try:
        get_codec(name)
    except ValueError as exc:
        return str(exc)
    return None
