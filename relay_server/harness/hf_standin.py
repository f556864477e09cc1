"""A small local stand-in for the Hugging Face Hub HTTP API, for tests and benchmarks.

A real HTTP server (``http.server`` in a daemon thread) on 127.0.0.1 and a free port, so the
real ``huggingface_hub`` client code runs end to end. It answers ``GET /api/whoami-v2`` like the
Hub: ``Authorization: Bearer <token>`` -> the user's JSON (type, name, orgs[], auth.accessToken),
an unknown or missing token -> 401. Other tests add routes (``hub.add_route``), e.g. the
checkpoint upload endpoints; the newest route matching a request wins, so a test can also
override whoami (a 429, a hang).

A test takes the ``hf_standin`` fixture (``tests/hf_standin.py``), which starts one and scopes
the environment for ``huggingface_hub`` to that test; code under test should still pass
``hub.url`` explicitly as its endpoint.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit


@dataclass
class StandinRequest:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]  # lower-case names
    body: bytes
    match: re.Match[str]

    @property
    def token(self) -> str | None:
        auth = self.headers.get("authorization", "")
        return auth[len("Bearer ") :] if auth.startswith("Bearer ") else None


@dataclass
class StandinResponse:
    status: int = 200
    body: Any = b""  # bytes, or anything JSON-serialisable
    headers: dict[str, str] = field(default_factory=dict)


Handler = Callable[[StandinRequest], StandinResponse]


@dataclass
class HfUser:
    name: str
    orgs: tuple[str, ...] = ()
    role: str = "read"  # the token's role: "read", "write" or "fineGrained"
    kind: str = "user"  # "user", or "org" for an organization token

    def whoami(self) -> dict[str, Any]:
        """The whoami-v2 shape (huggingface.js ApiWhoAmIUser), with fake personal fields."""
        return {
            "type": self.kind,
            "id": f"id-{self.name}",
            "name": self.name,
            "fullname": self.name.title(),
            "email": f"{self.name}@example.invalid",
            "emailVerified": True,
            "canPay": False,
            "isPro": False,
            "periodEnd": None,
            "avatarUrl": "",
            "orgs": [
                {"type": "org", "id": f"id-{o}", "name": o, "fullname": o, "roleInOrg": "read"} for o in self.orgs
            ],
            "auth": {"type": "access_token", "accessToken": {"displayName": "test", "role": self.role}},
        }


class HfStandin:
    """The server. ``calls`` records (method, path, had_token) for assertions; tokens are not kept."""

    def __init__(self) -> None:
        self.users: dict[str, HfUser] = {}
        self.calls: list[tuple[str, str, bool]] = []
        self._routes: list[tuple[str, re.Pattern[str], Handler]] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self.add_route("GET", r"/api/whoami-v2", self._whoami)

    # --- configuration ---------------------------------------------------------------------------
    def add_user(
        self, token: str, name: str, *, orgs: tuple[str, ...] = (), role: str = "read", kind: str = "user"
    ) -> HfUser:
        user = HfUser(name, tuple(orgs), role, kind)
        self.users[token] = user
        return user

    def add_route(self, method: str, pattern: str, handler: Handler) -> None:
        """Answer ``method`` on paths fully matching the regex ``pattern`` (newest route first)."""
        with self._lock:
            self._routes.insert(0, (method.upper(), re.compile(pattern), handler))

    # --- lifecycle -------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("the HF stand-in is not running")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"  # type: ignore[str-bytes-safe]  # an IPv4 server's host is a str

    def start(self) -> "HfStandin":
        server = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
        server.daemon_threads = True
        server.block_on_close = False  # never wait on a hung handler
        self._server = server
        threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="hf-standin", daemon=True
        ).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> "HfStandin":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- dispatch --------------------------------------------------------------------------------
    def handle(self, method: str, raw_path: str, headers: dict[str, str], body: bytes) -> StandinResponse:
        parts = urlsplit(raw_path)
        with self._lock:
            routes = list(self._routes)
        for route_method, pattern, handler in routes:
            match = pattern.fullmatch(parts.path)
            if route_method == method and match:
                request = StandinRequest(method, parts.path, parse_qs(parts.query), headers, body, match)
                self.calls.append((method, parts.path, request.token is not None))
                return handler(request)
        self.calls.append((method, parts.path, "authorization" in headers))
        return StandinResponse(404, {"error": "Not Found"})

    def _whoami(self, request: StandinRequest) -> StandinResponse:
        user = self.users.get(request.token or "")
        if user is None:
            return StandinResponse(401, {"error": "Invalid credentials in Authorization header"})
        return StandinResponse(200, user.whoami())


def _make_handler(hub: HfStandin) -> type[BaseHTTPRequestHandler]:
    class _Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # one request per connection: nothing lingers after stop()

        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            headers = {k.lower(): v for k, v in self.headers.items()}
            try:
                response = hub.handle(self.command, self.path, headers, body)
            except Exception as exc:  # a test handler's bug: answer 500 so the test sees it
                response = StandinResponse(500, {"error": f"stand-in handler failed: {type(exc).__name__}"})
            payload = response.body if isinstance(response.body, bytes) else json.dumps(response.body).encode()
            self.send_response(response.status)
            if not isinstance(response.body, bytes):
                self.send_header("Content-Type", "application/json")
            for name, value in response.headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _serve

        def log_message(self, format: str, *args: Any) -> None:
            """Silent: a test's or a benchmark's output is its own."""

    return _Handler
