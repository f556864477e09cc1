""":class:`RelayClient`: one typed method per relay route.

Each method names its route (:data:`toolkit.wire.protocol.ROUTES`), sends a schema and gets a
schema back; retries and errors are its :class:`~toolkit.client.transport.Transport`'s, the bulk
bodies, the expert and the stage routes are the objects it holds (:mod:`.params`, :mod:`.moe`,
:mod:`.pipeline`), each reaching the relay through that same transport.
"""

from __future__ import annotations

import hashlib
import urllib.parse

import numpy as np
import requests

from toolkit.client.moe import MoeCalls
from toolkit.client.params import ParamsTransfer
from toolkit.client.pipeline import PipelineCalls
from toolkit.client.transport import Transport
from toolkit.errors import MESSAGES, CollabError, ProtocolError, RelayRejected, RelayUrlError
from toolkit.signing import AccessPass, AccessPassHolder, PeerKey, RelayKeyPins, SignedAuth
from toolkit.transfer import SizedBody
from toolkit.wire.auth import BODY_SHA256_HEADER, container_body_sha256, digest_metadata
from toolkit.wire.protocol import (
    ROUTES,
    CollabState,
    DoneRequest,
    GradientMeta,
    Heartbeat,
    JoinRequest,
    JoinResponse,
    LoginRequest,
    LoginResponse,
    PlanInfo,
    RunInfo,
    ShardLease,
    ShardLeaseRequest,
    ShardReport,
    ShardReportAck,
    ShardsReport,
    StateInfo,
    StatusReport,
    TicketRequest,
    UploadReceipt,
)

RELOGIN = {"pass_expired", "pass_wrong_relay", "reauth_required", "forged_pass", "stale_timestamp"}
"""Refusals of a pass refresh that a full login (with the Hugging Face token) fixes."""


