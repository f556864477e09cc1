""":class:`RelayClient`: one typed method per relay route.

Each method names its route (:data:`toolkit.wire.protocol.ROUTES`), sends a schema and gets a
schema back; retries, errors and the bulk bodies are the layers below (:mod:`.transport`,
:mod:`.params`).
"""

from __future__ import annotations

import hashlib
import urllib.parse

import numpy as np
import requests

from toolkit.client.moe import MoeCalls
from toolkit.client.pipeline import PipelineCalls
from toolkit.errors import MESSAGES, CollabError, ProtocolError, RelayRejected, RelayUrlError
from toolkit.signing import AccessPass, AccessPassHolder, PeerKey, RelayKeyPins, SignedAuth
from toolkit.transfer import SizedBody
from toolkit.wire.auth import BODY_SHA256_HEADER, container_body_sha256, digest_metadata
from toolkit.wire.protocol import (ROUTES, CollabState, DoneRequest, GradientMeta, Heartbeat, JoinRequest,
                                   JoinResponse, LoginRequest, LoginResponse, PlanInfo, RunInfo, ShardLease,
                                   ShardLeaseRequest, ShardReport, ShardReportAck, ShardsReport, StateInfo,
                                   StatusReport, TicketRequest, UploadReceipt)

RELOGIN = {"pass_expired", "pass_wrong_relay", "reauth_required", "forged_pass", "stale_timestamp"}
"""Refusals of a pass refresh that a full login (with the Hugging Face token) fixes."""


class RelayClient(PipelineCalls, MoeCalls):
    """Typed calls to the relay API. ``auth`` (optional) signs requests (see toolkit.signing)."""

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
                    if exc.code not in RELOGIN:
                        raise
            if answer is None:
                answer = self._call("POST", ROUTES["login"], LoginResponse,
                                    LoginRequest(hf_token=hf_token, peer_public_key=peer_key.public_b64))
            return AccessPass.from_login(answer, peer_key=peer_key, relay_url=self.url, pins=pins)

        holder = AccessPassHolder(obtain)
        self.session.auth = SignedAuth(peer_key, holder)
        holder.current()  # a bad token or a user not on the allowlist fails here, with the relay's hint
        return holder

    # --- the run and its progress --------------------------------------------------------------
    def get_run(self) -> RunInfo:
        """What the run trains and how. The first call a peer makes, so a URL that is a relay's
        address plus a path (a dashboard link, ``.../api/run``) says which address to use."""
        try:
            return self._call("GET", ROUTES["run"], RunInfo)
        except (RelayRejected, ProtocolError) as exc:
            base = _origin(self.url)
            if getattr(exc, "status", 200) == 404 or exc.code == "not_a_relay":
                if base != self.url and _is_relay(base, self.timeout):
                    raise RelayUrlError("wrong_path", MESSAGES["wrong_path"][0].format(url=self.url, base=base),
                                        MESSAGES["wrong_path"][1].format(base=base)) from None
            raise

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
        """What the dashboard shows: peers online, recent rounds, leaderboard, configuration."""
        return self._call("GET", ROUTES["status"], StatusReport)

    def get_progress(self) -> CollabState:
        """The collaboration's progress toward the next step, as a heartbeat's answer has it."""
        return self._call("GET", ROUTES["progress"], CollabState)

    def get_state(self) -> StateInfo:
        return self._call("GET", ROUTES["state"], StateInfo)

    # --- membership ----------------------------------------------------------------------------
    def join(self, request: JoinRequest) -> JoinResponse:
        return self._call("POST", ROUTES["join"], JoinResponse, request)

    def heartbeat(self, peer_id: str, hb: Heartbeat) -> CollabState:
        """Report this peer's progress; the answer is the collaboration's."""
        return self._call("POST", ROUTES["heartbeat"].format(peer_id=peer_id), CollabState, hb)

    def leave(self, peer_id: str) -> None:
        """Tell the relay this peer is gone (best effort, short timeouts: it runs on the way out)."""
        self._request("POST", ROUTES["leave"].format(peer_id=peer_id), retry=False, timeout=(3, 5))

    # --- data shards ---------------------------------------------------------------------------
    def lease_shard(self, peer_id: str, request: ShardLeaseRequest) -> ShardLease:
        return self._call("POST", ROUTES["shard_lease"].format(peer_id=peer_id), ShardLease, request)

    def report_shards(self, peer_id: str, report: ShardReport) -> ShardReportAck:
        return self._call("POST", ROUTES["shard_report"].format(peer_id=peer_id), ShardReportAck, report)

    def get_shards(self, source: str | None = None) -> ShardsReport:
        return self._call("GET", ROUTES["shards"], ShardsReport, params={"source": source} if source else None)

    # --- gradients -----------------------------------------------------------------------------
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

    def get_plan(self) -> PlanInfo:
        """Which aggregators own which slices of the parameter vector (empty: the relay alone)."""
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
        """Every slice is uploaded (or failed): the relay counts this peer's gradient in the round."""
        return self._call("POST", ROUTES["done"].format(step=step), UploadReceipt, request,
                          params={"peer_id": peer_id}, retry=False)


def _origin(url: str) -> str:
    """``scheme://host:port`` of ``url``, without its path."""
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def _is_relay(url: str, timeout: tuple[float, float]) -> bool:
    """Whether a relay answers ``GET /api/run`` at ``url`` (one try: only to word an error)."""
    try:
        response = requests.get(url + ROUTES["run"], timeout=timeout)
        return response.status_code == 200 and isinstance(response.json(), dict) and "run_name" in response.json()
    except (requests.RequestException, ValueError, CollabError):
        return False
