"""Parameter bodies any HTTP cache can serve.

A published version is immutable: its body (and, on lossy runs, the int8 delta from the version
before) lives at an immutable URL, ``ROUTES["params_blob"]`` (step; a tag: the sha256 of the
parameters a peer holds afterwards on open runs, an unguessable capability on signed runs that
only the signed ref hands out; and ``full`` or ``delta``), answered with a strong ``ETag``,
``Cache-Control: public, immutable`` and byte ranges, so nginx, Varnish or a CDN in front of the
relay can fan it out. What must stay fresh and signed -- which version is current and the hash
its bytes must have -- is the small :class:`ParamsRef` the relay answers ``GET /api/params`` with
when the run names a cache (``[server] public_params_url``): signed like every relay answer in
signed runs, never cached. The peer fetches the URL it names, checks the result against the
ref's sha256 and, when the cache fails or lies, downloads the version from the relay itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from toolkit.wire.protocol.routes import _HEX64, _NONNEG
from toolkit.wire.schema import Schema, limits

PARAMS_REF_TYPE = "application/vnd.collab.params-ref+json"
"""The media type of a :class:`ParamsRef` answer: not ``application/json``, which names a sliced
version's manifest on the same route, so neither is ever taken for the other."""

BLOB_CACHE_CONTROL = "public, max-age=31536000, immutable"
"""A body's URL names its bytes: a cache may keep it for a year and never revalidate it."""

FRESH_CACHE_CONTROL = "no-store"
"""Which version is current changes every step and is signed per request: never cached."""


@dataclass(frozen=True, kw_only=True)
class ParamsRef(Schema):
    """Where to fetch version ``step`` (``url``, at the run's cache) and what it must hash to."""

    step: int = field(metadata=_NONNEG)
    sha256: str = field(metadata=_HEX64)
    """Of the float32 parameters a peer holds after applying the body (as ``X-Collab-Sha256``)."""
    kind: Literal["full", "delta"]
    base: int = field(default=-1, metadata=limits(ge=-1))
    """``kind = "delta"``: the version the delta applies to (the one the peer said it holds)."""
    url: str = field(metadata=limits(max_len=1024))
    """The immutable body at the cache: ``public_params_url`` + ``ROUTES["params_blob"]``."""
