"""The bulk bodies: the run's parameters coming in, gradient slices going out.

Parameters are read straight into the model's flat float32 buffer: whole, as a delta against the
version the peer holds (lossy runs), or -- when the relay's plan cuts the vector among
aggregators -- slice by slice from each owner, each slice checked against the hash the relay
signed. A body that fails its length or digest check is fetched again, whole: a half-written
buffer is never taken for a version. Gradient slices go to their owners in parallel while the
caller keeps the relay hearing from it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import wait
from typing import Any

import numpy as np
import requests

from toolkit.client.transport import NO_ANSWER, Transport, json_answer, rejected
from toolkit.errors import CollabError, ProtocolError, RelayUnreachable, unreachable_reason
from toolkit.transfer import BODY_ERRORS, SizedBody, SlicePart, read_checked_params, read_hashed
from toolkit.wire.auth import BODY_SHA256_HEADER
from toolkit.wire.compression import Codec
from toolkit.wire.protocol import PARAMS_REF_TYPE, ROUTES, TICKET_HEADER, ParamsManifest, ParamsRef, SliceVersion
from toolkit.wire.tensor_container import peek_header

log = logging.getLogger(__name__)

DOWNLOAD_ATTEMPTS = 4
"""How often a parameter body cut or corrupted on the way is fetched again, whole."""

SLICE_ATTEMPTS = 4
"""Rounds of fetching failed slices (from the owner the relay's newest manifest names) before
giving up until the caller's next try (a dead owner's slices move within seconds)."""


class ParamsTransfer:
    """Parameter downloads (whole, delta or sliced) and sliced gradient uploads, over ``transport``
    (its sessions, its slice owners' sessions and thread pool, its retry policy)."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.cache_failures = 0
        """Bodies the run's HTTP cache failed to give or gave wrong (each then came from the relay)."""

    def download_params(
        self,
        public: np.ndarray,
        *,
        have: int | None = None,
        codec: Codec | None = None,
        min_step: int = 0,
        wait_s: float = 0,
        peer_id: str = "",
    ) -> int | None:
        """Bring ``public`` (P,) float32 to the relay's version >= ``min_step``; returns that
        version, or None if nothing newer came within ``wait_s`` seconds.

        ``public`` must hold version ``have`` exactly (the copy every peer shares): then a lossy
        run's relay may answer with just the delta, which is applied in place. A full answer is
        read into ``public``; one failing its length or digest check is fetched again, whole."""
        for attempt in range(DOWNLOAD_ATTEMPTS):
            try:
                return self._download_once(public, have, codec, min_step, wait_s, peer_id)
            except (ProtocolError, *BODY_ERRORS) as exc:
                final = isinstance(exc, RelayUnreachable) or getattr(exc, "code", "") in ("bad_manifest", "bad_delta")
                if final or attempt + 1 == DOWNLOAD_ATTEMPTS:
                    if isinstance(exc, CollabError):
                        raise exc from None
                    raise RelayUnreachable("download_failed", repr(exc)) from None
                log.info("parameter download failed (%s); downloading them again in full", exc)
                have = None  # ``public`` may be half-written: only a whole version restores it
                self.transport.backoff(attempt, type(exc).__name__)
        raise AssertionError("unreachable")

    def _download_once(
        self,
        public: np.ndarray,
        have: int | None,
        codec: Codec | None,
        min_step: int,
        wait_s: float,
        peer_id: str,
        *,
        via_cache: bool = True,
    ) -> int | None:
        """One GET of the parameters: a tensor container read into ``public``, a manifest whose
        slices are then fetched from their owners, or (``via_cache``: ``ref=1``, which a relay
        without a cache ignores) a signed ref to the body at the run's HTTP cache."""
        params = {"min_step": min_step, "wait": int(wait_s), "peer_id": peer_id}
        if have is not None and codec is not None and not codec.lossless:
            params["have"] = have
        if via_cache:
            params["ref"] = 1
        timeout = (self.transport.timeout[0], self.transport.timeout[1] + wait_s)
        with self.transport.request("GET", ROUTES["params"], params=params, stream=True, timeout=timeout) as response:
            if response.status_code == 204:
                return None
            if response.headers.get("Content-Type", "").startswith(PARAMS_REF_TYPE):
                ref = self._ref(response)
                response.close()
                return self._download_ref(ref, public, have, codec, peer_id)
            if response.headers.get("Content-Type", "").startswith("application/json"):
                manifest = self.manifest(response)
                response.close()
                return self._download_slices(manifest, public, have=have, codec=codec, peer_id=peer_id)
            return read_checked_params(response.raw, response.headers, public, have, codec)

    # --- through the run's HTTP cache ([server] public_params_url) -------------------------------
    def _download_ref(
        self, ref: ParamsRef, public: np.ndarray, have: int | None, codec: Codec | None, peer_id: str
    ) -> int | None:
        """The body ``ref`` names, from the cache, checked against the hash the relay signed; a
        cache that fails or lies is counted, logged, and the version comes from the relay."""
        if ref.kind == "delta" and ref.base != have:
            raise ProtocolError(
                "bad_delta", f"the relay named a delta against version {ref.base}, this peer holds {have}"
            )
        touched = False  # once bytes land in ``public``, only a whole version restores it
        try:
            session, _ = self.transport.owner_session(ref.url.split("/api/", 1)[0])
            with session.get(ref.url, stream=True, timeout=self.transport.timeout) as response:
                if response.status_code != 200:
                    raise ProtocolError("cache_status", f"HTTP {response.status_code}")
                touched = True
                checks = {"X-Collab-Sha256": ref.sha256}  # the relay's word, never the cache's
                if "Content-Length" in response.headers:
                    checks["Content-Length"] = response.headers["Content-Length"]
                step = read_checked_params(response.raw, checks, public, have if ref.kind == "delta" else None, codec)
            if step != ref.step:
                raise ProtocolError("cache_step", f"the body is step {step}, the relay named {ref.step}")
            return step
        except (ProtocolError, requests.RequestException, *BODY_ERRORS) as exc:
            self.cache_failures += 1
            log.warning(
                "the run's parameter cache failed for step %d (%s: %s); downloading it from the relay "
                "instead (%d cache failure(s) so far). If this repeats, tell the organizer: the cache at "
                "%s serves wrong bytes or is down ([server] public_params_url).",
                ref.step,
                getattr(exc, "code", type(exc).__name__),
                exc,
                self.cache_failures,
                ref.url,
            )
        return self._download_once(public, None if touched else have, codec, ref.step, 0, peer_id, via_cache=False)

    def _ref(self, response: requests.Response) -> ParamsRef:
        return json_answer(response, ParamsRef, "bad_json", "the relay's parameters ref is not JSON")

    # --- sliced rounds: the relay's plan cuts the vector among aggregators ------------------------
    def upload_slices(
        self,
        step: int,
        ticket: str,
        parts: list[SlicePart],
        keepalive: Callable[[], Any] | None = None,
        keepalive_s: float = 1.0,
    ) -> list[CollabError | None]:
        """Upload every slice to its owner in parallel; ``None`` per accepted slice, else the error.

        ``keepalive`` runs every ``keepalive_s`` in the calling thread while they stream (the
        relay must keep hearing from a peer whose uploads go elsewhere)."""
        futures = [self.transport.pool().submit(self._upload_slice, step, ticket, part) for part in parts]
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
        """One slice to its owner, with the relay's ticket; the error is returned, not raised,
        so the other slices' outcomes are kept."""
        session, base = self.transport.owner_session(part.plan.url)
        headers = {"Content-Type": "application/octet-stream", TICKET_HEADER: ticket}
        if self.transport.signed and not part.plan.url:  # the relay's own slice goes through its signed session
            headers[BODY_SHA256_HEADER] = part.header_sha256
        try:
            response = session.put(
                base + ROUTES["gradient"].format(step=step),
                data=SizedBody(part.tensors, part.metadata),
                headers=headers,
                timeout=self.transport.timeout,
            )
        except NO_ANSWER as exc:
            return RelayUnreachable(
                "owner_unreachable",
                f"slice [{part.plan.start}, {part.plan.end}) to {part.plan.name}: {type(exc).__name__}",
            )
        if response.status_code >= 400:
            return rejected(response)
        return None

    def _download_slices(
        self, manifest: ParamsManifest, public: np.ndarray, *, have: int | None, codec: Codec | None, peer_id: str
    ) -> int:
        """Bring every slice of ``manifest`` into ``public`` from its owner, each checked against
        the relay-signed hash; a slice whose owner fails is fetched again from the owner named by
        the relay's newest manifest (slices move when an aggregator dies)."""
        if manifest.num_params != public.size:
            raise ProtocolError(
                "bad_manifest", f"manifest of {manifest.num_params} parameters, model has {public.size}"
            )
        todo = list(manifest.slices)
        pool = self.transport.pool()
        for attempt in range(SLICE_ATTEMPTS):
            futures = {
                pool.submit(self.download_slice, s, manifest.step, public, have, codec, peer_id): s for s in todo
            }
            wait(futures)
            failed = [(s, f.exception()) for f, s in futures.items() if f.exception() is not None]
            if not failed:
                return manifest.step
            if attempt + 1 == SLICE_ATTEMPTS:  # the relay will move the slice (dead owner); the caller retries later
                raise RelayUnreachable(
                    "slices_unavailable",
                    f"{len(failed)} slice(s) of step {manifest.step} could not be downloaded: {failed[0][1]}",
                ) from failed[0][1]
            log.info("%d slice(s) failed (%s); asking the relay where they are now", len(failed), failed[0][1])
            self.transport.backoff(attempt, "slice download")
            with self.transport.request(
                "GET", ROUTES["params"], params={"min_step": manifest.step, "peer_id": peer_id}, stream=True
            ) as response:
                if not response.headers.get("Content-Type", "").startswith("application/json"):
                    raise ProtocolError("bad_manifest", "the relay stopped slicing mid-download; download again")
                latest = self.manifest(response)
            have = None  # a failed slice may be half-written: whole slices from now on
            if latest.step != manifest.step:  # a newer version: take every slice of it
                manifest, todo = latest, list(latest.slices)
            else:
                wanted = {(s.start, s.end) for s, _ in failed}
                manifest = latest
                todo = [s for s in latest.slices if (s.start, s.end) in wanted] or list(latest.slices)
        raise AssertionError("unreachable")

    def download_slice(
        self,
        s: SliceVersion,
        step: int,
        public: np.ndarray,
        have: int | None,
        codec: Codec | None,
        peer_id: str,
        *,
        view: np.ndarray | None = None,
    ) -> None:
        """One slice from its owner into its view of ``public`` (or into ``view``, the slice
        alone: a pipeline stage holds nothing else), refused unless it is the manifest's step and
        hashes to what the relay published."""
        view = public[s.start : s.end] if view is None else view
        params = {"start": s.start, "end": s.end, "min_step": step, "peer_id": peer_id}
        if have is not None and codec is not None and not codec.lossless:
            params["have"] = have
        session, base = self.transport.owner_session(s.url)
        timeout = self.transport.timeout
        try:
            with session.get(base + ROUTES["params"], params=params, stream=True, timeout=timeout) as response:
                if response.status_code >= 400:
                    raise rejected(response)
                if response.status_code == 204:
                    raise ProtocolError("slice_missing", f"{s.url or 'the relay'} has no step {step} of its slice")
                header = peek_header(response.raw, view.nbytes)
                if int(header.metadata.get("step", -1)) != step:
                    raise ProtocolError(
                        "slice_version",
                        f"slice [{s.start}, {s.end}) came at step "
                        f"{header.metadata.get('step')}, the manifest says {step}",
                    )
                digest = read_hashed(response.raw, header, view, have, codec)
        except CollabError:
            raise
        except NO_ANSWER as exc:
            raise RelayUnreachable(
                "owner_unreachable",
                f"slice [{s.start}, {s.end}) from {s.url or self.transport.url}: {type(exc).__name__}",
            ) from None
        except BODY_ERRORS as exc:  # urllib3's IncompleteRead & co: the owner died (or restarted) mid-body
            raise cut_transfer(f"slice [{s.start}, {s.end}) from {s.url or self.transport.url}", exc) from None
        if digest != s.sha256:
            raise ProtocolError(
                "params_hash_mismatch",
                f"slice [{s.start}, {s.end}) differs from the hash the relay published",
                "Download again; if it repeats, report the aggregator to the organizer.",
            )

    def manifest(self, response: requests.Response) -> ParamsManifest:
        """The relay's list of slices and where each lives (a JSON answer to a params request)."""
        return json_answer(response, ParamsManifest, "bad_json", "the relay's manifest is not JSON")


def cut_transfer(what: str, exc: BaseException) -> RelayUnreachable:
    """A body cut off mid-way (the relay or a slice owner died or restarted while it streamed) as
    the error a peer waits out: the bytes that did arrive are never taken for a version, and the
    caller's retry fetches the whole body again."""
    return RelayUnreachable(
        "transfer_cut",
        f"the download of {what} was cut off ({unreachable_reason(exc)}: {type(exc).__name__}); "
        "it is downloaded again, whole",
    )
