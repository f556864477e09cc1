"""A real nginx (Debian's), started without root on 127.0.0.1 for the tests and the benchmarks that
put it in front of a relay: the TLS proxy of docs/organizer.md (tests/test_proxy.py) and the parameter
cache of ``examples/nginx_params_cache.conf`` (tests/test_http_cache.py, ``benchmarks/egress.py``).

nginx cannot listen on port 0 and say which port it got, as our own servers do, so a port is
picked free and picked again when another process took it first (:func:`on_free_port`).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from relay_server.harness.process import stop_process

CACHE_CONF = Path(__file__).resolve().parents[2] / "examples" / "nginx_params_cache.conf"
"""The organizer's cache example, as a checkout holds it (the wheel ships no ``examples/``)."""


def free_port() -> int:
    """A port nothing listens on right now, for third-party servers that cannot bind port 0 and
    report it (nginx): another process may take it before the server binds it, so start such a
    server through :func:`on_free_port`, which picks again when that happens. Our own servers
    (relay, aggregator, demo) bind port 0 and say which port they got: never pick one for them."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PortTaken(Exception):
    """Raised by a ``start(port)`` given to :func:`on_free_port` when the port was taken meanwhile."""


def on_free_port(start: Callable[[int], T], attempts: int = 5) -> T:
    """``start(port)`` on a free port, again on another one while it raises :class:`PortTaken`: the
    race between picking a port and a third-party server binding it, closed by retrying."""
    for attempt in range(attempts):
        try:
            return start(free_port())
        except PortTaken:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


T = TypeVar("T")
NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)


@dataclass
class NginxProcess:
    """A real nginx (Debian's) in the foreground, all its files in ``directory``; no root needed."""

    proc: subprocess.Popen[bytes]
    port: int
    directory: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        stop_process(self.proc, timeout_s=10)


def run_nginx(directory: Path, http_block: Callable[[int], str], port: int = 0) -> NginxProcess:
    """nginx on a free port (:func:`on_free_port`: nginx cannot listen on port 0, so a port is
    picked, and picked again if another process took it first), or on ``port`` (:class:`PortTaken`
    if it is taken). ``http_block(port)`` is the text inside ``http { }``; its server listens on
    127.0.0.1:port."""
    directory.mkdir(parents=True, exist_ok=True)
    log = directory / "error.log"
    temp = "\n".join(
        f"    {kind}_temp_path {directory / kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    user = "user root;\n" if os.geteuid() == 0 else ""  # workers may read what the test wrote

    def start(port: int) -> NginxProcess:
        conf = directory / "nginx.conf"
        conf.write_text(
            f"{user}worker_processes 1;\nevents {{ worker_connections 1024; }}\nhttp {{\n"
            f"    access_log off;\n{temp}\n{http_block(port)}}}\n"
        )
        log.unlink(missing_ok=True)
        proc = subprocess.Popen(
            [
                NGINX,  # type: ignore[list-item]  # callers skip where nginx is not installed
                "-p",
                str(directory),
                "-c",
                str(conf),
                "-g",
                f"daemon off; pid {directory / 'nginx.pid'}; error_log {log} info;",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    return NginxProcess(proc, port, directory)
            except OSError:
                time.sleep(0.05)
        proc.kill()
        proc.wait(timeout=10)
        text = log.read_text() if log.exists() else ""
        if "Address already in use" in text:
            raise PortTaken(port)
        raise RuntimeError(f"nginx did not start:\n{text[-3000:]}")

    return start(port) if port else on_free_port(start)


def cache_http_block(port: int, upstream: int, cache_dir: Path) -> str:
    """``examples/nginx_params_cache.conf`` as written, but plain HTTP on 127.0.0.1:``port``
    (tests/test_proxy.py covers nginx's TLS) in front of the relay on ``upstream``."""
    text = CACHE_CONF.read_text()
    for old, new in (
        ("listen 443 ssl;", f"listen 127.0.0.1:{port};"),
        ("    ssl_certificate     /etc/letsencrypt/live/cache.example.org/fullchain.pem;\n", ""),
        ("    ssl_certificate_key /etc/letsencrypt/live/cache.example.org/privkey.pem;\n", ""),
        ("        proxy_ssl_server_name on;\n", ""),
        ("proxy_pass https://relay.example.org;", f"proxy_pass http://127.0.0.1:{upstream};"),
        ("/var/cache/nginx/collab-params", str(cache_dir)),
    ):
        assert old in text, f"{CACHE_CONF.name} no longer has {old!r}: update relay_server/harness/nginx.py with it"
        text = text.replace(old, new)
    return text
