"""Moderation: the organizer's API (ban, contributions, rollback) and its ``relay-server admin`` CLI.

Authenticated by the relay's **admin token**, never by a peer's pass: a volunteer's account,
however allowlisted, cannot moderate. The token is 32 random bytes generated once into
``<data_dir>/admin_token`` (mode 0600, like the relay key); every request under ``/api/admin/``
must carry ``Authorization: Bearer <token>``, in every auth mode (open runs too). The check runs
before peer authentication and rate limits, which admin requests then skip: an organizer must be
able to ban a flooding user while the flood is on.

Routes (JSON in and out; errors are the usual ``{"error", "message", "hint"}``):

* ``GET /api/admin/bans``; ``POST /api/admin/bans`` ``{"username", "reason"}``;
  ``DELETE /api/admin/bans/{username}``. A ban is immediate: the relay checks bans on every
  signed request and login, and the user's peers leave the registry and the open round at once.
  An upload still in flight counts for nothing (uploads commit whole, at their last chunk). One
  that already committed to the open round is taken out with ``centered_clip`` (its stored chunks
  are dropped; the round record says ``banned_removed``) and stays with the mean (the record says
  ``banned_kept``, and the answer's ``contributions_kept`` and hint say to roll back if it did harm).
* ``GET /api/admin/contributions``: per Hugging Face username, the leaderboard's data plus peers,
  bans and how often CenteredClip clipped them.
* ``GET /api/admin/checkpoints``; ``POST /api/admin/rollback`` ``{"to_step"}``: publish a stored
  version's parameters and optimizer state as the next version (see ``Collaboration.rollback``).
* ``GET /api/admin/params/egress``: the parameter bytes the relay sent itself, and per body URL
  (:mod:`relay_server.api.params_cache` answers it; on signed runs those URLs are capabilities).
"""

from __future__ import annotations

import argparse
import hmac
import json
import logging
import os
import secrets
import stat
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from relay_server.core.config import RelayConfig
from relay_server.core.errors import ApiError
from toolkit.wire.auth import USERNAME_RE
from toolkit.wire.protocol import ROUTES
from toolkit.wire.schema import Schema, limits

if TYPE_CHECKING:
    from relay_server.collaboration.machine import Collaboration

log = logging.getLogger(__name__)

ADMIN_PREFIX = "/api/admin"
TOKEN_FILE = "admin_token"
DEFAULT_URL = "http://127.0.0.1:8750"
_MAX_BODY = 4096
_HINT = (
    "Send 'Authorization: Bearer <token>' with the token from <data_dir>/admin_token "
    "(relay-server admin --data-dir DIR ... does this)."
)


# --- the token ----------------------------------------------------------------------------------
class AdminToken:
    """The organizer's secret. Compared in constant time; never logged, never in a repr."""

    def __init__(self, secret: str) -> None:
        self._secret = secret.encode("ascii")

    @classmethod
    def load_or_create(cls, path: str | Path) -> "AdminToken":
        """Read ``path``, creating it (0600, atomically) with a fresh token on first start."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            _create_secret_file(path, secrets.token_urlsafe(32))
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            log.warning("admin token %s was readable by others (mode %o); restricting it to 0600", path, mode)
            os.chmod(path, 0o600)
        return cls(read_token(path))

    def check(self, authorization: str | None) -> None:
        """Raise 401 unless ``authorization`` is exactly ``Bearer <token>``."""
        scheme, _, given = (authorization or "").partition(" ")
        if scheme != "Bearer" or not given:
            raise ApiError(401, "admin_auth_required", "admin routes need the relay's admin token", _HINT)
        if not hmac.compare_digest(given.strip().encode("utf-8", "surrogatepass"), self._secret):
            raise ApiError(401, "bad_admin_token", "the admin token does not match this relay's", _HINT)

    def __repr__(self) -> str:
        return "AdminToken(<secret>)"


def read_token(path: str | Path) -> str:
    token = Path(path).read_text().strip()
    if not token or not token.isascii() or any(c.isspace() for c in token):
        raise ValueError(f"{path} does not hold an admin token (delete it to generate a new one)")
    return token


def _create_secret_file(path: Path, secret: str) -> None:
    """0600 temp file, then ``link``: never readable by others, never half-written, and a
    concurrent start that made the file first wins."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secret + "\n")
        try:
            os.link(tmp, path)
            log.warning("generated the admin token in %s: it controls bans and rollbacks, keep it private", path)
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)


def token_path(config: RelayConfig) -> Path:
    return Path(config.admin.token_file) if config.admin.token_file else Path(config.server.data_dir) / TOKEN_FILE


