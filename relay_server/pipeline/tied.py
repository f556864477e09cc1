"""Tied input/output embeddings on a pipeline run: the one owner of the tie on the relay.

A decoder whose head is its input embedding (GPT-2's default, some Llama-likes') holds the matrix
once in the flat vector, in stage 0's range ``[start, end)`` (:attr:`toolkit.pipeline.cuts.PipelineUnits.tied`);
stage 0's parameter server owns it and steps it. The last stage's head multiplies by a copy of it
and gives the head's gradient of it apart (:mod:`toolkit.pipeline.compute`). One process adds the
embedding's and the head's gradient of the matrix before clipping and stepping; so does the run:

* **the copy is the version's**: the last stage's worker downloads ``[start, end)`` of stage 0's
  version that its task computes on (:meth:`TiedEmbedding.copy_of`: the bytes of stage 0's version
  file, with a hash of their own), whatever the staleness, so both stages compute on one version;
* **the head's gradient travels with the last stage's**: a last-stage worker's upload carries it
  after its stage's slice (the last owner's ``carry``), in the same ticketed upload -- whole or
  nothing together, counted with the same samples. An upload of its own would count the batch's
  samples twice in a mean (halving the head's term) or commit one half without the other;
* **folded before the step** (:meth:`TiedEmbedding.fold`): the last owner's mean of what its
  uploads carried is added into stage 0's mean of the matrix before the global norm is taken and
  before either stage steps: ``(embedding sum + head sum) / samples`` as one process computes it,
  to float rounding (the two means are added, not the sums).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from relay_server.backbone.slice_owner import SliceOwner
    from relay_server.rounds.publisher import Version

FLOAT32 = 4
KEEP_COPIES = 4
"""Versions whose copy's hash is kept (two are in use at most: delayed updates' pair)."""


class TiedEmbedding:
    """The tied matrix's range in stage 0 and what the relay does with it: the last owner's carry,
    the fold into stage 0's mean, the copy the last stage downloads."""

    def __init__(self, start: int, end: int, num_stages: int) -> None:
        if not 0 <= start < end:
            raise ValueError(f"a tied embedding is a range of stage 0, got [{start}, {end})")
        self.start, self.end, self.num_stages = start, end, num_stages
        self._copies: dict[int, Version] = {}  # stage 0's step -> the copy's version (hashed once)

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def split(self) -> bool:
        """Whether the tie crosses stages (one stage holds embedding and head as one model does)."""
        return self.num_stages > 1

    def carry(self, stage: int) -> int:
        """The values stage ``stage``'s uploads carry past its slice: the head's gradient of the
        matrix on the last stage of two or more, none elsewhere."""
        return self.numel if self.split and stage == self.num_stages - 1 else 0

    async def fold(self, owners: Sequence[SliceOwner], step: int, round_id: str) -> None:
        """Add the last owner's carried mean into stage 0's mean of the matrix, before anything
        takes the norm or steps; once per round (a retried finalize adds nothing again)."""
        if not self.split:
            return
        carried = await owners[-1].carried_mean(step, round_id)
        if carried is not None:
            await owners[0].add_to_mean(step, round_id, self.start - owners[0].start, carried)

    async def copy_of(self, first: Version, first_start: int) -> Version:
        """Stage 0's ``first`` version's range of the matrix, as a version the relay sends like any
        other (its bytes within the same file, their own hash: the worker checks what it got)."""
        copy = self._copies.get(first.step)
        if copy is None or copy.path != first.path:
            offset = first.offset + (self.start - first_start) * FLOAT32
            digest = await asyncio.to_thread(_sha256_of_range, str(first.path), offset, self.numel * FLOAT32)
            copy = dataclasses.replace(
                first, offset=offset, nbytes=self.numel * FLOAT32, numel=self.numel, sha256=digest, delta_path=None
            )
            self._copies[first.step] = copy
            for old in sorted(self._copies)[:-KEEP_COPIES]:
                del self._copies[old]
        return copy


def _sha256_of_range(path: str, offset: int, count: int) -> str:
    """The hash a worker checks the copy against: of exactly the bytes the relay sends."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        fh.seek(offset)
        while count:
            piece = fh.read(min(count, 4 << 20))
            if not piece:
                raise OSError(f"{path} ended before the tied embedding's range")
            h.update(piece)
            count -= len(piece)
    return h.hexdigest()
