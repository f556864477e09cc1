"""The staged pipeline's calls (``ROUTES["pipeline_*"]``): one typed method per route.

Work and results are tensor containers (:mod:`toolkit.wire.protocol.pipeline` says which tensors);
a stage's parameters come from its stage's owner on the relay and are checked against the
relay-signed manifest, and its gradient goes up with a ticket through the sliced-round upload
every sliced run uses (:meth:`~toolkit.client.params.ParamsTransfer.upload_slices`).
"""

from __future__ import annotations

import logging

import numpy as np

from toolkit.client.params import DOWNLOAD_ATTEMPTS, ParamsTransfer, cut_transfer
from toolkit.client.transport import NO_ANSWER, Transport
from toolkit.errors import ProtocolError, RelayUnreachable
from toolkit.transfer import BODY_ERRORS, SizedBody, read_checked_params
from toolkit.wire import payloads
from toolkit.wire.auth import BODY_SHA256_HEADER, container_body_sha256, digest_metadata
from toolkit.wire.compression import Codec
from toolkit.wire.protocol import (
    ROUTES,
    ParamsManifest,
    PipelineAck,
    PipelineDone,
    PipelineResult,
    PipelineTicketRequest,
    PipelineWork,
    StageAssignment,
    StageRequest,
    WorkerCredit,
)

log = logging.getLogger(__name__)
MAX_WORK_BYTES = 1 << 31


