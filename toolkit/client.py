"""The peer's only connection to the world: outbound HTTP(S) to one relay URL.

A keep-alive ``requests.Session``; bodies streamed in chunks both ways (a 100 MB gradient is sent
straight from its buffer and parameters are read straight into the model's flat buffer); retries
with exponential backoff for requests that are safe to repeat; relay errors become typed
exceptions carrying the relay's hint. One client per thread: sessions are not shared.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any, TypeVar

import numpy as np
import requests

from toolkit.auth import BODY_SHA256_HEADER, container_body_sha256, digest_metadata
from toolkit.compression import Codec, apply_delta
from toolkit.errors import ProtocolError, RelayRejected, RelayUnreachable
from toolkit.protocol import (
    ROUTES,
    CollabState,
    GradientMeta,
    Heartbeat,
    JoinRequest,
    JoinResponse,
    LoginRequest,
    LoginResponse,
    RunInfo,
    ShardLease,
    ShardLeaseRequest,
    ShardReport,
    ShardReportAck,
    ShardsReport,
    StateInfo,
    StatusReport,
    UploadReceipt,
)
from toolkit.schema import Schema
from toolkit.signing import (
    AccessPass,
    AccessPassHolder,
    PeerKey,
    RelayKeyPins,
    SignedAuth,
)
from toolkit.tensor_container import (
    encoded_size,
    iter_encoded,
    peek_header,
    read_container,
)

log = logging.getLogger(__name__)
S = TypeVar("S", bound=Schema)
_RETRY_STATUS = {502, 503, 504}
_MAX_RETRY_AFTER_S = 30.0
_RENEW_PASS = {"pass_expired", "stale_timestamp"}  # a fresh pass (or clock offset) fixes these
_RELOGIN = {"pass_expired", "pass_wrong_relay", "reauth_required", "forged_pass", "stale_timestamp"}


class RelayClient:
    """Typed calls to the relay API. ``auth`` (optional) signs requests (see toolkit.signing)."""

    def __init__(self, url: str, *, connect_timeout_s: float = 10.0, read_timeout_s: float = 120.0,
                 retries: int = 4, backoff_s: float = 0.5, auth: requests.auth.AuthBase | None = None) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"relay URL must start with http:// or https://, got {url!r}")
        self.url = url.rstrip("/")
        self.timeout = (connect_timeout_s, read_timeout_s)
        self.retries, self.backoff_s = retries, backoff_s
        self.session = requests.Session()
        self.session.headers["User-Agent"] = "collabtrain-peer"
        self.session.auth = auth

    def close(self) -> None:
        self.session.close()

    # --- plumbing -------------------------------------------------------------------------------
    def _request(self, method: str, path: str, *, retry: bool = True, **kwargs: Any) -> requests.Response:
        kwargs.setdefault("timeout", self.timeout)
        attempts = self.retries + 1 if retry else 1
        for attempt in range(attempts):
            try:
                response = self.session.request(method, self.url + path, **kwargs)
            except (requests.ConnectionError, requests.Timeout) as exc:
                if attempt + 1 == attempts:
                    raise RelayUnreachable("relay_unreachable", f"{method} {path}: {type(exc).__name__}: {exc}") from None
                self._sleep(attempt, f"{type(exc).__name__}")
                continue
            if response.status_code in _RETRY_STATUS and attempt + 1 < attempts:
                self._sleep(attempt, f"HTTP {response.status_code}")
                continue
            if response.status_code == 429 and attempt + 1 < attempts:  # rate limited: wait as told
                delay = min(_MAX_RETRY_AFTER_S, _retry_after(response) or self.backoff_s * 2 ** attempt)
                log.debug("rate limited; retrying in %.1fs", delay)
                time.sleep(delay)
                continue
            if (response.status_code == 401 and attempt + 1 < attempts and isinstance(self.session.auth, SignedAuth)
                    and _rejected(response).code in _RENEW_PASS):
                self.session.auth.holder.invalidate()  # the next attempt is signed with a fresh pass
                continue
            if response.status_code >= 400:
                raise _rejected(response)
            return response
        raise AssertionError("unreachable")

    def _sleep(self, attempt: int, why: str) -> None:
        delay = self.backoff_s * 2 ** attempt
        log.debug("relay request failed (%s); retrying in %.1fs", why, delay)
        time.sleep(delay)

    def _call(self, method: str, path: str, schema: type[S], body: Schema | None = None, **kwargs: Any) -> S:
        if body is not None:
            kwargs["data"] = body.dumps()
            kwargs["headers"] = {"Content-Type": "application/json"}
        response = self._request(method, path, **kwargs)
        try:
            return schema.from_json(response.json())
        except ValueError as exc:
            if isinstance(exc, ProtocolError):
                raise
            raise ProtocolError("bad_json", f"{path}: the relay's answer is not JSON") from None

    # --- API ------------------------------------------------------------------------------------
    def login(self, hf_token: str, *, pins: RelayKeyPins | None = None) -> AccessPassHolder:
        """Prove this peer's Hugging Face identity once; from then on every request is signed with a
        fresh in-memory key and the access pass renews itself (through the relay's refresh route,
        falling back to the token when the relay asks for a full login)."""
        peer_key, pins = PeerKey(), pins or RelayKeyPins()

        def obtain(previous: AccessPass | None) -> AccessPass:
            answer = None
            if previous is not None:
                try:
                    answer = self._call("POST", ROUTES["refresh"], LoginResponse, retry=False)
                except RelayRejected as exc:
                    if exc.code not in _RELOGIN:
                        raise
            if answer is None:
                answer = self._call("POST", ROUTES["login"], LoginResponse,
                                    LoginRequest(hf_token=hf_token, peer_public_key=peer_key.public_b64))
            return AccessPass.from_login(answer, peer_key=peer_key, relay_url=self.url, pins=pins)

        holder = AccessPassHolder(obtain)
        self.session.auth = SignedAuth(peer_key, holder)
        holder.current()  # a bad token or a user not on the allowlist fails here, with the relay's hint
        return holder

    @property
    def signed(self) -> bool:
        return isinstance(self.session.auth, SignedAuth)

    def get_run(self) -> RunInfo:
        return self._call("GET", ROUTES["run"], RunInfo)

    def get_status(self) -> StatusReport:
        return self._call("GET", ROUTES["status"], StatusReport)

    def lease_shard(self, peer_id: str, request: ShardLeaseRequest) -> ShardLease:
        return self._call("POST", ROUTES["shard_lease"].format(peer_id=peer_id), ShardLease, request)

    def report_shards(self, peer_id: str, report: ShardReport) -> ShardReportAck:
        return self._call("POST", ROUTES["shard_report"].format(peer_id=peer_id), ShardReportAck, report)

    def get_shards(self, source: str | None = None) -> ShardsReport:
        return self._call("GET", ROUTES["shards"], ShardsReport, params={"source": source} if source else None)

    def get_progress(self) -> CollabState:
        return self._call("GET", ROUTES["progress"], CollabState)

    def get_state(self) -> StateInfo:
        return self._call("GET", ROUTES["state"], StateInfo)

    def join(self, request: JoinRequest) -> JoinResponse:
        return self._call("POST", ROUTES["join"], JoinResponse, request)

    def heartbeat(self, peer_id: str, hb: Heartbeat) -> CollabState:
        return self._call("POST", ROUTES["heartbeat"].format(peer_id=peer_id), CollabState, hb)

    def leave(self, peer_id: str) -> None:
        self._request("POST", ROUTES["leave"].format(peer_id=peer_id), retry=False, timeout=(3, 5))

    def upload_gradient(self, tensors: list[tuple[str, np.ndarray]], meta: GradientMeta, codec: str) -> UploadReceipt:
        """Stream a gradient sum encoded by ``codec`` (:meth:`Codec.encode` output) for round
        ``meta.step``. Not retried: a second attempt would race the round's deadline; the
        optimizer decides what to do with the gradient instead."""
        metadata = {"collab": meta.dumps().decode(), "codec": codec}
        headers = {"Content-Type": "application/octet-stream"}
        if self.signed:  # the relay checks every chunk against its digest before using it
            metadata.update(digest_metadata(tensors))
            headers[BODY_SHA256_HEADER] = container_body_sha256(tensors, metadata)
        response = self._request(
            "PUT", ROUTES["gradient"].format(step=meta.step), retry=False,
            params={"peer_id": meta.peer_id}, data=_SizedBody(tensors, metadata), headers=headers)
        return UploadReceipt.from_json(response.json())

    def download_params(self, public: np.ndarray, *, have: int | None = None, codec: Codec | None = None,
                        min_step: int = 0, wait_s: float = 0, peer_id: str = "") -> int | None:
        """Bring ``public`` (P,) float32 to the relay's version >= ``min_step``; returns that
        version, or None if nothing newer came within ``wait_s`` seconds.

        ``public`` must hold version ``have`` exactly (the copy every peer shares): then a lossy
        run's relay may answer with just the delta, which is applied in place. A full answer is
        read straight into ``public``."""
        params = {"min_step": min_step, "wait": int(wait_s), "peer_id": peer_id}
        if have is not None and codec is not None and not codec.lossless:
            params["have"] = have
        timeout = (self.timeout[0], self.timeout[1] + wait_s)
        with self._request("GET", ROUTES["params"], params=params, stream=True, timeout=timeout) as response:
            if response.status_code == 204:
                return None
            header = peek_header(response.raw, public.nbytes)
            if header.metadata.get("kind") == "delta":
                if codec is None or header.metadata.get("base") != str(have):
                    raise ProtocolError("bad_delta", f"the relay sent a delta against version "
                                        f"{header.metadata.get('base')}, this peer holds {have}")
                _, tensors = read_container(response.raw, public.nbytes, header=header)
                apply_delta(codec, public, tensors)
            else:
                read_container(response.raw, public.nbytes, out={"params": public}, header=header)
            if self.signed and hashlib.sha256(memoryview(public).cast("B")).hexdigest() != \
                    response.headers.get("X-Collab-Sha256", ""):
                raise ProtocolError("params_hash_mismatch", "the downloaded parameters differ from the hash the "
                                    "relay signed", "Download again; if it repeats, something alters the traffic.")
        return int(header.metadata.get("step", -1))


class _SizedBody:
    """An iterable body with a known length: requests then sends Content-Length, not chunked
    encoding, so the relay can refuse an oversized upload before reading it."""

    def __init__(self, tensors: list[tuple[str, np.ndarray]], metadata: dict[str, str]) -> None:
        self.tensors, self.metadata = tensors, metadata
        self.size = encoded_size(tensors, metadata)

    def __len__(self) -> int:
        return self.size

    def __iter__(self):
        return iter_encoded(self.tensors, self.metadata)


def _retry_after(response: requests.Response) -> float | None:
    try:
        return max(0.0, float(response.headers.get("Retry-After", "")))
    except ValueError:
        return None


def _rejected(response: requests.Response) -> RelayRejected:
    try:
        body = response.json()
        return RelayRejected(str(body.get("error", "error")), str(body.get("message", "")),
                             str(body.get("hint", "")), status=response.status_code)
    except ValueError:
        return RelayRejected(f"http_{response.status_code}", response.text[:200], status=response.status_code)
