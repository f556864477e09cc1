"""Hosts with shaped links on one machine: Linux network namespaces, veth pairs and ``tc``.

Each host is a namespace with one veth link to a bridge in the root namespace (a star, like
volunteers and servers on one internet). ``tbf`` on the host's end of the link limits what it
sends (its upload); ``tbf`` on the bridge's end limits what it receives (its download). Every
name and address here is created by this module and removed on exit, and processes only ever
talk to those addresses (10.77.0.0/24 unless ``Star(subnet=...)``), never outside.

Needs root (or CAP_NET_ADMIN) and iproute2; :func:`unavailable` says why not where it fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass, field

SUBNET = "10.77.0"


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + ["ip", *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def _tc(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + ["tc", *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def unavailable() -> str | None:
    """Why namespaces with shaped links cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (or CAP_NET_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' is missing (Debian: apt-get install iproute2)"
    probe = f"ctp{uuid.uuid4().hex[:6]}"
    steps = [
        (["ip", "netns", "add", probe], "cannot create a network namespace"),
        (["ip", "link", "add", f"{probe}a", "type", "veth", "peer", "name", f"{probe}b"], "cannot create veth links"),
        (
            [
                "tc",
                "qdisc",
                "add",
                "dev",
                f"{probe}a",
                "root",
                "tbf",
                "rate",
                "10mbit",
                "burst",
                "65536",
                "latency",
                "50ms",
            ],
            "cannot shape a link with tc tbf",
        ),
        (["ip", "link", "add", f"{probe}r", "type", "bridge"], "cannot create a bridge"),
    ]
    try:
        for cmd, what in steps:
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                return f"{what}: {done.stderr.strip()}"
    finally:
        for link in (f"{probe}a", f"{probe}r"):
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@dataclass
class Host:
    name: str
    address: str
    upload_mbit: float
    download_mbit: float
    netns: str = ""

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]


@dataclass
class Star:
    """A bridge and shaped hosts around it; use as a context manager (always torn down)."""

    hosts: list[Host] = field(default_factory=list)
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:5])
    subnet: str = SUBNET
    """The /24 its hosts live in: two stars up at once on one machine each need their own."""

    @property
    def bridge(self) -> str:
        return f"ctbr{self.tag}"

    def add(self, name: str, upload_mbit: float, download_mbit: float | None = None) -> Host:
        host = Host(
            name,
            f"{self.subnet}.{len(self.hosts) + 1}",
            upload_mbit,
            upload_mbit if download_mbit is None else download_mbit,
        )
        self.hosts.append(host)
        return host

    def __enter__(self) -> "Star":
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i, host in enumerate(self.hosts):
            host.netns = f"ct{self.tag}h{i}"
            inner, outer = f"ct{self.tag}i{i}", f"ct{self.tag}o{i}"  # interface names <= 15 chars
            _ip("netns", "add", host.netns)
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", host.netns)
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")
            _ip("addr", "add", f"{host.address}/24", "dev", inner, ns=host.netns)
            _ip("link", "set", inner, "up", ns=host.netns)
            _ip("link", "set", "lo", "up", ns=host.netns)
            _shape(inner, host.upload_mbit, ns=host.netns)  # what the host sends
            _shape(outer, host.download_mbit)  # what the bridge delivers to it

    def close(self) -> None:
        for i, host in enumerate(self.hosts):
            if host.netns:
                # deleting one end removes the pair now (a namespace's own cleanup is asynchronous)
                subprocess.run(["ip", "link", "del", f"ct{self.tag}o{i}"], capture_output=True)
                subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


def _shape(device: str, mbit: float, ns: str | None = None) -> None:
    """Token bucket at ``mbit``: a burst of ~2 ms of traffic (at least 64 KiB), 50 ms of queue."""
    burst = max(64 * 1024, int(mbit * 1e6 / 8 * 0.002))
    _tc(
        "qdisc",
        "add",
        "dev",
        device,
        "root",
        "tbf",
        "rate",
        f"{mbit}mbit",
        "burst",
        str(burst),
        "latency",
        "50ms",
        ns=ns,
    )
