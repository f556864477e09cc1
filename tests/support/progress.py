"""A :class:`PeerProgress` with every number set, for the tests of what shows it: the notebook
panel and the peer's W&B run."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from toolkit.notebook.panel import PeerProgress


def progress(**changes: Any) -> PeerProgress:
    base = PeerProgress(
        peers_online=3,
        samples_per_s=123.4,
        global_step=17,
        total_steps=100,
        samples_accumulated=40,
        target_batch=64,
        eta_s=4.2,
        contributed_samples=1024,
        local_samples_per_s=12.5,
        loss=2.3456,
        first_contribution_s=3.25,
    )
    return replace(base, **changes)
