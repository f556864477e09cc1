"""A peer's gradient for the open round: the checks it must pass, and what counting it does.

Why apart from :mod:`.machine`: the collaboration admits peers and wires the parts together; this
admits their *contributions*, by the same rules whichever way they arrive: a whole vector streamed
into the relay's reducer (:meth:`GradientIntake.receive`), or a sliced round's ticket
(:meth:`GradientIntake.ticket`, the same checks before any byte moves) and the peer's word that
its slices reached their owners (:meth:`GradientIntake.done`). One gradient per peer and round; it
may lag the master by ``run.max_staleness`` versions and may claim no more samples than the
peer's progress reports since its last upload; it counts whole or not at all, at the reducer's
commit point (or on ``done``), and only then are the peer's samples, inner steps and
contribution credited. It holds no state of its own: the round in flight is
:class:`~relay_server.collaboration.round_cycle.RoundCycle`'s (its tickets, who is uploading, who
delivered), a peer's counts are the registry's :class:`~relay_server.rounds.peer_registry.Peer`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from relay_server.backbone.backbone import Backbone
from relay_server.backbone.slice_owner import gradient_meta
from relay_server.backbone.tickets import sign_ticket
from relay_server.collaboration.round_cycle import RoundCycle
from relay_server.core.errors import ApiError, round_closed, round_closed_partial
from relay_server.rounds.membership import Round, RoundClosedMidUpload
from relay_server.rounds.peer_registry import Peer, Registry
from relay_server.rounds.reducer import UploadProgress
from relay_server.rounds.traffic import Traffic
from toolkit.wire.protocol import DoneRequest, Ticket, TicketRequest, UploadReceipt
from toolkit.wire.tensor_container import AsyncContainerReader


class GradientIntake:
    def __init__(
        self,
        *,
        max_staleness: int,
        rounds: RoundCycle,
        registry: Registry,
        backbone: Backbone,
        traffic: Traffic,
        admit: Callable[[str], Peer],
    ) -> None:
        """``admit``: the live peer of an id (:meth:`Collaboration.peer
        <relay_server.collaboration.machine.Collaboration.peer>`: re-admits one known before a
        restart, refuses an unknown one). ``traffic``: where an accepted upload's bytes count."""
        self.max_staleness = max_staleness
        self.rounds, self.registry, self.backbone, self.traffic = rounds, registry, backbone, traffic
        self.admit = admit

    # --- whole-vector uploads -----------------------------------------------------------------
    async def receive(self, step: int, peer_id: str, reader: AsyncContainerReader) -> UploadReceipt:
        """Stream one peer's gradient sum into the round's reduction, chunk by chunk."""
        started = time.monotonic()
        peer = self.admit(peer_id)
        r = self.rounds.round
        if r is None or r.closed or r.step != step:
            raise round_closed(step, self.rounds.step)
        if r.slices:
            raise ApiError(
                409,
                "ticket_required",
                f"round {step} is sliced among aggregators",
                "Ask for a ticket and upload each slice to its owner (the toolkit does this).",
            )
        _check_not_sent(r, peer_id)
        header = await reader.read_header()
        meta = gradient_meta(header.metadata)
        self.rounds.reducer.check(header)
        if meta.peer_id != peer_id or meta.step != step:
            raise ApiError(422, "bad_meta", "gradient metadata names another peer or round")
        self._check_contribution(step, peer, meta.version, meta.samples, "upload claims")
        was_expected = r.begin(peer_id)
        # credited at the reducer's commit point (whole or nothing), never after the add
        progress = UploadProgress(on_commit=lambda: self._credit(r, peer, meta.samples, meta.loss_sum))
        peer.inflight += 1
        try:
            await self.rounds.reducer.reduce(reader, header, meta.samples, lambda: not r.closed, progress, peer_id)
        except BaseException as exc:
            reduced = progress.chunks_added > 0
            if not progress.committed:  # one that failed mid-body is not waited for (a retry re-joins via begin)
                r.abort(peer_id, reduced=reduced, was_expected=was_expected and not progress.chunks_staged)
            if isinstance(exc, RoundClosedMidUpload):
                raise (round_closed_partial(step) if reduced else round_closed(step, self.rounds.step)) from None
            raise
        else:
            self.traffic.up_bytes += header.header_bytes + header.data_bytes  # accepted whole: it counts
            self.backbone.planning.record_transfer(
                peer_id, "up", step, header.header_bytes + header.data_bytes, started
            )
        finally:
            peer.inflight -= 1
            self.registry.touch(peer)
            self.rounds.maybe_finalize()
        return UploadReceipt(step=step, accepted_samples=meta.samples, received_peers=len(r.received))

    def _check_contribution(self, step: int, peer: Peer, version: int, samples: int, claim: str) -> None:
        """A gradient (whole or sliced) may lag the master by ``max_staleness`` versions and may
        not claim more samples than the peer's progress reports since its last upload."""
        if not 0 <= step - version <= self.max_staleness:
            raise ApiError(
                409,
                "stale_gradient",
                f"gradient from version {version} is too old for round {step}",
                "Discard it and download the latest parameters.",
            )
        if samples > peer.claimable:
            raise ApiError(
                422,
                "samples_exceed_report",
                f"{claim} {samples} samples, progress reports since the last upload said {peer.claimable}",
                "Send a heartbeat before uploading.",
            )

    def _credit(self, r: Round, peer: Peer, samples: int, loss_sum: float) -> None:
        r.complete(peer.peer_id, samples, loss_sum)
        r.inner_steps += peer.held_steps[1]  # local SGD: the inner steps behind this pseudo-gradient
        peer.held_steps = (-1, 0)
        self.registry.set_samples(peer, max(0, peer.samples - samples))
        peer.contributed += samples
        peer.claimable = max(0, peer.claimable - samples)
        if peer.first_contribution_s is None:
            peer.first_contribution_s = time.monotonic() - peer.joined_at

    # --- sliced rounds: ticket, uploads to the owners, done -------------------------------------
    def ticket(self, step: int, peer_id: str, req: TicketRequest) -> Ticket:
        """The checks a whole-vector upload gets, then a signed permission to upload the slices."""
        peer = self.admit(peer_id)
        r = self.rounds.round
        if r is None or r.closed or r.step != step or r.round_id != req.round_id:
            raise round_closed(step, self.rounds.step)
        if not r.slices:
            raise ApiError(
                409,
                "no_ticket_needed",
                f"round {step} is not sliced",
                "Upload the whole gradient to the relay (ROUTES['gradient']).",
            )
        _check_not_sent(r, peer_id)
        self._check_contribution(step, peer, req.version, req.samples, "the ticket asks for")
        if [(d.start, d.end) for d in req.slices] != [(s.start, s.end) for s in r.slices]:
            raise ApiError(
                422,
                "bad_slices",
                "the ticket request does not list this round's slices",
                "Split the gradient by the round's slices (RoundInfo.slices).",
            )
        r.tickets[peer_id] = (req.samples, req.loss_sum, r.begin(peer_id))
        expires = time.time() + r.remaining_s + 30.0
        return sign_ticket(
            Ticket(
                round_id=r.round_id,
                step=step,
                peer_id=peer_id,
                samples=req.samples,
                version=req.version,
                plan_version=r.plan_version,
                expires_at=expires,
                slices=list(req.slices),
            ),
            self.backbone.ticket_key,
        )

    def done(self, step: int, peer_id: str, req: DoneRequest) -> UploadReceipt:
        """The peer finished uploading its slices. Delivering any slice counts the peer in (the
        owners reduced part-wise); delivering none releases it, as a refused upload would."""
        peer = self.admit(peer_id)
        r = self.rounds.round
        if r is None or r.round_id != req.round_id or r.step != step or peer_id not in r.tickets:
            raise round_closed(step, self.rounds.step)
        if r.closed:
            raise round_closed_partial(step) if req.delivered or req.partial else round_closed(step, self.rounds.step)
        samples, loss_sum, was_expected = r.tickets.pop(peer_id)
        if peer_id in r.uploading:
            if req.delivered:
                self._credit(r, peer, samples, loss_sum)
            else:
                r.abort(peer_id, reduced=req.partial, was_expected=was_expected)
        self.registry.touch(peer)
        self.rounds.maybe_finalize()
        return UploadReceipt(
            step=step, accepted_samples=samples if req.delivered else 0, received_peers=len(r.received)
        )


def _check_not_sent(r: Round, peer_id: str) -> None:
    if peer_id in r.received or peer_id in r.uploading or peer_id in r.partial:
        raise ApiError(
            409,
            "duplicate_upload",
            f"peer already sent a gradient for round {r.step}",
            "Keep accumulating; the next round takes the new samples.",
        )
