"""Validating what a stage worker sends before anything downstream sees it.

A result is refused (422, and the task stays leased so its worker may retry, or expires and is
re-dispatched) unless it is exactly one tensor container, within the byte limit the run implies,
with exactly the tensors its task kind produces: boundary matrices in the run's boundary codec of
the micro-batch's row count and the model's width, finite after decoding, and -- from the first
stage -- the micro-batch's data as 2-D int64 arrays of ``microbatch_size`` rows with token ids in
range. A NaN, a wrong shape or an oversized body never reaches the next stage or a round.

What is kept is each tensor group re-wrapped in its own container with the names it will have on
the way out (``v`` or ``v.<codec part>``): the codec's bytes pass through untouched.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from relay_server.core.errors import ApiError
from relay_server.pipeline.ledger import FIRST, FORWARD, Step
from toolkit.errors import ProtocolError
from toolkit.wire import payloads
from toolkit.wire.compression import Codec
from toolkit.wire.protocol import PipelineResult

_KEY = re.compile(r"[a-z_]{1,32}")
MAX_BATCH_KEYS = 4


@dataclass(frozen=True)
class Shapes:
    """What the run implies about every boundary: its width, the rows a micro-batch may have, the
    micro-batch's samples and the token ids' range (``vocab``)."""

    width: int
    microbatch_size: int
    max_positions: int
    vocab: int
    tokens_key: str = ""
    """The data tensor holding the input tokens (``""``: ``batch`` itself, ``input_ids``: ``batch.input_ids``)."""
    label_columns: int = 1
    """Columns of that tensor that are labels, not inputs (the byte model's rows are ``[b, t + 1]``)."""

    def rows_of_batch(self, found: dict[str, np.ndarray]) -> int:
        """The rows every boundary matrix of a micro-batch with this data has: samples x input
        tokens (what the stages compute on), so a first-stage result is tied to its own data."""
        tokens = found.get(self.tokens_key)
        if tokens is None:
            raise ProtocolError(
                "bad_batch",
                f"a first-stage result carries the input tokens as "
                f"{'batch.' + self.tokens_key if self.tokens_key else 'batch'!r}",
            )
        if tokens.shape[1] - self.label_columns < 1:
            raise ProtocolError(
                "bad_batch", f"data tensor has {tokens.shape[1]} columns, fewer than {self.label_columns + 1}"
            )
        widths = {array.shape[1] for array in found.values()}
        if len(widths) != 1:
            raise ProtocolError("bad_batch", f"the data tensors have different token counts {sorted(widths)}")
        return tokens.shape[0] * (tokens.shape[1] - self.label_columns)

    @property
    def max_rows(self) -> int:
        return self.microbatch_size * (self.max_positions + 1)

    def body_limit(self, codec: Codec) -> int:
        """Tensor bytes a result may carry: a boundary matrix and the data."""
        return codec.wire_bytes(self.max_rows * self.width) + 8 * MAX_BATCH_KEYS * self.max_rows + 65536


@dataclass(frozen=True)
class Accepted:
    result: PipelineResult
    entries: dict[str, bytes]
    """Boundary names (:mod:`.boundaries`) -> the container to keep."""
    rows: int | None = None
    norms: dict[str, tuple[float, int]] | None = None
    """Boundary name -> (L2 norm, values) of its decoded matrix: what :mod:`relay_server.trust.monitor` scores."""


def read_result(body: bytes, step: Step, expected_rows: int | None, shapes: Shapes, codec: Codec) -> Accepted:
    try:
        metadata, tensors = payloads.decode(body, shapes.body_limit(codec))
        result = PipelineResult.loads(metadata.get("result", "").encode())
    except (ProtocolError, ValueError) as exc:
        raise ApiError(
            422,
            getattr(exc, "code", "bad_result"),
            f"the result is not a pipeline result: {exc}",
            "Send the container the toolkit's stage worker builds.",
        ) from None
    if not math.isfinite(result.loss_sum):
        raise ApiError(422, "non_finite", "the result's loss is NaN or Inf", "Lower the learning rate.")
    entries: dict[str, bytes] = {}
    norms: dict[str, tuple[float, int]] = {}
    rows = expected_rows
    try:
        if step.kind == FIRST:  # the rows follow from the data it carries: samples x tokens
            entries["batch"], rows = _batch(tensors, shapes)
            norms["a"] = _rows(tensors, "y", rows, shapes, codec)
            entries["a0"] = _group(tensors, "y")
        elif step.kind == FORWARD:
            norms["a"] = _rows(tensors, "y", expected_rows, shapes, codec)
            entries[f"a{step.stage}"] = _group(tensors, "y")
        elif not step.redo and step.stage > 0:  # LAST or BACKWARD: the gradient of the stage's input
            norms["g"] = _rows(tensors, "g", expected_rows, shapes, codec)
            entries[f"g{step.stage - 1}"] = _group(tensors, "g")
        expected = {"y"} if step.kind in (FIRST, FORWARD) else ({"g"} if entries else set())
        extra = {name.split(".", 1)[0] for name in tensors} - expected - ({"batch"} if step.kind == FIRST else set())
        if extra:
            raise ProtocolError("bad_tensor", f"unexpected tensors {sorted(extra)} in a {step.kind} result")
    except ProtocolError as exc:
        raise ApiError(
            422,
            exc.code,
            f"{step.kind} result for micro-batch {step.microbatch}: {exc}",
            "Nothing of it was used; the task will be re-dispatched.",
        ) from None
    return Accepted(result, entries, rows, norms)


def _rows(
    tensors: dict[str, np.ndarray], name: str, rows: int | None, shapes: Shapes, codec: Codec
) -> tuple[float, int]:
    """Validate the boundary matrix ``name`` (layout, then finite decoded values); its L2 norm
    and size (one BLAS pass over what was just decoded: the monitors' input, nearly free)."""
    array = payloads.read_rows(tensors, name, rows, shapes.width, codec)
    if array.shape[0] > shapes.max_rows:
        raise ProtocolError("bad_tensor", f"{name!r} has {array.shape[0]} rows, at most {shapes.max_rows}")
    return float(np.linalg.norm(array.reshape(-1))), int(array.size)


def _group(tensors: dict[str, np.ndarray], name: str) -> bytes:
    """``name`` and its codec parts, renamed ``v``/``v.<part>``, in a container of their own."""
    return payloads.encode(
        {"v" + key[len(name) :]: array for key, array in tensors.items() if key == name or key.startswith(name + ".")}
    )


def _batch(tensors: dict[str, np.ndarray], shapes: Shapes) -> tuple[bytes, int]:
    """The micro-batch's data, re-wrapped, and the rows its boundary matrices must have."""
    found = {key[len("batch.") :]: array for key, array in tensors.items() if key.startswith("batch.")}
    if "batch" in tensors:
        found[""] = tensors["batch"]
    if not 1 <= len(found) <= MAX_BATCH_KEYS:
        raise ProtocolError(
            "bad_batch",
            f"a first-stage result carries the micro-batch's data as 1 to "
            f"{MAX_BATCH_KEYS} tensors 'batch' or 'batch.<key>'",
        )
    for key, array in found.items():
        if key and not _KEY.fullmatch(key):
            raise ProtocolError("bad_batch", f"data tensor name {key!r} is not lowercase letters and _")
        if (
            array.dtype != np.int64
            or array.ndim != 2
            or array.shape[0] != shapes.microbatch_size
            or not 1 <= array.shape[1] <= shapes.max_positions + 1
        ):
            raise ProtocolError(
                "bad_batch",
                f"data tensor {key or 'batch'!r} must be int64 "
                f"[{shapes.microbatch_size}, <= {shapes.max_positions + 1}], got {array.dtype} "
                f"{list(array.shape)}",
            )
        if array.size and (array.min() < -100 or array.max() >= shapes.vocab):
            raise ProtocolError(
                "bad_batch", f"data tensor {key or 'batch'!r} holds token ids outside [-100, {shapes.vocab})"
            )
    rows = shapes.rows_of_batch(found)
    return payloads.encode({("batch." + key) if key else "batch": array for key, array in found.items()}), rows
