"""A pipeline version as the whole model: one state file like a data-parallel run's.

Each stage keeps its own version files (``data_dir/stages/<k>``, :mod:`.stage_owners`); nothing
there is the model users load. What reads a run's versions -- ``relay-server export``, held-out
``[evaluation]``, Hub checkpoints (:mod:`relay_server.observers`) -- reads the relay's own store:
``state/step-NNNNNNNN.safetensors`` holding the flat parameters of the run's model (its
``model.spec()``, the whole model the stages were cut from) under ``params``, the file
``Store.commit`` then makes the latest. :func:`write_whole_version` writes that file for every
published pipeline step, before the step is committed, so a committed step always has its file
(what :meth:`Store.reader` promises ``relay-server export``).

Why concatenating the stages' slices is the whole model: the run's flat vector is the model's
parameters in ``named_parameters()`` order, and stage k owns the contiguous range ``cuts[k]`` of
it (:mod:`toolkit.pipeline.cuts`); the cuts cover it in order. A tied input/output embedding
appears once in that order, in stage 0's range, as ``named_parameters()`` lists it (the last
stage's head reads a copy, :mod:`.tied`; ``from_pretrained`` ties the head to it again on load);
other shared parameters are refused (:func:`toolkit.pipeline.stages.pipeline_units`), so every
parameter is in exactly one stage.

The file holds the master parameters (the exact ones, also with a lossy download codec) and no
optimizer state: each stage's optimizer state stays in its own store, which is what a restart
resumes from; nobody downloads this file.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from relay_server.backbone.slice_owner import SliceOwner
from relay_server.rounds.store import Store
from toolkit.wire.tensor_container import write_file

KIND = "pipeline-whole-model"
"""The ``kind`` in the file's metadata: the stages' masters, assembled."""


def assemble(owners: Sequence[SliceOwner], num_params: int) -> np.ndarray:
    """The whole model's flat vector (``named_parameters()`` order) from the stages' masters.

    ``owners`` in stage order; their ranges must tile ``[0, num_params)`` -- anything else is a
    bug in the cut, refused rather than written as a model."""
    expected = 0
    for k, owner in enumerate(owners):
        if owner.start != expected:
            raise ValueError(
                f"stage {k} starts at {owner.start}, not {expected}: the stages do not tile the flat "
                "vector (cut them with toolkit.pipeline.cut_stages)"
            )
        expected = owner.end
    if expected != num_params:
        raise ValueError(
            f"the stages cover {expected} of the model's {num_params} parameters: cut them with "
            "toolkit.pipeline.cut_stages"
        )
    return np.concatenate([owner.master.flat.numpy() for owner in owners])


def write_whole_version(
    store: Store, owners: Sequence[SliceOwner], num_params: int, step: int, run_name: str, fsync: bool = False
) -> Path:
    """Write version ``step`` of the whole model into ``store``'s state directory (atomically:
    temporary file, then rename); returns its path. Call it before ``store.commit(step, ...)``."""
    path = store.state_path(step)
    write_file(
        path,
        [("params", assemble(owners, num_params))],
        {"step": str(step), "run": run_name, "kind": KIND},
        fsync=fsync,
    )
    return path
