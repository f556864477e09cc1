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
from pathlib import Path

import torch

from relay_server.core.config import RelayConfig
from relay_server.moe.checkpoints import CHECKPOINTS_DIR, CheckpointStore
from toolkit.moe.calls import ExpertFailed
from toolkit.moe.experts import build_expert, expert_shapes, restore


class RelayExperts:
    """The run's experts as the relay's checkpoints hold them, each built on its first call and
    reloaded by :meth:`refresh` when a newer checkpoint arrived (the evaluator holds only the
    experts its validation rows reach, and reads a checkpoint once)."""

    def __init__(self, config: RelayConfig) -> None:
        self.section = config.moe
        self.store = CheckpointStore(Path(config.server.data_dir) / CHECKPOINTS_DIR, self.section.keep_checkpoints)
        self.shapes = expert_shapes(self.section.expert)
        self.uids = frozenset(self.section.uids())
        self.experts: dict[str, torch.nn.Module] = {}
        self.loaded: dict[str, int] = {}
        """uid -> the number of the checkpoint its module holds (absent: its initial weights)."""

    def refresh(self) -> None:
        """Reload the experts built so far whose newest checkpoint is not the one they hold."""
        for uid, module in self.experts.items():
            self._load(uid, module)

    def _expert(self, uid: str) -> torch.nn.Module:
        module = self.experts.get(uid)
        if module is None:
            module = self.experts[uid] = build_expert(self.section.expert, uid, self.section.seed).eval()
            self._load(uid, module)
        return module

    def _load(self, uid: str, module: torch.nn.Module) -> None:
        versions = self.store.versions(uid)
        if versions and self.loaded.get(uid) != versions[-1] and (newest := self.store.newest(uid)) is not None:
            restore(module, None, newest[1], self.shapes)
            self.loaded[uid] = newest[0]

    # --- ExpertCaller ---------------------------------------------------------------------------
    def live(self) -> frozenset[str]:
        return self.uids

    def forward(self, uid: str, x: torch.Tensor) -> concurrent.futures.Future[torch.Tensor]:
        future: concurrent.futures.Future[torch.Tensor] = concurrent.futures.Future()
        with torch.no_grad():
            future.set_result(self._expert(uid)(x))
        return future

    def backward(self, uid: str, x: torch.Tensor, grad_y: torch.Tensor) -> concurrent.futures.Future[torch.Tensor]:
        future: concurrent.futures.Future[torch.Tensor] = concurrent.futures.Future()
        future.set_exception(
            ExpertFailed(
                "evaluation_only",
                "the evaluator's experts only score (no backward)",
                "Train through the run's expert hosts.",
            )
        )
        return future
