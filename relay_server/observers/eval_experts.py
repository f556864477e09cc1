"""The experts a ``[moe]`` run's held-out evaluation calls: the relay's own copies of them.

A DMoE model's flat vector holds only its dense parts (embeddings, attention, norms, gates); its
experts live on volunteer hosts, which upload each expert's checkpoint every
``moe.checkpoint_every_s`` to the relay (:mod:`relay_server.moe.checkpoints`). The evaluator
scores a version with those checkpoints -- the newest of each expert when the version is scored
-- and an expert no host ever checkpointed as every host starts it (``[moe] seed`` and its uid:
:func:`toolkit.moe.experts.build_expert`). Why not call the hosts: the evaluator would then load
the volunteers with work nobody trains on, and fail with them; the copies are already on the
relay's disk.

:class:`RelayExperts` is an :class:`~toolkit.moe.calls.ExpertCaller` that computes each call in
the calling thread and hands back a finished future, every expert live: no deadline can drop an
expert from the average, so a version's score depends on its parameters and the checkpoints only.
"""

from __future__ import annotations

import concurrent.futures
import logging
from pathlib import Path

import torch

from relay_server.core.config import RelayConfig
from relay_server.moe.checkpoints import CHECKPOINTS_DIR, CheckpointStore
from toolkit.moe.calls import ExpertFailed
from toolkit.moe.experts import build_expert, expert_shapes, restore

log = logging.getLogger(__name__)


class RelayExperts:
    """Every expert of the run, loaded from the relay's checkpoints (:meth:`refresh`)."""

    def __init__(self, config: RelayConfig) -> None:
        section = config.moe
        self.store = CheckpointStore(Path(config.server.data_dir) / CHECKPOINTS_DIR, section.keep_checkpoints)
        self.shapes = expert_shapes(section.expert)
        self.experts = {uid: build_expert(section.expert, uid, section.seed).eval() for uid in section.uids()}
        self.updates: dict[str, int] = {}
        """uid -> the updates of the checkpoint loaded (absent: the expert's initial weights)."""

    def refresh(self) -> None:
        """Load each expert's newest checkpoint (those the relay holds)."""
        for uid, module in self.experts.items():
            body = self.store.latest(uid)
            if body is not None:
                self.updates[uid] = restore(module, None, body, self.shapes)
        log.debug("evaluation experts: %d of %d from checkpoints", len(self.updates), len(self.experts))

    # --- ExpertCaller ---------------------------------------------------------------------------
    def live(self) -> frozenset[str]:
        return frozenset(self.experts)

    def forward(self, uid: str, x: torch.Tensor) -> concurrent.futures.Future[torch.Tensor]:
        future: concurrent.futures.Future[torch.Tensor] = concurrent.futures.Future()
        with torch.no_grad():
            future.set_result(self.experts[uid](x))
        return future

    def backward(self, uid: str, x: torch.Tensor, grad_y: torch.Tensor) -> concurrent.futures.Future[torch.Tensor]:
        future: concurrent.futures.Future[torch.Tensor] = concurrent.futures.Future()
        future.set_exception(ExpertFailed("evaluation_only", "the evaluator's experts only score (no backward)",
                                          "Train through the run's expert hosts."))
        return future
