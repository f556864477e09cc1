"""Upload tickets: the relay's permission for one peer to upload one gradient to one round.

The relay runs every check a whole-vector upload gets (samples within the last report, version
fresh enough, one upload per round) when it issues the ticket; an aggregator then only verifies
the ticket (HMAC-SHA256 with a key the relay handed it at registration) and that the container
it receives is the one the ticket names (the sha256 of its header, which carries the gradient
metadata and, in signed runs, a digest per data chunk). A leaked ticket therefore carries no
other data, to no other round, after it expires.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import secrets
import time

from relay_server.core.errors import ApiError
from toolkit.errors import ProtocolError
from toolkit.wire.auth import b64u, unb64u
from toolkit.wire.protocol import Ticket

_TAG = b"collabtrain-ticket-v1\n"


def new_ticket_key() -> str:
    return secrets.token_hex(32)


def _message(ticket: Ticket) -> bytes:
    fields = ticket.to_json()
    fields.pop("mac", None)
    return _TAG + json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def sign_ticket(ticket: Ticket, key: str) -> Ticket:
    mac = hmac.new(bytes.fromhex(key), _message(ticket), hashlib.sha256).hexdigest()
    return dataclasses.replace(ticket, mac=mac)


def encode_ticket(ticket: Ticket) -> str:
    """The ticket as one header value (b64u of its JSON)."""
    return b64u(ticket.dumps())


def verify_ticket(header: str | None, key: str, *, now: float | None = None) -> Ticket:
    """Decode the ``X-Collab-Ticket`` header and check its MAC and expiry (401/403 otherwise)."""
    if not header:
        raise ApiError(
            401,
            "missing_ticket",
            "a slice upload needs the relay's ticket",
            "Ask the relay for a ticket first (the toolkit does this by itself).",
        )
    try:
        ticket = Ticket.loads(unb64u(header, "ticket"))
    except (ValueError, ProtocolError):
        raise ApiError(401, "malformed_ticket", "the upload ticket does not decode") from None
    expected = hmac.new(bytes.fromhex(key), _message(ticket), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected, ticket.mac):
        raise ApiError(403, "forged_ticket", "the upload ticket was not issued by this run's relay")
    if ticket.expires_at < (time.time() if now is None else now):
        raise ApiError(
            409,
            "ticket_expired",
            "the upload ticket expired (its round is over)",
            "Keep training; the next round takes the new samples.",
        )
    return ticket
