"""Dishonest stage workers: the toolkit's real StageWorker, sending finite, well shaped, wrong
results -- what only checks of the work itself can find. The trust tests' workers
(``tests/stage_worker.py --corrupt``) and ``benchmarks/trust.py``'s (``benchmarks/trust_rig.py``)
are these, so a test and the benchmark attack the relay the same way.

Attacks (:data:`ATTACKS`):

* ``scale``: every activation it sends, times 1.3;
* ``noise``: every activation it sends plus noise of 10% of its norm;
* ``flip``: every tenth stage gradient it sends (the first included) with its sign flipped;
* ``flip-late``: a patient liar: honest for its first :data:`FLIP_LATE_AFTER` results (past a new
  worker's probation of raised checks), then every tenth result's sign flipped -- activations or
  stage gradients, whichever its stage sends (the relay moves workers between stages as their
  speeds change: a liar of stage gradients only would turn honest on stage 0);
* ``stale``: computes every batch on the parameters of the first version it served (it never
  downloads another, and says it serves the version asked): its first batch is honest, every
  result after it a lie;
* ``upload``: honest in every result, it sends every stage gradient (the round's upload of its
  parameter gradients) with its sign flipped -- what only an audit of the upload can find;
* ``upload-late``: as ``upload``, honest for its first :data:`UPLOAD_LATE_AFTER` uploads;
* ``scale-late``: a patient liar for a run with one probation check: honest for its first two
  activations, it triples activation number :data:`SCALE_LATE_ONCE` (counted unchecked at a low
  base share) and every one from :data:`SCALE_LATE_FROM` on (the monitors then make each a check).

Each lie is counted (``lies``) and reported to ``on_lie(how=..., n=...)``; ``results``,
``gradients`` and ``activations`` count what the worker sent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

ATTACKS = ("scale", "noise", "flip", "flip-late", "stale", "scale-late", "upload", "upload-late")
UPLOAD_LATE_AFTER = 2
"""``upload-late``'s honest uploads: a new worker's audited ones (``[pipeline] probation_checks = 2``)."""
FLIP_LATE_AFTER = 20
SCALE_LATE_ONCE = 2
"""The first lie of ``scale-late``: after a probation of one check (its first activation)."""
SCALE_LATE_FROM = 12
"""Its lies from then on: in a later batch than its first unchecked activation (a worker serves at
most ``microbatches_per_batch = 4`` first-stage tasks of a batch), and after the monitors'
reference formed on mostly honest activations (a liar that served most of a stage's first
results while the reference formed would be the reference)."""


def dishonest(base: type, how: str, on_lie: Callable[..., None] = lambda **_: None) -> type:
    """``base`` (``toolkit.pipeline.worker.StageWorker`` or a subclass: the caller's, so that the
    relay's package never imports the peer side) sending results corrupted as ``how``."""
    if how not in ATTACKS:
        raise ValueError(f"unknown attack {how!r}: one of {', '.join(ATTACKS)}")

    class Dishonest(base):
        """Overrides the worker's encoding of what it sends (``_rows``), the stage gradient it
        uploads (``_stage_gradient``) and, for ``stale``, its download of a version's parameters
        (``_ensure_version``): where a real liar would."""

        version: int  # the base's: the version its parameters are
        tasks_done: int
        results = gradients = activations = lies = uploads = 0
        first_version = -1

        def _rows(self, name: str, h: torch.Tensor) -> Any:
            lie = False
            if how == "scale" and name == "y":
                h, lie = h * 1.3, True
            elif how == "noise" and name == "y":
                noise = torch.randn(h.shape, generator=torch.Generator().manual_seed(self.tasks_done)).to(h.dtype)
                h, lie = h + noise * (0.1 * h.norm() / noise.norm()), True
            elif how == "flip" and name == "g" and self.gradients % 10 == 0:
                h, lie = -h, True
            elif how == "flip-late" and self.results >= FLIP_LATE_AFTER and (self.results - FLIP_LATE_AFTER) % 10 == 0:
                h, lie = -h, True
            elif how == "scale-late" and name == "y":
                n = self.activations
                if n == SCALE_LATE_ONCE or n >= SCALE_LATE_FROM:
                    h, lie = h * 3.0, True
            elif how == "stale" and self.version > self.first_version:
                lie = True
            if lie:
                self.lies += 1
                on_lie(how=how, n=self.results)
            self.results += 1
            self.gradients += name == "g"
            self.activations += name == "y"
            return super()._rows(name, h)

        def _stage_gradient(self, grads: list[torch.Tensor] | None) -> Any:
            vector = super()._stage_gradient(grads)
            if how == "upload" or (how == "upload-late" and self.uploads >= UPLOAD_LATE_AFTER):
                vector = -vector
                self.lies += 1
                on_lie(how=how, n=self.uploads)
            self.uploads += 1
            return vector

        def _ensure_version(self, version: int) -> None:
            if how != "stale" or self.first_version < 0:
                super()._ensure_version(version)
                self.first_version = self.version
            elif version != self.version:  # a new batch: drop what it held, keep the old parameters
                self._reset_sum()
                self.version = version

    Dishonest.__name__ = f"Dishonest_{how.replace('-', '_')}"
    return Dishonest
