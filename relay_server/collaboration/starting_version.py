"""The version a relay serves first: a fresh run's version 0, or the one it resumes.

Decided once, when the collaboration is built, from the data dir: nothing stored writes version 0
from the run's initial model (:func:`initial_model`: the run's seed, then ``model.init_checkpoint``
or ``hub.init_from``); a stored version whose slices the relay held itself is restored at once;
one whose slices aggregators owned when the relay stopped (the store kept its manifest) is
gathered back from them before the relay serves (:meth:`StartingVersion.gather`, which needs the
event loop to talk to them); and a run whose parameters a feature keeps (the pipeline's stage
owners, each resuming from its own store) restores nothing here. Kept apart from the state
machine (:mod:`.machine`) because this is the only state it has before it serves, and nothing
reads it after.
"""

from __future__ import annotations

import asyncio
import logging

import torch

from relay_server.backbone.backbone import Backbone
from relay_server.collaboration.round_cycle import RoundCycle
from relay_server.core.config import RelayConfig
from relay_server.rounds.store import RoundLog, Store
from toolkit.models import build_own_model
from toolkit.wire.protocol import ParamsManifest

log = logging.getLogger(__name__)


def initial_model(config: RelayConfig, store: Store) -> torch.nn.Module:
    """The run's model as it starts: built from its spec under the run's seed, loaded from
    ``model.init_checkpoint`` or (on a fresh data dir only) from ``hub.init_from``."""
    torch.manual_seed(config.run.seed)
    model = build_own_model(config.model.spec())
    if config.model.init_checkpoint:
        from safetensors.torch import load_file

        model.load_state_dict(load_file(config.model.init_checkpoint))
    elif config.hub.init_from and store.latest_step() is None:
        from relay_server.observers.hub_checkpoints import init_model_from_hub

        init_model_from_hub(model, config)  # a restart resumes from the data dir instead
    return model


class StartingVersion:
    """What the relay publishes before it serves (the module docstring says which), decided from
    ``store`` when built; :meth:`gather` finishes a resume that needs the aggregators."""

    def __init__(
        self, config: RelayConfig, store: Store, rounds: RoundCycle, backbone: Backbone, kept_elsewhere: bool
    ) -> None:
        self.store, self.backbone = store, backbone
        publisher = rounds.publisher
        step = store.latest_step()
        manifest = store.get_meta("manifest") if step is not None else None
        self._pending: tuple[int, ParamsManifest] | None = None
        if kept_elsewhere and step is not None:
            pass  # the feature that keeps them resumes them (the pipeline: relay_server.pipeline.stage_owners)
        elif manifest and step is not None:  # aggregators held slices of it: gathered in gather()
            self._pending = (step, ParamsManifest.loads(manifest))
        elif step is not None:
            publisher.restore(step)
            log.info("resumed from %s at step %d", store.dir, step)
        else:
            version = publisher.write(0, {"run": config.run.name})
            store.commit(0, version.sha256)
            publisher.latest = version
        if self._pending is None and publisher.latest is not None:
            rounds.publish_local(publisher.latest)

    async def gather(self) -> None:
        """Before serving: a relay restarted while aggregators owned slices gathers its last
        version from them (``Backbone.resume``); nothing to do otherwise."""
        if self._pending is None:
            return
        step, manifest = self._pending
        published, new_version = await self.backbone.resume(step, manifest)
        record = RoundLog.recovery() if new_version else None
        await asyncio.to_thread(self.store.commit, published.step, published.sha256, record, {"manifest": ""})
        self.backbone.board.publish(published)
        self._pending = None
        log.info("resumed from %s at step %d", self.store.dir, published.step)
