"""The peer's only connection to the world: outbound HTTP(S) to the relay (and, when the relay's
plan has them, to the aggregators it names -- still outbound only).

A keep-alive ``requests.Session``; bodies streamed in chunks both ways (a 100 MB gradient is sent
straight from its buffer and parameters are read straight into the model's flat buffer); retries
with exponential backoff for requests that are safe to repeat; relay errors become typed
exceptions carrying the relay's hint. One client per thread: sessions are not shared. Slices go
to and come from their owners in parallel, each owner over its own session on a small pool. The
bodies themselves (sized uploads, slice parts, parameters read in place) are :mod:`toolkit.transfer`'s.
"""

from __future__ import annotations

import hashlib
import logging
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, TypeVar

import numpy as np
import requests

from toolkit.wire.auth import BODY_SHA256_HEADER, container_body_sha256, digest_metadata
from toolkit.wire.compression import Codec
from toolkit.errors import (NOT_A_RELAY_HINT, CollabError, ProtocolError, RelayRejected, RelayUnreachable,
                            RelayUrlError, not_a_relay_message, unreachable_reason)
from toolkit.wire.protocol import (
    ROUTES,
    TICKET_HEADER,
    CollabState,
    DoneRequest,
    ParamsManifest,
    PlanInfo,
    SliceVersion,
    TicketRequest,
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
from toolkit.wire.schema import Schema
from toolkit.signing import (
    AccessPass,
    AccessPassHolder,
    PeerKey,
    RelayKeyPins,
    SignedAuth,
)
from toolkit.transfer import BODY_ERRORS, SizedBody, SlicePart, read_checked_params, read_params, retry_after_s
from toolkit.wire.tensor_container import peek_header

log = logging.getLogger(__name__)
S = TypeVar("S", bound=Schema)
_RETRY_STATUS = {502, 503, 504}
_MAX_RETRY_AFTER_S = 30.0
_DOWNLOAD_ATTEMPTS = 4  # a parameter body cut or corrupted on the way is fetched again, whole
_RENEW_PASS = {"pass_expired", "stale_timestamp"}  # a fresh pass (or clock offset) fixes these
_RELOGIN = {"pass_expired", "pass_wrong_relay", "reauth_required", "forged_pass", "stale_timestamp"}


class RelayClient:
    """Typed calls to the relay API. ``auth`` (optional) signs requests (see toolkit.signing)."""

    def __init__(self, url: str, *, connect_timeout_s: float = 10.0, read_timeout_s: float = 120.0,
                 retries: int = 4, backoff_s: float = 0.5, auth: requests.auth.AuthBase | None = None) -> None:
        if not url.startswith(("http://", "https://")):
            raise RelayUrlError("bad_relay_url", f"the relay URL must start with http:// or https://, got {url!r}")
        self.url = url.rstrip("/")
        self.timeout = (connect_timeout_s, read_timeout_s)
        self.retries, self.backoff_s = retries, backoff_s
        self.session = requests.Session()
        self.session.headers["User-Agent"] = "collabtrain-peer"
        self.session.auth = auth
        self._owners: dict[str, requests.Session] = {}  # slice owner URL ("" = the relay) -> session
        self._pool: ThreadPoolExecutor | None = None

    def close(self) -> None:
        self.session.close()
        for session in self._owners.values():
            session.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    # --- plumbing -------------------------------------------------------------------------------
    def _request(self, method: str, path: str, *, retry: bool = True, **kwargs: Any) -> requests.Response:
        kwargs.setdefault("timeout", self.timeout)
        attempts = self.retries + 1 if retry else 1
        for attempt in range(attempts):
            try:
                response = self.session.request(method, self.url + path, **kwargs)
            except (requests.ConnectionError, requests.Timeout) as exc:
                if attempt + 1 == attempts:
                    raise RelayUnreachable("relay_unreachable", f"no answer from the relay at {self.url} "
                                           f"({unreachable_reason(exc)}) after {attempts} tries ({method} {path})") from None
                self._sleep(attempt, f"{type(exc).__name__}")
                continue
            if response.status_code in (*_RETRY_STATUS, 429) and attempt + 1 < attempts:
                self._sleep(attempt, f"HTTP {response.status_code}", retry_after_s(response.headers))  # busy / limited
                response.close()
                continue
            if (response.status_code == 401 and attempt + 1 < attempts and isinstance(self.session.auth, SignedAuth)
                    and _rejected(response).code in _RENEW_PASS):
                self.session.auth.holder.invalidate()  # the next attempt is signed with a fresh pass
                continue
            if response.status_code >= 400:
                raise _rejected(response)
            return response
        raise AssertionError("unreachable")

    def _sleep(self, attempt: int, why: str, retry_after: float | None = None) -> None:
        """Backoff (or the relay's Retry-After) plus jitter: a thousand refused peers must not return at once."""
        base = min(_MAX_RETRY_AFTER_S, retry_after) if retry_after is not None else self.backoff_s * 2 ** attempt
        delay = base * random.uniform(1.0, 1.5)
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
            raise ProtocolError("not_a_relay", not_a_relay_message(response.url, response.status_code,
                                response.headers.get("Content-Type", "")), NOT_A_RELAY_HINT) from None

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

    def get_tokenizer(self, expected_sha256: str) -> bytes:
        """The run's ``tokenizer.json``, refused unless its sha256 is the one RunInfo publishes."""
        body = self._request("GET", ROUTES["tokenizer"]).content
        got = hashlib.sha256(body).hexdigest()
        if got != expected_sha256:
            raise ProtocolError("tokenizer_mismatch", f"the relay's tokenizer.json has sha256 {got[:12]}..., the run "
                                f"publishes {expected_sha256[:12] or '(none)'}...", "The relay's tokenizer changed "
                                "under the run (or a proxy altered it): ask the organizer, then join again.")
        return body

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
            params={"peer_id": meta.peer_id}, data=SizedBody(tensors, metadata), headers=headers)
        return UploadReceipt.from_json(response.json())

    def download_params(self, public: np.ndarray, *, have: int | None = None, codec: Codec | None = None,
                        min_step: int = 0, wait_s: float = 0, peer_id: str = "") -> int | None:
        """Bring ``public`` (P,) float32 to the relay's version >= ``min_step``; returns that
        version, or None if nothing newer came within ``wait_s`` seconds.

        ``public`` must hold version ``have`` exactly (the copy every peer shares): then a lossy
        run's relay may answer with just the delta, which is applied in place. A full answer is read
        into ``public``; one failing its length or digest check is fetched again, whole (transfer)."""
        for attempt in range(_DOWNLOAD_ATTEMPTS):
            try:
                return self._download_once(public, have, codec, min_step, wait_s, peer_id)
            except (ProtocolError, *BODY_ERRORS) as exc:
                final = isinstance(exc, RelayUnreachable) or getattr(exc, "code", "") in ("bad_manifest", "bad_delta")
                if final or attempt + 1 == _DOWNLOAD_ATTEMPTS:
                    raise exc if isinstance(exc, CollabError) else RelayUnreachable("download_failed", repr(exc)) from None
                log.info("parameter download failed (%s); downloading them again in full", exc)
                have = None  # ``public`` may be half-written: only a whole version restores it
                self._sleep(attempt, type(exc).__name__)
        raise AssertionError("unreachable")

    def _download_once(self, public: np.ndarray, have: int | None, codec: Codec | None, min_step: int, wait_s: float,
                       peer_id: str) -> int | None:
        params = {"min_step": min_step, "wait": int(wait_s), "peer_id": peer_id}
        if have is not None and codec is not None and not codec.lossless:
            params["have"] = have
        timeout = (self.timeout[0], self.timeout[1] + wait_s)
        with self._request("GET", ROUTES["params"], params=params, stream=True, timeout=timeout) as response:
            if response.status_code == 204:
                return None
            if response.headers.get("Content-Type", "").startswith("application/json"):
                manifest = self._manifest(response)
                response.close()
                return self._download_slices(manifest, public, have=have, codec=codec, peer_id=peer_id)
            return read_checked_params(response.raw, response.headers, public, have, codec)

    # --- sliced rounds: the relay's plan cuts the vector among aggregators ------------------------
    def get_plan(self) -> PlanInfo:
        return self._call("GET", ROUTES["plan"], PlanInfo)

    def request_ticket(self, step: int, peer_id: str, request: TicketRequest) -> str:
        """The relay's permission to upload this gradient's slices (the header value to present)."""
        response = self._request("POST", ROUTES["ticket"].format(step=step), retry=False, params={"peer_id": peer_id},
                                 data=request.dumps(), headers={"Content-Type": "application/json"})
        try:
            return str(response.json()["ticket"])
        except (ValueError, KeyError, TypeError):
            raise ProtocolError("bad_json", "the relay's ticket answer is malformed") from None

    def report_done(self, step: int, peer_id: str, request: DoneRequest) -> UploadReceipt:
        return self._call("POST", ROUTES["done"].format(step=step), UploadReceipt, request,
                          params={"peer_id": peer_id}, retry=False)

    def upload_slices(self, step: int, ticket: str, parts: list[SlicePart],
                      keepalive: Callable[[], Any] | None = None, keepalive_s: float = 1.0) -> list[CollabError | None]:
        """Upload every slice to its owner in parallel; ``None`` per accepted slice, else the error.
        ``keepalive`` runs every ``keepalive_s`` in the calling thread while they stream (the
        relay must keep hearing from a peer whose uploads go elsewhere)."""
        futures = [self._pool_().submit(self._upload_slice, step, ticket, part) for part in parts]
        while True:
            done, pending = wait(futures, timeout=keepalive_s)
            if not pending:
                break
            if keepalive is not None:
                try:
                    keepalive()
                except CollabError as exc:
                    log.debug("keepalive failed during uploads: %s", exc)
        return [f.result() for f in futures]

    def _upload_slice(self, step: int, ticket: str, part: SlicePart) -> CollabError | None:
        session, base = self._owner(part.plan.url)
        headers = {"Content-Type": "application/octet-stream", TICKET_HEADER: ticket}
        if self.signed and not part.plan.url:  # the relay's own slice goes through its signed session
            headers[BODY_SHA256_HEADER] = part.header_sha256
        try:
            response = session.put(base + ROUTES["gradient"].format(step=step), data=SizedBody(part.tensors, part.metadata),
                                   headers=headers, timeout=self.timeout)
        except (requests.ConnectionError, requests.Timeout) as exc:
            return RelayUnreachable("owner_unreachable", f"slice [{part.plan.start}, {part.plan.end}) to "
                                    f"{part.plan.name}: {type(exc).__name__}")
        if response.status_code >= 400:
            return _rejected(response)
        return None

    def _download_slices(self, manifest: ParamsManifest, public: np.ndarray, *, have: int | None,
                         codec: Codec | None, peer_id: str) -> int:
        """Bring every slice of ``manifest`` into ``public`` from its owner, each checked against the
        relay-signed hash; a slice whose owner fails is fetched again from the owner named by the
        relay's newest manifest (slices move when an aggregator dies)."""
        if manifest.num_params != public.size:
            raise ProtocolError("bad_manifest", f"manifest of {manifest.num_params} parameters, model has {public.size}")
        todo = list(manifest.slices)
        for attempt in range(4):
            futures = {self._pool_().submit(self._download_slice, s, manifest.step, public, have, codec, peer_id): s
                       for s in todo}
            wait(futures)
            failed = [(s, f.exception()) for f, s in futures.items() if f.exception() is not None]
            if not failed:
                return manifest.step
            if attempt == 3:  # the relay will move the slice (dead owner); the caller retries later
                raise RelayUnreachable("slices_unavailable", f"{len(failed)} slice(s) of step {manifest.step} could "
                                       f"not be downloaded: {failed[0][1]}") from failed[0][1]
            log.info("%d slice(s) failed (%s); asking the relay where they are now", len(failed), failed[0][1])
            time.sleep(self.backoff_s * 2 ** attempt)
            with self._request("GET", ROUTES["params"], params={"min_step": manifest.step, "peer_id": peer_id},
                               stream=True) as response:
                if not response.headers.get("Content-Type", "").startswith("application/json"):
                    raise ProtocolError("bad_manifest", "the relay stopped slicing mid-download; download again")
                latest = self._manifest(response)
            have = None  # a failed slice may be half-written: whole slices from now on
            if latest.step != manifest.step:  # a newer version: take every slice of it
                manifest, todo = latest, list(latest.slices)
            else:
                wanted = {(s.start, s.end) for s, _ in failed}
                manifest, todo = latest, [s for s in latest.slices if (s.start, s.end) in wanted] or list(latest.slices)
        raise AssertionError("unreachable")

    def _download_slice(self, s: SliceVersion, step: int, public: np.ndarray, have: int | None,
                        codec: Codec | None, peer_id: str) -> None:
        view = public[s.start:s.end]
        params = {"start": s.start, "end": s.end, "min_step": step, "peer_id": peer_id}
        if have is not None and codec is not None and not codec.lossless:
            params["have"] = have
        session, base = self._owner(s.url)
        try:
            with session.get(base + ROUTES["params"], params=params, stream=True, timeout=self.timeout) as response:
                if response.status_code >= 400:
                    raise _rejected(response)
                if response.status_code == 204:
                    raise ProtocolError("slice_missing", f"{s.url or 'the relay'} has no step {step} of its slice")
                header = peek_header(response.raw, view.nbytes)
                if int(header.metadata.get("step", -1)) != step:
                    raise ProtocolError("slice_version", f"slice [{s.start}, {s.end}) came at step "
                                        f"{header.metadata.get('step')}, the manifest says {step}")
                read_params(response.raw, header, view, have, codec)
        except (requests.ConnectionError, requests.Timeout) as exc:
            raise RelayUnreachable("owner_unreachable", f"slice [{s.start}, {s.end}) from "
                                   f"{s.url or self.url}: {type(exc).__name__}") from None
        if hashlib.sha256(memoryview(view).cast("B")).hexdigest() != s.sha256:
            raise ProtocolError("params_hash_mismatch", f"slice [{s.start}, {s.end}) differs from the hash the relay "
                                "published", "Download again; if it repeats, report the aggregator to the organizer.")

    def _manifest(self, response: requests.Response) -> ParamsManifest:
        try:
            return ParamsManifest.from_json(response.json())
        except ValueError as exc:
            if isinstance(exc, ProtocolError):
                raise
            raise ProtocolError("bad_json", "the relay's manifest is not JSON") from None

    def _owner(self, url: str) -> tuple[requests.Session, str]:
        """The session for a slice owner ("" = the relay: signed like every relay request)."""
        session = self._owners.get(url)
        if session is None:
            session = self._owners[url] = requests.Session()
            session.headers["User-Agent"] = "collabtrain-peer"
            if not url:
                session.auth = self.session.auth
        return session, (url or self.url).rstrip("/")

    def _pool_(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="collab-slices")
        return self._pool


def _rejected(response: requests.Response) -> RelayRejected:
    try:
        body = response.json()
        return RelayRejected(str(body.get("error", "error")), str(body.get("message", "")),
                             str(body.get("hint", "")), status=response.status_code)
    except ValueError:
        return RelayRejected("not_a_relay", not_a_relay_message(response.url, response.status_code,
                             response.headers.get("Content-Type", "")), NOT_A_RELAY_HINT, status=response.status_code)

