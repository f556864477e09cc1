"""The expert routes (``ROUTES["moe_*"]``): one typed method per route.

JSON answers are :mod:`toolkit.wire.protocol.moe`'s messages; tensor bodies are containers built
and checked by :mod:`toolkit.wire.payloads` (the caller validates what it reads: a task batch
against the run's width and codec, an answer against the call's rows).
"""

from __future__ import annotations

import numpy as np

from toolkit.client.transport import Transport
from toolkit.errors import RelayRejected
from toolkit.transfer import SizedBody
from toolkit.wire.auth import BODY_SHA256_HEADER, container_body_sha256, digest_metadata
from toolkit.wire.protocol import (
    ROUTES,
    CheckpointReceipt,
    ExpertLease,
    LeaseRequest,
    MoeDirectory,
    MoeSpec,
    ResultAck,
)

BINARY = {"Content-Type": "application/octet-stream"}


class MoeCalls:
    """The expert routes over ``transport`` (what :class:`~toolkit.client.RelayClient`'s ``moe_*``
    methods call)."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport

    def spec(self) -> MoeSpec:
        return self.transport.call("GET", ROUTES["moe_spec"], MoeSpec)

    def directory(self) -> MoeDirectory:
        return self.transport.call("GET", ROUTES["moe_directory"], MoeDirectory)

    def call(self, peer_id: str, uid: str, *, kind: str, call_id: str, body: bytes) -> bytes:
        """A trainer's forward or backward call, answered when the expert's host has (a repeat of
        ``call_id`` after a broken connection waits on the same task, so retrying is safe)."""
        response = self.transport.request(
            "PUT",
            ROUTES["moe_call"].format(peer_id=peer_id, uid=uid),
            params={"kind": kind, "call_id": call_id},
            data=body,
            headers=BINARY,
        )
        return response.content

    def lease(self, peer_id: str, capacity: int, held: list[str] | None = None) -> ExpertLease:
        """Up to ``capacity`` experts: those this host holds, then its ``held`` copies if they have
        no host, then orphans."""
        return self.transport.call(
            "POST",
            ROUTES["moe_lease"].format(peer_id=peer_id),
            ExpertLease,
            LeaseRequest(held=list(held or [])),
            params={"capacity": capacity},
        )

    def tasks(self, peer_id: str, *, max_rows: int, wait_s: int) -> bytes | None:
        """A task batch (:func:`toolkit.wire.payloads.read_task_batch` reads it), or None when no
        task came within ``wait_s``."""
        response = self.transport.request(
            "GET",
            ROUTES["moe_tasks"].format(peer_id=peer_id),
            params={"max_rows": max_rows, "wait": wait_s},
            timeout=(self.transport.timeout[0], self.transport.timeout[1] + wait_s),
        )
        return None if response.status_code == 204 else response.content

    def result(self, peer_id: str, task_id: str, body: bytes) -> ResultAck:
        return self.transport.call(
            "PUT", ROUTES["moe_result"].format(peer_id=peer_id, task_id=task_id), ResultAck, data=body, headers=BINARY
        )

    def put_checkpoint(
        self, peer_id: str, uid: str, tensors: list[tuple[str, np.ndarray]], metadata: dict[str, str]
    ) -> CheckpointReceipt:
        """One expert's parameters and optimizer state, streamed like a gradient (in a signed run
        the relay checks each chunk against the digests the signed header carries)."""
        metadata, headers = dict(metadata), dict(BINARY)
        if self.transport.signed:
            metadata.update(digest_metadata(tensors))
            headers[BODY_SHA256_HEADER] = container_body_sha256(tensors, metadata)
        return self.transport.call(
            "PUT",
            ROUTES["moe_checkpoint"].format(peer_id=peer_id, uid=uid),
            CheckpointReceipt,
            data=SizedBody(tensors, metadata),
            headers=headers,
        )

    def get_checkpoint(self, peer_id: str, uid: str) -> bytes | None:
        """The expert's latest checkpoint, or None if it has none yet (a fresh expert)."""
        try:
            return self.transport.request("GET", ROUTES["moe_checkpoint"].format(peer_id=peer_id, uid=uid)).content
        except RelayRejected as exc:
            if exc.code == "no_checkpoint":
                return None
            raise
