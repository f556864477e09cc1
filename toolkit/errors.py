"""Every error a volunteer or organizer can meet, in one place.

Each carries a stable ``code`` (the same string the relay puts in its JSON error body), a human
``message`` and a ``hint`` that says what to do next. They subclass built-ins so generic
``except ValueError`` / ``except ConnectionError`` code keeps working.
"""

from __future__ import annotations


class CollabError(Exception):
    """Base of all collabtrain errors."""

    default_hint = ""

    def __init__(self, code: str, message: str, hint: str = "") -> None:
        self.code = code
        self.message = message
        self.hint = hint or self.default_hint
        super().__init__(f"[{code}] {message}" + (f" -- {self.hint}" if self.hint else ""))

    def _render_traceback_(self) -> list[str]:
        """What IPython/Jupyter shows instead of a traceback: a user error is a message and a fix,
        in the same two lines the notebook's pre-install check prints (:func:`two_lines`)."""
        return two_lines(self.code, self.message, self.hint)


def two_lines(code: str, message: str, hint: str) -> list[str]:
    """How a volunteer sees any error: one line of what happened, one of what to do."""
    return [f"[{code}] {message}"] + ([f"What to do: {hint}"] if hint else [])


HANDLED_BY_PEER = frozenset({"round_closed", "round_closed_partial", "round_lost", "round_timeout", "closing"})
"""Codes of what a running peer recovers from by itself: a round that closed before (or while) its
gradient arrived, or ended without a result. The peer keeps the gradient for the next round where
that can never count it twice and drops it otherwise; the relay's hint for these ("keep the
gradient if its version is still eligible") is the toolkit's own rule, not something a volunteer
can do. So they are logged at debug, never shown (a busy relay closes many rounds this way)."""


def handled_by_peer(exc: BaseException) -> bool:
    return getattr(exc, "code", None) in HANDLED_BY_PEER


def volunteer_line(exc: CollabError) -> str:
    """A problem the peer cannot fix by itself, as the volunteer reads it in the log: what
    happened, then what to do, in one line (no code: that is for the panel and bug reports)."""
    return f"{exc.message}. What to do: {exc.hint}" if exc.hint else exc.message


NOT_A_RELAY_HINT = (
    "Check the relay URL: it is the address the organizer gave you, with http:// or https:// "
    "and the port; opened in a browser, it shows the run's dashboard."
)
CHECK_RELAY_HINT = (
    "Check the relay URL, that the relay is running, and that this notebook has internet access "
    "(Kaggle: Settings -> Internet on)."
)

MESSAGES: dict[str, tuple[str, str]] = {
    "template": (
        "this is the template notebook: it installs nothing",
        "Open the run's notebook from its organizer (they write it with `relay-server notebook "
        "colab|kaggle|tpu|local --url RELAY_URL -o run.ipynb`, which fills in the relay address and the "
        "toolkit's sha256).",
    ),
    "bad_relay_url": ("the relay URL must start with http:// or https://, got {url!r}", NOT_A_RELAY_HINT),
    "relay_unreachable": ("no answer from the relay at {url} ({reason})", CHECK_RELAY_HINT),
    "not_a_relay": (
        "{url} answered HTTP {status} with {kind}, not the relay's JSON: is this a collabtrain relay?",
        NOT_A_RELAY_HINT,
    ),
    "wrong_path": (
        "{url} is not the relay's address: the relay answers at {base}",
        "Use {base} as the relay URL (set RELAY_URL, or ask the organizer for a fresh notebook).",
    ),
    "run_finished": (
        "run {run!r} already finished at step {step}: there is nothing left to contribute",
        "Nothing to do here: ask the organizer for the address of their next run.",
    ),
    "toolkit_mismatch": (
        "the relay at {url} serves a different toolkit than this notebook pins (sha256 "
        "{sha256:.12}...): nothing was installed",
        "Ask the organizer for a fresh notebook; never edit the hash to make it pass: it is what "
        "keeps code you did not agree to out of this notebook.",
    ),
    "install_failed": (
        "pip could not install {what} from {source}: {last}",
        "Check this notebook's internet access (Kaggle: Settings -> Internet on) and run the cell "
        "again; pip's full output is in {log}.",
    ),
}
"""Every message a volunteer can meet before the toolkit is installed, as (what happened, what to
do) ``str.format`` templates. The toolkit raises the shared ones with these same words, and
``relay-server notebook`` writes this table into the notebook's cell (which cannot import the
toolkit it has not installed yet): one text for both, checked by tests/test_install_path.py."""

UNREACHABLE_REASONS = (
    ("Connection refused", "connection refused: nothing listens there"),
    ("Name or service not known", "the host name does not resolve"),
    ("nodename nor servname", "the host name does not resolve"),
    ("Temporary failure in name resolution", "the host name does not resolve"),
    ("IncompleteRead", "its answer was cut off mid-way"),
    ("Connection broken", "its answer was cut off mid-way"),
    ("Connection reset", "connection reset"),
    ("Connection aborted", "connection reset"),
    ("CERTIFICATE_VERIFY_FAILED", "its TLS certificate is not valid"),
    ("timed out", "timed out"),
)
"""(sign in the exception's text, the few words a volunteer reads): urllib3's nested reprs and
urllib's ``URLError`` name classes, not causes."""