# --- request bodies -----------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class BanRequest(Schema):
    username: str = field(metadata=limits(max_len=96))
    reason: str = field(default="", metadata=limits(max_len=500))


@dataclass(frozen=True, kw_only=True)
class RollbackRequest(Schema):
    to_step: int = field(metadata=limits(ge=0, le=10**12))


async def _read(request: web.Request, schema: type[Schema]) -> Any:
    if request.content_length is not None and request.content_length > _MAX_BODY:
        raise ApiError(413, "body_too_large", f"admin bodies are limited to {_MAX_BODY} bytes")
    return schema.loads(await request.read())  # bounded by the app's client_max_size


def _username(raw: str) -> str:
    if not USERNAME_RE.fullmatch(raw):
        raise ApiError(
            400,
            "bad_username",
            f"{raw[:40]!r} is not a Hugging Face username",
            "Use the username exactly as the leaderboard shows it.",
        )
    return raw


# --- the operations -----------------------------------------------------------------------------
def _committed_outcome(collab: "Collaboration", peer_id: str) -> str | None:
    """What a ban does to ``peer_id``'s gradient already committed to the open round, written into
    the round's record: "banned_removed" in robust mode on the relay's own vector (the reducer
    dropped its stored chunks, so its samples leave the round too), else "banned_kept" (the mean
    cannot take a committed sum back). None when it had committed nothing."""
    r = collab.rounds.round
    if r is None or r.closed or peer_id not in r.received:
        return None
    if collab.reducer.robust_config is not None and not r.slices:
        del r.received[peer_id]
        r.outcomes[peer_id] = "banned_removed"
    else:
        r.outcomes[peer_id] = "banned_kept"
    return r.outcomes[peer_id]


class Moderation:
    """What the admin routes do, on the running collaboration (``collab()`` is read per call:
    the collaboration is created by the app's lifespan, after the routes)."""

    def __init__(self, collab: Callable[[], "Collaboration"]) -> None:
        self.collab = collab

    async def ban(self, username: str, reason: str) -> dict[str, Any]:
        collab = self.collab()
        collab.store.ban(username, reason)
        gone = [
            p.peer_id for p in list(collab.registry.peers.values()) if p.username.casefold() == username.casefold()
        ]
        kept: list[str] = []
        removed: list[str] = []
        for peer_id in gone:
            await collab.reducer.run(collab.reducer.exclude, peer_id)  # before any finalize the leave may start
            outcome = _committed_outcome(collab, peer_id)
            (kept if outcome == "banned_kept" else removed if outcome else []).append(peer_id)
            collab.leave(peer_id)
        log.warning(
            "banned %s: %d peer(s) dropped, %d committed contribution(s) kept, %d removed",
            username,
            len(gone),
            len(kept),
            len(removed),
        )
        answer: dict[str, Any] = {
            "banned": username,
            "peers_dropped": len(gone),
            "contributions_kept": len(kept),
            "contributions_removed": len(removed),
        }
        if kept:
            answer["hint"] = (
                f"{len(kept)} gradient(s) of {username} were already counted in round {collab.step} "
                "and the mean keeps them: if they did harm, roll back after this step "
                "(relay-server admin rollback STEP), or run with rounds.aggregation = 'centered_clip'."
            )
        if collab.config.auth.mode == "open":
            answer["warning"] = "auth.mode is 'open': peers have no verified username, so no ban can apply to them"
        return answer

    def unban(self, username: str) -> dict[str, Any]:
        store = self.collab().store
        was = store.is_banned(username)
        store.unban(username)
        log.warning("unbanned %s", username)
        return {"unbanned": username, "was_banned": was}

    def bans(self) -> dict[str, Any]:
        return {"bans": [{"username": u, "reason": r, "banned_at": t} for u, r, t in self.collab().store.bans()]}

    def contributions(self) -> dict[str, Any]:
        collab = self.collab()
        online = Counter(p.username.casefold() for p in collab.registry.peers.values())
        clipped: Counter[str] = Counter()
        for peer_id, rounds in collab.reducer.clipped_rounds.items():
            known = collab.store.known_peer(peer_id)
            if known is not None:
                clipped[known[1].casefold()] += rounds
        users = [
            {
                "username": u,
                "samples": int(n or 0),
                "rounds": int(r or 0),
                "peers": int(p),
                "peers_online": online[u.casefold()],
                "banned": collab.store.is_banned(u),
                "clipped_rounds": clipped[u.casefold()],
                "last_joined": joined,
            }
            for u, n, r, p, joined in collab.store.user_contributions()
        ]
        return {"step": collab.step, "aggregation": collab.config.rounds.aggregation, "users": users}

    def checkpoints(self) -> dict[str, Any]:
        collab = self.collab()
        stored = []
        for path in sorted(collab.store.state_path(0).parent.glob("step-*.safetensors")):
            info = path.stat()
            stored.append({"step": int(path.stem.split("-", 1)[1]), "bytes": info.st_size, "saved_at": info.st_mtime})
        return {"step": collab.step, "checkpoints": stored}

    async def rollback(self, to_step: int) -> dict[str, Any]:
        new_step = await self.collab().rollback(to_step)
        return {"rolled_back_to": to_step, "step": new_step}

    # --- HTTP -------------------------------------------------------------------------------------
    async def handle_list_bans(self, request: web.Request) -> web.Response:
        return web.json_response(self.bans())

    async def handle_ban(self, request: web.Request) -> web.Response:
        body = await _read(request, BanRequest)
        return web.json_response(await self.ban(_username(body.username), body.reason))

    async def handle_unban(self, request: web.Request) -> web.Response:
        return web.json_response(self.unban(_username(request.match_info["username"])))

    async def handle_contributions(self, request: web.Request) -> web.Response:
        return web.json_response(self.contributions())

    async def handle_checkpoints(self, request: web.Request) -> web.Response:
        return web.json_response(self.checkpoints())

    async def handle_rollback(self, request: web.Request) -> web.Response:
        body = await _read(request, RollbackRequest)
        return web.json_response(await self.rollback(body.to_step))

    def routes(self) -> list[tuple[str, str, Handler]]:
        return [
            ("GET", f"{ADMIN_PREFIX}/bans", self.handle_list_bans),
            ("POST", f"{ADMIN_PREFIX}/bans", self.handle_ban),
            ("DELETE", ADMIN_PREFIX + "/bans/{username}", self.handle_unban),
            ("GET", f"{ADMIN_PREFIX}/contributions", self.handle_contributions),
            ("GET", f"{ADMIN_PREFIX}/checkpoints", self.handle_checkpoints),
            ("POST", f"{ADMIN_PREFIX}/rollback", self.handle_rollback),
        ]


