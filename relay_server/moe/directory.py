"""Which host holds which expert: the paper's DHT table, kept by the relay as leases.

In Learning@home each server announces its experts in a DHT with an expiry; a trainer's beam
search reads prefix -> suffix tables from it. Our hosts cannot be reached, so the relay hands
experts out instead: a host asks for ``capacity`` experts and gets the ones it already holds plus
orphans (no host) in a spread order, so a new host takes over a dead one's experts first and
every layer gets hosts before any layer gets two. An expert's lease ends when its host leaves the
registry (TTL, leave, ban): the expert is an orphan again and the next lease request takes it,
with its last checkpoint. Trainers read :meth:`live` (the uids with a host): the beam search only
ever picks live experts, as with expired DHT entries.
"""

from __future__ import annotations

from collections.abc import Collection

from toolkit.wire.protocol import MoeDirectory


class ExpertDirectory:
    def __init__(self, uids: list[str]) -> None:
        if len(set(uids)) != len(uids):
            raise ValueError("expert uids must be unique")
        self.uids = list(uids)
        self._order = _spread(uids)
        self._host: dict[str, str] = {}
        self._hosted: dict[str, list[str]] = {}
        self.version = 0
        """Bumped on every change, so trainers can tell a stale snapshot."""

    def host_of(self, uid: str) -> str | None:
        return self._host.get(uid)

    def hosted_by(self, host: str) -> list[str]:
        return list(self._hosted.get(host, ()))

    def live(self) -> list[str]:
        return [uid for uid in self.uids if uid in self._host]

    def hosts(self) -> dict[str, int]:
        return {host: len(uids) for host, uids in self._hosted.items()}

    def lease(self, host: str, capacity: int, prefer: Collection[str] = ()) -> list[str]:
        """The experts ``host`` holds after asking for ``capacity`` (never fewer than it held:
        a host keeps its experts while it lives; extra capacity takes orphans, those in
        ``prefer`` first: the copies a host still holds after its leases lapsed)."""
        held = self._hosted.setdefault(host, [])
        known = set(self.uids)
        for uid in [*(u for u in prefer if u in known), *self._order]:
            if len(held) >= capacity:
                break
            if uid not in self._host:
                self._host[uid] = host
                held.append(uid)
                self.version += 1
        if not held:
            del self._hosted[host]
        return list(held)

    def release(self, host: str, uids: Collection[str] | None = None) -> list[str]:
        """End ``host``'s leases on ``uids`` (all of them by default); returns the orphans."""
        held = self._hosted.get(host, [])
        gone = [uid for uid in held if uids is None or uid in uids]
        for uid in gone:
            del self._host[uid]
            held.remove(uid)
        if not held:
            self._hosted.pop(host, None)
        if gone:
            self.version += 1
        return gone

    def expire(self, live_hosts: Collection[str]) -> dict[str, list[str]]:
        """Release every host not in ``live_hosts``; returns {departed host: its orphaned uids}."""
        return {host: self.release(host) for host in [h for h in self._hosted if h not in live_hosts]}

    def snapshot(self) -> MoeDirectory:
        return MoeDirectory(version=self.version, live=self.live(), total=len(self.uids))


def _spread(uids: list[str]) -> list[str]:
    """Round-robin over layers (the uid's first dot-part), so hosts cover every layer early."""
    layers: dict[str, list[str]] = {}
    for uid in uids:
        layers.setdefault(uid.split(".", 1)[0], []).append(uid)
    columns = list(layers.values())
    return [col[i] for i in range(max(map(len, columns), default=0)) for col in columns if i < len(col)]
