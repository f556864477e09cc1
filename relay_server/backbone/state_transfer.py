"""Slice state between the relay and its aggregators: tensor containers over internal HTTP.

A slice's state is ``params`` (the master slice), ``public`` (lossy codecs: what peers hold),
``opt.<key>`` per-element optimizer state and ``opt_scalar.<key>`` counters
(:meth:`relay_server.rounds.master.MasterState.export_state`), with ``step``/``start``/``end`` in the
container metadata. Internal calls carry the organizer's admin token (:mod:`relay_server.api.moderation`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TypeVar, overload

import aiohttp
import numpy as np
from aiohttp import web

from relay_server.core.errors import ApiError
from toolkit.errors import ProtocolError
from toolkit.wire.schema import Schema
from toolkit.wire.tensor_container import AsyncContainerReader, encoded_size, iter_encoded

MAX_STATE_BYTES = 1 << 40
S = TypeVar("S", bound=Schema)


def cut(state: dict[str, np.ndarray], lo: int, hi: int) -> dict[str, np.ndarray]:
    """Elements ``[lo, hi)`` of every per-element array of a (whole-vector) state; counters as is."""
    return {name: (array[lo:hi] if array.ndim == 1 else array) for name, array in state.items()}


async def send_state(
    request: web.Request, state: dict[str, np.ndarray], metadata: dict[str, str]
) -> web.StreamResponse:
    tensors = [(name, np.ascontiguousarray(array)) for name, array in sorted(state.items())]
    response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    response.content_length = encoded_size(tensors, metadata)
    await response.prepare(request)
    for piece in iter_encoded(tensors, metadata):
        await response.write(piece)
    await response.write_eof()
    return response


class InternalClient:
    """The relay's and an aggregator's HTTP client for each other's internal routes."""

    def __init__(self, token: str, timeout_s: float) -> None:
        self.token, self.timeout_s = token, timeout_s
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=min(10.0, self.timeout_s)),
                headers={"Authorization": f"Bearer {self.token}"},
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    @overload
    async def call(self, method: str, url: str, schema: type[S], body: Schema | None = None) -> S: ...

    @overload
    async def call(self, method: str, url: str, schema: None, body: Schema | None = None) -> None: ...

    async def call(self, method: str, url: str, schema: type[S] | None, body: Schema | None = None) -> S | None:
        """A JSON call (``schema`` None: the answer's body is not needed); any failure
        (unreachable, timeout, error answer) raises ``CallFailed``."""
        try:
            async with self.session.request(
                method, url, data=body.dumps() if body else None, headers={"Content-Type": "application/json"}
            ) as response:
                raw = await response.read()
                if response.status >= 400:
                    raise CallFailed(f"{method} {url}: HTTP {response.status} {raw[:300]!r}")
                return schema.loads(raw) if schema is not None else None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ProtocolError) as exc:
            raise CallFailed(f"{method} {url}: {type(exc).__name__}: {exc}") from None

    async def fetch_tensors(
        self,
        url: str,
        params: Mapping[str, str | int],
        out: dict[str, np.ndarray] | None = None,
    ) -> tuple[dict[str, str], dict[str, np.ndarray], dict[str, str]]:
        """GET a container: (metadata, tensors, response headers). Tensors named in ``out`` are
        read into those arrays."""
        try:
            async with self.session.get(url, params=params) as response:
                if response.status >= 400:
                    raise CallFailed(f"GET {url}: HTTP {response.status} {(await response.read())[:300]!r}")
                reader = AsyncContainerReader(response.content, MAX_STATE_BYTES, total_bytes=response.content_length)
                header = await reader.read_header()
                tensors = {}
                for entry in header.entries:
                    data = await reader.read_tensor(entry)
                    target = (out or {}).get(entry.name)
                    if target is not None:
                        if target.size != entry.numel or target.dtype != entry.dtype:
                            raise CallFailed(f"GET {url}: tensor {entry.name} does not fit its buffer")
                        target[...] = data.reshape(target.shape)
                        data = target
                    tensors[entry.name] = data
                return header.metadata, tensors, dict(response.headers)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ProtocolError, ValueError) as exc:
            raise CallFailed(f"GET {url}: {type(exc).__name__}: {exc}") from None


class CallFailed(Exception):
    """A relay <-> aggregator call did not complete (the other side counts as dead)."""


def check_range(start: int, end: int, numel: int) -> None:
    if not 0 <= start < end <= numel:
        raise ApiError(400, "bad_range", f"[{start}, {end}) is not a slice of the {numel} parameters")