def is_admin_route(request: web.Request) -> bool:
    resource = request.match_info.route.resource
    return resource is not None and (
        resource.canonical == ADMIN_PREFIX or resource.canonical.startswith(ADMIN_PREFIX + "/")
    )


def admin_middleware(token: AdminToken) -> Middleware:
    """Every route under /api/admin needs the admin token, and then goes straight to its handler
    (past peer authentication and rate limits, which sit further down the chain)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not is_admin_route(request):
            return await handler(request)
        token.check(request.headers.get("Authorization"))
        return await request.match_info.handler(request)

    return middleware


def build_admin(
    config: RelayConfig, collab: Callable[[], "Collaboration"]
) -> tuple[list[Middleware], list[tuple[str, str, Handler]]]:
    """The admin middleware (install before authentication) and routes."""
    path = token_path(config)
    token = AdminToken.load_or_create(path)
    log.info("admin API enabled under %s (token in %s)", ADMIN_PREFIX, path)
    return [admin_middleware(token)], Moderation(collab).routes()


# --- the CLI ------------------------------------------------------------------------------------
def add_admin_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``relay-server admin ...``: talks to a running relay's admin API."""
    admin = sub.add_parser(
        "admin",
        help="moderate a running relay (ban, contributions, rollback)",
        description="Moderate a running relay through its admin API.",
    )
    admin.add_argument("--url", default=DEFAULT_URL, help=f"the relay's URL (default {DEFAULT_URL})")
    where = admin.add_mutually_exclusive_group(required=True)  # never a silent guess at ./relay-data
    where.add_argument(
        "--config",
        help="the relay's configuration file (reads the admin token where the relay "
        "keeps it: admin.token_file, else server.data_dir/admin_token)",
    )
    where.add_argument("--data-dir", help="the relay's data directory (reads DATA_DIR/admin_token)")
    where.add_argument("--token-file", help="file holding the admin token")
    admin.add_argument("--json", action="store_true", help="print the relay's JSON answer")
    admin.add_argument("--verbose", "-v", action="store_true", help="log debug details")
    actions = admin.add_subparsers(dest="action", required=True)
    ban = actions.add_parser("ban", help="ban a Hugging Face user now (their peers are dropped)")
    ban.add_argument("username", help="the Hugging Face username")
    ban.add_argument("--reason", required=True, help="kept with the ban, shown by 'bans'")
    actions.add_parser("unban", help="lift a ban").add_argument("username", help="the Hugging Face username")
    actions.add_parser("bans", help="list bans")
    actions.add_parser("contributions", help="samples and rounds per Hugging Face username")
    actions.add_parser("checkpoints", help="stored versions a rollback can return to")
    actions.add_parser("rollback", help="publish stored step STEP as the next version").add_argument(
        "step", type=int, help="a stored step (see 'checkpoints')"
    )
    actions.add_parser("egress", help="parameter bytes the relay sent itself (what an HTTP cache in front saves)")


