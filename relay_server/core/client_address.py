"""Who a request comes from: the one rule behind every per-address cap and rate limit.

The README puts the relay on 127.0.0.1 behind a TLS proxy on the same host, so every proxied
request arrives from loopback. Keyed by the socket, every volunteer would be "127.0.0.1" -- one
shared bucket, and exempt from the caps that exist for local runs. So:

* from a **trusted proxy** (a loopback peer, while ``limits.trust_forwarded_for`` is on), the
  client is the **last hop of X-Forwarded-For**: the address the proxy itself saw and appended
  (nginx ``$proxy_add_x_forwarded_for``, Caddy by default). Earlier hops are whatever the client
  chose to send, and are never believed;
* from anywhere else, or without the header, the client is the socket's address: a remote host
  cannot name itself anything else.

Loopback exemptions (``connections.exempt_loopback``, ``limits.exempt_loopback``) apply to the
client this rule finds, never to the socket: a request the proxy forwards for a public address is
that address's, and is capped and limited like it.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping

FORWARDED_FOR = "X-Forwarded-For"
_MAX_HOP = 64  # a hop that is no address is kept as text, bounded (it names a bucket)


def is_loopback(address: str) -> bool:
    """127.0.0.0/8 or ::1 (an IPv6 zone suffix ignored); False for anything that is no address."""
    try:
        return ipaddress.ip_address(address.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def forwarded_client(direct: str, headers: Mapping[str, str], *, trust_forwarded_for: bool = True) -> str | None:
    """The client a trusted proxy names for this request, or None when the request is not
    proxied (the peer is no loopback address, trust is off, or the header is absent or empty)."""
    if not trust_forwarded_for or not is_loopback(direct):
        return None
    header = headers.get(FORWARDED_FOR, "")
    hop = header.rsplit(",", 1)[-1].strip()
    return _normalized(hop) if hop else None


def client_address(direct: str, headers: Mapping[str, str], *, trust_forwarded_for: bool = True) -> str:
    """The address every per-address cap and bucket of this request is keyed by."""
    return forwarded_client(direct, headers, trust_forwarded_for=trust_forwarded_for) or direct


def _normalized(hop: str) -> str:
    """One spelling per address ("::ffff:203.0.113.7" and "203.0.113.7" are one client; a port
    some proxies append is dropped); a hop that is no address stays as text."""
    candidates = [hop]
    if hop.startswith("[") and "]" in hop:  # [2001:db8::1]:443
        candidates.append(hop[1 : hop.index("]")])
    elif hop.count(":") == 1:  # 203.0.113.7:51234
        candidates.append(hop.split(":", 1)[0])
    for candidate in candidates:
        try:
            address = ipaddress.ip_address(candidate.split("%", 1)[0])
        except ValueError:
            continue
        mapped = getattr(address, "ipv4_mapped", None)
        return str(mapped or address)
    return hop[:_MAX_HOP]
