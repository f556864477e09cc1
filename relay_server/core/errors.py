"""The relay's error answers: an HTTP status plus the JSON body peers turn into typed errors."""

from __future__ import annotations

from toolkit.errors import CollabError


class ApiError(CollabError):
    """Raised by handlers; the error middleware renders ``{"error", "message", "hint"}``."""

    def __init__(self, status: int, code: str, message: str, hint: str = "") -> None:
        self.status = status
        super().__init__(code, message, hint)


def unknown_peer(peer_id: str) -> ApiError:
    return ApiError(
        404,
        "unknown_peer",
        f"peer {peer_id[:16]!r} is not registered (it may have timed out)",
        "Join again: POST /api/peers/join (the toolkit does this by itself).",
    )


def round_closed(step: int, current: int) -> ApiError:
    return ApiError(
        409,
        "round_closed",
        f"round {step} is not accepting gradients (current step {current})",
        "Keep the gradient if its version is still eligible, else download the latest parameters.",
    )


def round_closed_partial(step: int) -> ApiError:
    return ApiError(
        409,
        "round_closed_partial",
        f"round {step} closed while this gradient's slices were "
        "arriving; the slices an owner had accepted whole were counted (the round record says "
        "'partial')",
        "Drop this gradient (part of it is already in the step) and keep training.",
    )