class RelayClient:
    """Typed calls to the relay API. ``auth`` (optional) signs requests (see toolkit.signing).

    Composed, not inherited: :attr:`transport` (:class:`~toolkit.client.transport.Transport`)
    owns the sessions and the retry policy, and each concern's calls hold a reference to it --
    :attr:`params` (the bulk parameter and slice bodies), :attr:`moe` (the expert routes),
    :attr:`pipeline` (the stage routes). The core routes are methods here; the others are called
    on the object that owns them (``client.params.download_params``, ``client.moe.call``,
    ``client.pipeline.work``), so each signature is written once.
    """

    def __init__(
        self,
        url: str,
        *,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = 120.0,
        retries: int = 4,
        backoff_s: float = 0.5,
        auth: requests.auth.AuthBase | None = None,
        transport: Transport | None = None,
    ) -> None:
        """The settings are the :class:`~toolkit.client.transport.Transport`'s; ``transport``: one
        already built instead (a test rig's that delays every request), whose own settings apply."""
        self.transport = transport or Transport(
            url,
            connect_timeout_s=connect_timeout_s,
            read_timeout_s=read_timeout_s,
            retries=retries,
            backoff_s=backoff_s,
            auth=auth,
        )
        self.params = ParamsTransfer(self.transport)
        self.moe = MoeCalls(self.transport)
        self.pipeline = PipelineCalls(self.transport, self.params)

    # --- the transport's settings, as callers have always read them ----------------------------
    @property
    def url(self) -> str:
        return self.transport.url

    @property
    def timeout(self) -> tuple[float, float]:
        return self.transport.timeout

    @property
    def session(self) -> requests.Session:
        """The relay's session (``session.auth`` is how requests get signed)."""
        return self.transport.session

    @property
    def signed(self) -> bool:
        return self.transport.signed

    def close(self) -> None:
        self.transport.close()

    def login(self, hf_token: str, *, pins: RelayKeyPins | None = None) -> AccessPassHolder:
        """Prove this peer's Hugging Face identity once; from then on every request is signed with a
        fresh in-memory key and the access pass renews itself (through the relay's refresh route,
        falling back to the token when the relay asks for a full login)."""
        peer_key, pins = PeerKey(), pins or RelayKeyPins()

        def obtain(previous: AccessPass | None) -> AccessPass:
            answer = None
            if previous is not None:
                try:
                    answer = self.transport.call("POST", ROUTES["refresh"], LoginResponse, retry=False)
                except RelayRejected as exc:
                    if exc.code not in RELOGIN:
                        raise
            if answer is None:
                answer = self.transport.call(
                    "POST",
                    ROUTES["login"],
                    LoginResponse,
                    LoginRequest(hf_token=hf_token, peer_public_key=peer_key.public_b64),
                )
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
            return self.transport.call("GET", ROUTES["run"], RunInfo)
        except (RelayRejected, ProtocolError) as exc:
            base = _origin(self.url)
            if getattr(exc, "status", 200) == 404 or exc.code == "not_a_relay":
                if base != self.url and _is_relay(base, self.timeout):
                    raise RelayUrlError(
                        "wrong_path",
                        MESSAGES["wrong_path"][0].format(url=self.url, base=base),
                        MESSAGES["wrong_path"][1].format(base=base),
                    ) from None
            raise

    def get_tokenizer(self, expected_sha256: str) -> bytes:
        """The run's ``tokenizer.json``, refused unless its sha256 is the one RunInfo publishes."""
        body = self.transport.request("GET", ROUTES["tokenizer"]).content
        got = hashlib.sha256(body).hexdigest()
        if got != expected_sha256:
            raise ProtocolError(
                "tokenizer_mismatch",
                f"the relay's tokenizer.json has sha256 {got[:12]}..., the run "
                f"publishes {expected_sha256[:12] or '(none)'}...",
                "The relay's tokenizer changed "
                "under the run (or a proxy altered it): ask the organizer, then join again.",
            )
        return body

    def get_status(self) -> StatusReport:
        """What the dashboard shows: peers online, recent rounds, leaderboard, configuration."""
        return self.transport.call("GET", ROUTES["status"], StatusReport)

    def get_progress(self) -> CollabState:
        """The collaboration's progress toward the next step, as a heartbeat's answer has it."""
        return self.transport.call("GET", ROUTES["progress"], CollabState)

    def get_state(self) -> StateInfo:
        return self.transport.call("GET", ROUTES["state"], StateInfo)

    # --- membership ----------------------------------------------------------------------------
    def join(self, request: JoinRequest) -> JoinResponse:
        return self.transport.call("POST", ROUTES["join"], JoinResponse, request)

    def heartbeat(self, peer_id: str, hb: Heartbeat) -> CollabState:
        """Report this peer's progress; the answer is the collaboration's."""
        return self.transport.call("POST", ROUTES["heartbeat"].format(peer_id=peer_id), CollabState, hb)

    def leave(self, peer_id: str) -> None:
        """Tell the relay this peer is gone (best effort, short timeouts: it runs on the way out)."""
        self.transport.request("POST", ROUTES["leave"].format(peer_id=peer_id), retry=False, timeout=(3, 5))

    # --- data shards ---------------------------------------------------------------------------
    def lease_shard(self, peer_id: str, request: ShardLeaseRequest) -> ShardLease:
        return self.transport.call("POST", ROUTES["shard_lease"].format(peer_id=peer_id), ShardLease, request)

    def report_shards(self, peer_id: str, report: ShardReport) -> ShardReportAck:
        return self.transport.call("POST", ROUTES["shard_report"].format(peer_id=peer_id), ShardReportAck, report)

    def get_shards(self, source: str | None = None) -> ShardsReport:
        return self.transport.call(
            "GET", ROUTES["shards"], ShardsReport, params={"source": source} if source else None
        )

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
        response = self.transport.request(
            "PUT",
            ROUTES["gradient"].format(step=meta.step),
            retry=False,
            params={"peer_id": meta.peer_id},
            data=SizedBody(tensors, metadata),
            headers=headers,
        )
        return UploadReceipt.from_json(response.json())

    def get_plan(self) -> PlanInfo:
        """Which aggregators own which slices of the parameter vector (empty: the relay alone)."""
        return self.transport.call("GET", ROUTES["plan"], PlanInfo)

    def request_ticket(self, step: int, peer_id: str, request: TicketRequest) -> str:
        """The relay's permission to upload this gradient's slices (the header value to present)."""
        response = self.transport.request(
            "POST",
            ROUTES["ticket"].format(step=step),
            retry=False,
            params={"peer_id": peer_id},
            data=request.dumps(),
            headers={"Content-Type": "application/json"},
        )
        try:
            return str(response.json()["ticket"])
        except (ValueError, KeyError, TypeError):
            raise ProtocolError("bad_json", "the relay's ticket answer is malformed") from None

    def report_done(self, step: int, peer_id: str, request: DoneRequest) -> UploadReceipt:
        """Every slice is uploaded (or failed): the relay counts this peer's gradient in the round."""
        return self.transport.call(
            "POST", ROUTES["done"].format(step=step), UploadReceipt, request, params={"peer_id": peer_id}, retry=False
        )


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