def run_admin(args: argparse.Namespace) -> int:
    if args.config:
        from relay_server.core.config import load_config

        where = token_path(load_config(args.config))
    else:
        where = Path(args.token_file) if args.token_file else Path(args.data_dir) / TOKEN_FILE
    try:
        token = read_token(where)
    except (OSError, ValueError) as exc:
        print(
            f"relay-server admin: no admin token in {where} ({exc.strerror if isinstance(exc, OSError) else exc}); "
            "the relay writes it on its first start: pass the --config or --data-dir it runs with, or "
            "--token-file with a copy",
            file=sys.stderr,
        )
        return 2
    method, path, body = {
        "ban": ("POST", "/bans", {"username": getattr(args, "username", ""), "reason": getattr(args, "reason", "")}),
        "unban": ("DELETE", f"/bans/{getattr(args, 'username', '')}", None),
        "bans": ("GET", "/bans", None),
        "contributions": ("GET", "/contributions", None),
        "checkpoints": ("GET", "/checkpoints", None),
        "rollback": ("POST", "/rollback", {"to_step": getattr(args, "step", 0)}),
        "egress": ("GET", ROUTES["params_egress"].removeprefix(ADMIN_PREFIX), None),
    }[args.action]
    import requests  # the relay itself never needs it

    try:
        response = requests.request(
            method,
            args.url.rstrip("/") + ADMIN_PREFIX + path,
            json=body,
            timeout=60,
            headers={"Authorization": f"Bearer {token}"},
        )
    except requests.RequestException as exc:
        print(f"relay-server admin: cannot reach {args.url} ({type(exc).__name__})", file=sys.stderr)
        return 1
    try:
        answer = response.json()
    except ValueError:
        answer = {"error": f"http_{response.status_code}", "message": response.text[:200], "hint": ""}
    if response.status_code >= 400:
        hint = f"\n  hint: {answer.get('hint')}" if answer.get("hint") else ""
        print(f"relay-server admin: [{answer.get('error')}] {answer.get('message')}{hint}", file=sys.stderr)
        return 1
    print(json.dumps(answer, indent=1) if args.json else _render(args.action, answer))
    return 0


def _render(action: str, answer: dict[str, Any]) -> str:
    """A short human summary of an admin answer."""
    if action == "bans":
        rows = [
            f"{b['username']:<24} {time.strftime('%Y-%m-%d %H:%M', time.localtime(b['banned_at']))}  {b['reason']}"
            for b in answer["bans"]
        ]
        return "\n".join(rows) or "no bans"
    if action == "contributions":
        head = (
            f"step {answer['step']} ({answer['aggregation']})\n{'username':<24} {'samples':>10} {'rounds':>7} "
            f"{'peers':>5} {'online':>6} {'clipped':>7}"
        )
        rows = [
            f"{u['username']:<24} {u['samples']:>10} {u['rounds']:>7} {u['peers']:>5} {u['peers_online']:>6} "
            f"{u['clipped_rounds']:>7}" + ("  BANNED" if u["banned"] else "")
            for u in answer["users"]
        ]
        return "\n".join([head, *rows])
    if action == "checkpoints":
        rows = [
            f"step {c['step']:>8}  {c['bytes'] / 1e6:9.1f} MB  "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(c['saved_at']))}"
            for c in answer["checkpoints"]
        ]
        return "\n".join([f"current step {answer['step']}", *rows])
    if action == "egress":
        return (
            f"bodies {answer['direct']} B to peers, {answer['immutable']} B to the cache "
            f"({answer['immutable_requests']} request(s)); {answer['refs']} refs, {answer['ref_bytes']} B"
        )
    if action == "rollback":
        return f"rolled back to the state of step {answer['rolled_back_to']}, published as step {answer['step']}"
    if action == "ban":
        return (
            f"banned {answer['banned']} ({answer['peers_dropped']} peer(s) dropped)"
            + (f"\nwarning: {answer['warning']}" if answer.get("warning") else "")
            + (f"\nhint: {answer['hint']}" if answer.get("hint") else "")
        )
    return f"unbanned {answer['unbanned']}" + ("" if answer["was_banned"] else " (was not banned)")
