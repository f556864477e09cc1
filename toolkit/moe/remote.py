"""Expert calls through the relay: the :class:`~toolkit.moe.calls.ExpertCaller` a trainer uses.

Each call is one HTTP request (``PUT /api/moe/peers/{peer_id}/calls/{uid}``, :meth:`MoeCalls.call <toolkit.client.moe.MoeCalls.call>`) that the relay holds
until the expert's host answered: the relay is the only address volunteers can reach. Calls run on
a thread pool, so a layer's calls to its k experts (and several micro-batches) are in flight at
once: Learning@home's answer to latency. Every call carries a fresh call id, which makes the
client's retry after a broken connection safe (the relay answers a repeated id with the same
task: a backward is never applied twice). Any refusal (expert gone, queue full, timeout, a result
the relay rejected) becomes :class:`~toolkit.moe.calls.ExpertFailed`: the layer masks that
expert, it never sees garbage.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
import uuid

import numpy as np
import torch
from requests.adapters import DEFAULT_POOLSIZE, HTTPAdapter

from toolkit.client import RelayClient
from toolkit.errors import CollabError
from toolkit.moe.calls import ExpertFailed
from toolkit.wire import payloads
from toolkit.wire.compression import get_codec
from toolkit.wire.protocol import MoeSpec

DIRECTORY_REFRESH_S = 1.0


class RelayExpertCaller:
    def __init__(
        self, client: RelayClient, peer_id: str, *, max_workers: int = 16, refresh_s: float = DIRECTORY_REFRESH_S
    ) -> None:
        self.client, self.peer_id = client, peer_id
        # requests keeps 10 connections per host: with more calls in flight, every extra call
        # opened a connection and discarded it after one answer -- a TCP (and TLS) handshake each,
        # round trips on exactly the slow links DMoE is for. Keep one connection per worker.
        client.session.mount(
            client.url + "/", HTTPAdapter(pool_connections=1, pool_maxsize=max(max_workers, DEFAULT_POOLSIZE))
        )
        self.spec: MoeSpec = client.moe.spec()
        self.width = self.spec.width
        self.codec = get_codec(self.spec.codec)  # activations on the wire
        self.refresh_s = refresh_s
        self._live: frozenset[str] = frozenset()
        self._live_at = float("-inf")
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="collab-expert-call")

    def live(self) -> frozenset[str]:
        """The relay's directory, refreshed at most every ``refresh_s`` (a stale snapshot only
        means a call to a departed expert fails and is masked, as with an expired DHT entry)."""
        with self._lock:
            if time.monotonic() - self._live_at >= self.refresh_s:
                try:
                    self._live = frozenset(self.client.moe.directory().live)
                except CollabError:
                    pass  # keep the last snapshot; calls to experts that left fail and are masked
                self._live_at = time.monotonic()
            return self._live

    def forward(self, uid: str, x: torch.Tensor) -> concurrent.futures.Future[torch.Tensor]:
        return self._pool.submit(self._call, uid, "forward", x, None)

    def backward(self, uid: str, x: torch.Tensor, grad_y: torch.Tensor) -> concurrent.futures.Future[torch.Tensor]:
        return self._pool.submit(self._call, uid, "backward", x, grad_y)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _call(self, uid: str, kind: str, x: torch.Tensor, grad_y: torch.Tensor | None) -> torch.Tensor:
        try:
            body = payloads.call_body(_f32(x), None if grad_y is None else _f32(grad_y), self.codec)
        except ValueError as exc:  # NaN or beyond the codec's range: this call cannot be made
            raise ExpertFailed("bad_input", f"{kind} call to {uid}: {exc}") from None
        try:
            answer = self.client.moe.call(self.peer_id, uid, kind=kind, call_id=uuid.uuid4().hex, body=body)
            _, tensors = payloads.decode(answer, x.shape[0] * self.width * 4 + 4096)
            out = payloads.read_rows(tensors, "y" if kind == "forward" else "g", x.shape[0], self.width, self.codec)
        except CollabError as exc:
            raise ExpertFailed(getattr(exc, "code", "expert_failed"), f"{kind} call to {uid}: {exc.message}") from None
        return torch.from_numpy(out.copy()).to(dtype=x.dtype)


def _f32(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).cpu().contiguous().numpy()
