"""A micro-batch's data as it crosses the wire: the first stage sends what it read with its
result (``batch`` or ``batch.<key>`` int64 arrays), the relay sends it back with stage 0's
backward and the last stage's task (the labels), and with a replayed first-stage task (a rollback
undid its batch, :mod:`relay_server.pipeline.kept_inputs`) -- the one case where the data is the
input the worker computes on, so it is validated as the relay validates a first-stage result.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from toolkit.errors import ProtocolError

DATA_KEY = re.compile(r"[a-z_]{1,32}")
"""A data tensor's key (``batch.<key>``), as the relay accepts it from a first-stage result."""
MAX_DATA_TENSORS = 4


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, Mapping):
        return {k: v.to(device) for k, v in batch.items()}
    return batch.to(device)


def batch_tensors(batch: Any) -> dict[str, np.ndarray]:
    """A data batch as the first stage sends it: ``batch`` or ``batch.<key>`` int64 arrays."""
    if isinstance(batch, Mapping):
        return {f"batch.{k}": v.detach().to("cpu", torch.int64).numpy() for k, v in batch.items()}
    return {"batch": batch.detach().to("cpu", torch.int64).numpy()}


def carried_batch(inputs: Mapping[str, np.ndarray], rows: int, device: torch.device) -> Any:
    """The data a replayed first-stage task carries, validated as the relay validated it when it
    was first read: 1 to 4 int64 ``[rows, tokens]`` arrays of one token count, named ``batch`` or
    ``batch.<lowercase key>``, ids >= -100 (the relay checked them against the vocabulary when a
    worker first sent them)."""
    names = [k for k in inputs if k == "batch" or k.startswith("batch.")]
    if not 1 <= len(names) <= MAX_DATA_TENSORS or len(names) != len(inputs) or ("batch" in names and len(names) > 1):
        raise ProtocolError("bad_work", f"a replayed first-stage task carries tensors {sorted(inputs)}, not the data")
    widths = set()
    for name in names:
        array = inputs[name]
        key = name[len("batch.") :]
        if name != "batch" and not DATA_KEY.fullmatch(key):
            raise ProtocolError(
                "bad_work", f"a replayed task's data tensor {name!r} is not named batch.<lowercase key>"
            )
        if array.dtype != np.int64 or array.ndim != 2 or array.shape[0] != rows or array.shape[1] < 1:
            raise ProtocolError(
                "bad_work",
                f"a replayed task's data tensor {name!r} is {array.dtype} {list(array.shape)}, not int64 [{rows}, tokens]",
            )
        if array.size and array.min() < -100:
            raise ProtocolError("bad_work", f"a replayed task's data tensor {name!r} holds ids below -100")
        widths.add(array.shape[1])
    if len(widths) != 1:
        raise ProtocolError("bad_work", f"a replayed task's data tensors have different token counts {sorted(widths)}")
    return from_tensors(inputs, device)


def from_tensors(inputs: Mapping[str, np.ndarray], device: torch.device) -> Any:
    if "batch" in inputs:
        return torch.from_numpy(inputs["batch"].copy()).to(device)
    return {
        k[len("batch.") :]: torch.from_numpy(v.copy()).to(device) for k, v in inputs.items() if k.startswith("batch.")
    }