def unreachable_reason(exc: BaseException) -> str:
    """A few words for why a connection failed (requests' and urllib's exceptions alike)."""
    text = str(exc)
    for sign, words in UNREACHABLE_REASONS:
        if sign in text:
            return words
    return "timed out" if "Timeout" in type(exc).__name__ else type(exc).__name__


def body_kind(content_type: str) -> str:
    """What a non-relay answer was, in words: "a web page" for HTML, else its media type."""
    return "a web page" if "html" in content_type else (content_type.split(";")[0] or "an unknown body")


def not_a_relay_message(url: str, status: int, content_type: str) -> str:
    """What a peer says when a URL answers, but not as a relay does (a web page, a 404 page)."""
    return MESSAGES["not_a_relay"][0].format(url=url, status=status, kind=body_kind(content_type))


class RelayUrlError(CollabError, ValueError):
    """The relay URL cannot be a relay's address (no scheme)."""

    default_hint = NOT_A_RELAY_HINT


class ProtocolError(CollabError, ValueError):
    """A message or tensor container that does not match the wire protocol."""

    default_hint = "Peer and relay may run different collabtrain versions: upgrade both."


class RelayUnreachable(CollabError, ConnectionError):
    """No answer from the relay after all retries."""

    default_hint = (
        "A relay that is restarting answers again within seconds: a running peer keeps retrying and "
        "goes on by itself. Otherwise: " + CHECK_RELAY_HINT
    )


class RoundLost(RelayUnreachable):
    """A round this peer uploaded to ended without a result (the relay restarted mid-round)."""

    default_hint = "Nothing to do: the gradient is kept for the next round when that cannot double-count it."


class RelayRejected(CollabError):
    """The relay answered with a 4xx/5xx error body; ``status`` is the HTTP status."""

    def __init__(self, code: str, message: str, hint: str = "", status: int = 400) -> None:
        self.status = status
        super().__init__(code, message, hint)


class ModelMismatch(CollabError, ValueError):
    """The local model's parameters do not match the run's parameter layout."""

    default_hint = "Build the model the run describes (GET /api/run shows its layout and factory)."


class RunFinished(CollabError):
    """The run reached its configured number of steps; nothing left to contribute."""

    default_hint = MESSAGES["run_finished"][1]


class DeviceOutOfMemory(CollabError, MemoryError):
    """A micro-batch did not fit in the accelerator's (or the host's) memory."""

    default_hint = (
        "Join again with a smaller batch: toolkit.join(..., batch_size=N) or python -m toolkit.peer "
        "--batch-size N; on a GPU notebook restart the runtime first, so its memory is free."
    )


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation failure: CUDA/MPS raise ``torch.OutOfMemoryError``, the CPU
    allocator and XLA a plain ``RuntimeError`` whose text is the only sign (checked by text, so
    this module needs no torch)."""
    if type(exc).__name__ == "OutOfMemoryError":
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        sign in text for sign in ("can't allocate memory", "out of memory", "RESOURCE_EXHAUSTED")
    )


class PrecisionUnsupported(CollabError, ValueError):
    """The run pins a precision this peer's hardware cannot execute."""

    default_hint = "Ask the organizer to pin fp32 (every device runs it), or join from supported hardware."


class DataConfigError(CollabError, ValueError):
    """The run's dataset description cannot work (bad format, missing column, no shards)."""

    default_hint = "Fix the [dataset] section of the run's config (see toolkit/data/dataset_config.py for its fields)."


class DataSourceError(CollabError, ConnectionError):
    """Shards could not be read (several in a row failed, or remote shards while offline)."""

    default_hint = "Check the notebook's internet access and that the dataset's files exist."


class AuthError(CollabError):
    """A local authentication problem on the peer (no pass, unsignable request, bad relay key)."""

    default_hint = "Log in again (re-run the cell); if it persists, tell the organizer."


class RelaySignatureInvalid(AuthError):
    """A response the peer relies on is unsigned or its signature does not verify."""

    default_hint = (
        "Something between this notebook and the relay altered the answer (a proxy?) or "
        "impersonates the relay. Use the https:// URL the organizer published."
    )


class RelayKeyChanged(AuthError):
    """The relay presented a different public key than the one pinned for its URL (TOFU)."""

    default_hint = (
        "If the organizer announced a new relay key, delete the pin file named above; "
        "otherwise someone may be impersonating the relay: do not continue."
    )


class RelayKeyError(CollabError):
    """The relay key file exists but cannot be used."""

    default_hint = (
        "Restore the file from a backup, or delete it to generate a new key "
        "(every peer then logs in again; pinned notebooks must drop their pin)."
    )