class PipelineCalls:
    """The pipeline routes over ``transport``; a stage's parameters through ``params`` (a
    :class:`~toolkit.client.RelayClient`'s :attr:`~toolkit.client.RelayClient.pipeline`)."""

    def __init__(self, transport: Transport, params: ParamsTransfer) -> None:
        self.transport, self.params = transport, params

    def stage(self, peer_id: str, request: StageRequest) -> StageAssignment:
        return self.transport.call("POST", ROUTES["pipeline_stage"].format(peer_id=peer_id), StageAssignment, request)

    def work(self, peer_id: str, *, wait_s: int, cached: list[int]) -> tuple[PipelineWork, dict[str, np.ndarray]]:
        params = {"wait": wait_s, "cached": ",".join(map(str, cached[-1024:]))}
        response = self.transport.request(
            "GET",
            ROUTES["pipeline_work"].format(peer_id=peer_id),
            params=params,
            timeout=(self.transport.timeout[0], self.transport.timeout[1] + wait_s),
        )
        metadata, tensors = payloads.decode(response.content, MAX_WORK_BYTES)
        try:
            return PipelineWork.loads(metadata.get("work", "").encode()), tensors
        except ValueError as exc:
            raise ProtocolError("bad_work", f"the relay's work answer is not readable: {exc}") from None

    def result(self, peer_id: str, result: PipelineResult, tensors: dict[str, np.ndarray]) -> PipelineAck:
        items = [(name, np.ascontiguousarray(array)) for name, array in tensors.items()]
        metadata = {"result": result.dumps().decode()}
        headers = {"Content-Type": "application/octet-stream"}
        if self.transport.signed:  # a streamed container: the signature covers its header, the header every chunk
            metadata.update(digest_metadata(items))
            headers[BODY_SHA256_HEADER] = container_body_sha256(items, metadata)
        route = ROUTES["pipeline_result"].format(peer_id=peer_id, task_id=result.task_id)
        response = self.transport.request("PUT", route, data=SizedBody(items, metadata), headers=headers)
        return PipelineAck.from_json(response.json())

    def ticket(self, peer_id: str, step: int, request: PipelineTicketRequest) -> str:
        """The relay-signed ticket (its wire form) for this stage's upload in round ``step``."""
        response = self.transport.request(
            "POST",
            ROUTES["pipeline_ticket"].format(peer_id=peer_id, step=step),
            data=request.dumps(),
            headers={"Content-Type": "application/json"},
            retry=False,
        )
        try:
            return str(response.json()["ticket"])
        except (ValueError, KeyError, TypeError):
            raise ProtocolError("bad_json", "the relay's ticket answer is malformed") from None

    def done(self, peer_id: str, step: int, done: PipelineDone) -> None:
        self.transport.request(
            "POST",
            ROUTES["pipeline_done"].format(peer_id=peer_id, step=step),
            data=done.dumps(),
            headers={"Content-Type": "application/json"},
        )

    def credit(self, peer_id: str) -> WorkerCredit:
        """The tasks and samples the relay credited this worker with (asked once, as it leaves)."""
        return self.transport.call("GET", ROUTES["pipeline_credit"].format(peer_id=peer_id), WorkerCredit, retry=False)

    def download_stage(
        self,
        peer_id: str,
        start: int,
        end: int,
        out: np.ndarray,
        *,
        min_step: int,
        have: int | None = None,
        codec: Codec | None = None,
        wait_s: int = 30,
    ) -> int:
        """Stage ``[start, end)`` of version >= ``min_step`` into ``out``; its step.

        A download cut off mid-way (``transfer_cut``: the relay killed or restarted while it
        streamed) is fetched again, whole, after the transport's backoff, as a trainer's
        parameters are (:data:`~toolkit.client.params.DOWNLOAD_ATTEMPTS` tries); after the last,
        or when the relay does not answer at all, it is :class:`~toolkit.errors.RelayUnreachable`,
        which the worker's loop waits out (:meth:`toolkit.run_membership.Membership.recover`)."""
        for attempt in range(DOWNLOAD_ATTEMPTS):
            try:
                return self._download_stage_once(peer_id, start, end, out, min_step, have, codec, wait_s)
            except RelayUnreachable as exc:
                if exc.code != "transfer_cut" or attempt + 1 == DOWNLOAD_ATTEMPTS:
                    raise  # no answer at all: the transport retried already, the worker's loop waits it out
                log.info("stage download failed (%s); downloading it again", exc.message)
                have = None  # ``out`` may be half-written: only a whole stage restores it
                self.transport.backoff(attempt, exc.code)
        raise AssertionError("unreachable")

    def download_stage_at(self, peer_id: str, start: int, end: int, out: np.ndarray, *, step: int) -> None:
        """Stage ``[start, end)`` of exactly version ``step`` into ``out`` (delayed parameter
        updates: a batch computes on the version before the latest, which the relay keeps serving
        while a batch in flight uses it; ``version_gone`` once none does). Checked against the
        ``X-Collab-Sha256`` the relay signed; a cut transfer is fetched again as
        :meth:`download_stage` does."""
        for attempt in range(DOWNLOAD_ATTEMPTS):
            try:
                with self.transport.request(
                    "GET",
                    ROUTES["params"],
                    params={"start": start, "end": end, "step": step, "peer_id": peer_id},
                    stream=True,
                ) as response:
                    got = read_checked_params(response.raw, response.headers, out, None, None)
                if got != step:
                    raise ProtocolError("slice_version", f"stage [{start}, {end}) came at step {got}, not {step}")
                return
            except (*NO_ANSWER, *BODY_ERRORS) as exc:  # cut mid-body: ``out`` may be half-written
                error = cut_transfer(f"stage [{start}, {end}) of version {step}", exc)
            if attempt + 1 == DOWNLOAD_ATTEMPTS:
                raise error
            log.info("stage download failed (%s); downloading it again", error.message)
            self.transport.backoff(attempt, error.code)

    def _download_stage_once(
        self,
        peer_id: str,
        start: int,
        end: int,
        out: np.ndarray,
        min_step: int,
        have: int | None,
        codec: Codec | None,
        wait_s: int,
    ) -> int:
        connect_s, read_s = self.transport.timeout
        try:
            with self.transport.request(
                "GET",
                ROUTES["params"],
                params={"min_step": min_step, "peer_id": peer_id, "wait": wait_s},
                stream=True,
                timeout=(connect_s, read_s + wait_s),
            ) as response:
                if response.status_code == 204:
                    raise ProtocolError("no_version", f"no version >= {min_step} was published in {wait_s} s")
                manifest: ParamsManifest = self.params.manifest(response)
        except NO_ANSWER as exc:  # the manifest's body cut off (reading it is the caller's, not the transport's)
            raise cut_transfer("the stage manifest", exc) from None
        s = next((s for s in manifest.slices if (s.start, s.end) == (start, end)), None)
        if s is None:
            raise ProtocolError(
                "wrong_slice",
                f"the relay's manifest has no stage [{start}, {end})",
                "Ask for a stage again: the relay's stages changed.",
            )
        self.params.download_slice(s, manifest.step, out, have, codec, peer_id, view=out)
        return manifest.step
