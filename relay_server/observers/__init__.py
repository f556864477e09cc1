"""Observers of published steps, fed on their own thread so a slow upload never delays a round:
W&B (:mod:`.wandb_observer`), Hub checkpoints (:mod:`.hub_checkpoints`) and held-out evaluation
(:mod:`.evaluation`, scoring in a process of its own with :mod:`.eval_model`, a ``[moe]`` run's
experts from the relay's checkpoints with :mod:`.eval_experts`); the event and the delivery
thread are in :mod:`.events`. May import :mod:`relay_server.core`, :mod:`relay_server.moe` and
:mod:`relay_server.rounds`."""

from __future__ import annotations

from relay_server.core.config import RelayConfig
from relay_server.observers.events import Observer, ObserverThread, StepEvent

__all__ = ["Observer", "ObserverThread", "StepEvent", "build_observers"]


def build_observers(config: RelayConfig) -> list[Observer]:
    """The observers the configuration asks for (none by default).

    Each is imported only when configured, so a relay without W&B or Hub uploads never pays for
    importing those clients. A setting that cannot work (no token in ``hub.token_env``, wandb not
    installed) raises ConfigError naming it, before the relay accepts peers."""
    observers: list[Observer] = []
    if config.hub.repo_id and config.hub.every_steps > 0:  # first: its checks may refuse to start
        from relay_server.observers.hub_checkpoints import HubCheckpointer

        observers.append(HubCheckpointer(config))
    if config.wandb.project and config.wandb.mode != "disabled":
        from relay_server.observers.wandb_observer import WandbObserver

        observers.append(WandbObserver(config))
    if config.evaluation.enabled:
        from relay_server.observers.evaluation import Evaluator

        evaluator = Evaluator(config)
        evaluator.listeners += [o.on_evaluation for o in observers if hasattr(o, "on_evaluation")]
        observers.insert(0, evaluator)  # closed first: no record reaches a listener already closed
    return observers
