"""The bytes of expert calls, tasks and checkpoints, shared by trainers, hosts, stage workers and
the relay: the tensor-message codec both DMoE and the staged pipeline speak.

Every body is one safetensors container (:mod:`toolkit.wire.tensor_container`), float32 only:

* a call (trainer -> relay): ``x`` [rows, d], and for a backward ``g`` [rows, d] (the gradient of
  the expert's output); the answer is ``y`` [rows, d] (forward) or ``g`` [rows, d] (d loss / d x).
  With an activation codec (``[moe] codec``: float16 or int8, :mod:`toolkit.wire.compression`)
  each of these travels as the codec's tensors ``<name>.<part>`` (e.g. ``x.scales``,
  ``x.payload``), validated against the codec's layout and decoded to float32 by its reader;
  a pipeline boundary may also travel as ``lowrank-<r>`` factors (``<name>.s``, ``<name>.p``,
  ``<name>.q``: :mod:`toolkit.wire.compression.lowrank`), which only matrices can;
* a task batch (relay -> host): tensor ``{i}`` (uint8) is task ``i``'s call body verbatim, metadata
  ``tasks`` a :class:`~toolkit.wire.protocol.TaskBatch` (task_id, uid, kind, rows of each); a
  result (host -> relay) is the call's answer;
* a checkpoint: ``p.<param>`` and ``opt.<param>.<state>`` tensors, metadata ``updates``.

:func:`decode` refuses anything but exactly one container with nothing after it, and
:func:`rows_of` anything but a finite float32 matrix of the expected shape: a NaN or a wrong
shape from a hostile host never reaches a trainer.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping

import numpy as np

from toolkit.errors import ProtocolError
from toolkit.wire.compression import Codec, LowRankCodec, get_codec
from toolkit.wire.compression.lowrank import PARTS as LOWRANK_PARTS
from toolkit.wire.protocol import TaskBatch, TaskHead
from toolkit.wire.tensor_container import encode_header, peek_header, read_container

KINDS = ("forward", "backward")
RESULT_VERSION = "version"
"""A host's result's metadata key: the version of the expert it computed it on (the optimizer steps
the expert holds; its checkpoints' ``updates``), which the relay's spot checks compute it again at."""
NONE = get_codec("none")


def encode(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> bytes:
    items = [(name, np.ascontiguousarray(array)) for name, array in tensors.items()]
    # one copy of each tensor's bytes (into the joined body), none in between
    return b"".join(
        [encode_header(items, dict(metadata or {})), *(a.reshape(-1).view(np.uint8).data for _, a in items)]
    )


def decode(body: bytes, max_bytes: int) -> tuple[dict[str, str], dict[str, np.ndarray]]:
    """Tensors and metadata of ``body``; at most ``max_bytes`` of tensor data, nothing after it."""
    stream = io.BytesIO(body)
    header = peek_header(stream, max_bytes)
    if header.header_bytes + header.data_bytes != len(body):
        raise ProtocolError(
            "bad_body",
            f"the body is {len(body)} bytes; its container declares {header.header_bytes + header.data_bytes}",
        )
    _, tensors = read_container(stream, max_bytes, header=header)
    return dict(header.metadata), tensors


def rows_of(tensors: Mapping[str, np.ndarray], name: str, rows: int | None, width: int) -> np.ndarray:
    """``tensors[name]`` if it is a finite float32 [rows, width] matrix (any rows if None)."""
    array = tensors.get(name)
    if array is None:
        raise ProtocolError("bad_tensor", f"tensor {name!r} is missing")
    if (
        array.dtype != np.float32
        or array.ndim != 2
        or array.shape[1] != width
        or (rows is not None and array.shape[0] != rows)
        or array.shape[0] < 1
    ):
        want = f"[{rows if rows is not None else 'rows'}, {width}]"
        raise ProtocolError(
            "bad_tensor", f"tensor {name!r} must be float32 {want}, got {array.dtype} {list(array.shape)}"
        )
    if not np.isfinite(array).all():
        raise ProtocolError("non_finite", f"tensor {name!r} holds NaN or Inf")
    return array


def encode_rows(name: str, array: np.ndarray, codec: Codec = NONE) -> dict[str, np.ndarray]:
    """``array`` [rows, d] as the tensors of ``codec`` (just ``{name: array}`` without one)."""
    array = np.ascontiguousarray(array, dtype=np.float32)
    if isinstance(codec, LowRankCodec):
        return {f"{name}.{part}": tensor for part, tensor in codec.encode_matrix(array)}
    if _dense(codec).name == "none":
        return {name: array}
    return {f"{name}.{part}": tensor for part, tensor in codec.encode(array.reshape(-1))}


def row_names(name: str, codec: Codec = NONE) -> set[str]:
    """The tensor names :func:`encode_rows` gives ``name``."""
    if isinstance(codec, LowRankCodec):
        return {f"{name}.{part}" for part in LOWRANK_PARTS}
    return {name} if _dense(codec).name == "none" else {f"{name}.{spec.name}" for spec in codec.layout(1)}


def read_rows(
    tensors: Mapping[str, np.ndarray], name: str, rows: int | None, width: int, codec: Codec = NONE
) -> np.ndarray:
    """The float32 [rows, width] matrix ``name`` encodes with ``codec``: layout checked against
    the codec before decoding, values finite (:func:`rows_of`)."""
    parts = {k[len(name) + 1 :]: v for k, v in tensors.items() if k.startswith(name + ".")}
    if isinstance(codec, LowRankCodec):
        return rows_of({name: codec.read_matrix(parts, rows, width)}, name, rows, width)
    if _dense(codec).name == "none":
        return rows_of(tensors, name, rows, width)
    payload = parts.get("payload")
    if (
        payload is None
        or payload.ndim != 1
        or payload.size % width
        or (rows is not None and payload.size != rows * width)
    ):
        raise ProtocolError(
            "bad_tensor", f"{name!r} must carry {codec.name} tensors for [{rows or 'rows'}, {width}] values"
        )
    side = {k: v for k, v in parts.items() if k != "payload"}
    codec.validate(side, payload.dtype, payload.size)
    decoded = codec.decode([*side.items(), ("payload", payload)]).reshape(-1, width)
    return rows_of({name: decoded}, name, rows, width)


def _dense(codec: Codec) -> Codec:
    """``codec`` if it is dense (element i of its payload encodes value i of the rows); a sparse
    codec (``topk2-<K>``) cannot carry activations and is refused in one line."""
    if not codec.dense:
        raise ValueError(
            f"codec {codec.name!r} is sparse: activations and boundaries travel in a dense codec "
            "(none, float16 or int8); topk2-<K> is for run.compression only"
        )
    return codec


def call_body(x: np.ndarray, g: np.ndarray | None = None, codec: Codec = NONE) -> bytes:
    tensors = encode_rows("x", x, codec)
    if g is not None:
        tensors.update(encode_rows("g", g, codec))
    return encode(tensors)


def task_batch(heads: list[TaskHead], bodies: list[bytes]) -> bytes:
    """The tasks a host leased, each call's body as it came (validated once, when the relay took
    the call): tensor ``{i}`` holds task ``i``'s container bytes verbatim, so a lease costs one
    copy of the bytes and no decoding or re-encoding of any tensor."""
    tensors = {str(i): np.frombuffer(body, dtype=np.uint8) for i, body in enumerate(bodies)}
    return encode(tensors, {"tasks": TaskBatch(tasks=list(heads)).dumps().decode()})


def read_task_batch(
    body: bytes, max_bytes: int, width: int, codec: Codec = NONE
) -> list[tuple[TaskHead, dict[str, np.ndarray]]]:
    """Each task of a batch and its rows (``x``, and ``g`` for a backward), every tensor checked
    against the task's head and the run's codec: a host trusts no byte it did not validate."""
    metadata, tensors = decode(body, max_bytes)
    try:
        heads = TaskBatch.loads(metadata.get("tasks", "")).tasks
    except ProtocolError:
        raise ProtocolError("bad_meta", "the task batch has no readable task list") from None
    if set(tensors) != {str(i) for i in range(len(heads))}:
        raise ProtocolError("bad_body", f"a batch of {len(heads)} tasks carries tensors 0..{len(heads) - 1}")
    out = []
    for i, head in enumerate(heads):
        call = tensors[str(i)]
        if call.dtype != np.uint8 or call.ndim != 1:
            raise ProtocolError("bad_body", f"task {i}'s body must be uint8 bytes")
        _, inner = decode(call.tobytes(), call.size)
        names = ("x", "g") if head.kind == "backward" else ("x",)
        out.append((head, {n: read_rows(inner, n, head.rows, width, codec) for n in names}))
    return out


def checkpoint_tensors(
    params: Mapping[str, np.ndarray],
    optimizer: Mapping[str, np.ndarray],
) -> list[tuple[str, np.ndarray]]:
    tensors = {**{f"p.{k}": v for k, v in params.items()}, **{f"opt.{k}": v for k, v in optimizer.items()}}
    return [(k, np.ascontiguousarray(v, dtype=np.float32)) for k, v in tensors.items()]


def checkpoint_body(params: Mapping[str, np.ndarray], optimizer: Mapping[str, np.ndarray], updates: int) -> bytes:
    return encode(dict(checkpoint_tensors(params, optimizer)), {"updates": str(updates)})


def checkpoint_limit(shapes: Mapping[str, tuple[int, ...]]) -> int:
    """Tensor bytes of a checkpoint at most: the parameters and up to three optimizer states each."""
    return 4 * 4 * sum(math.prod(s) for s in shapes.values())


def read_checkpoint(body: bytes, shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, dict[str, np.ndarray]]:
    """Validate a checkpoint against the expert's parameter ``shapes``: its ``updates`` and its
    tensors. Optimizer state tensors may be scalars or have their parameter's shape (momentum,
    Adam's moments); :func:`checkpoint_limit` bounds how many."""
    metadata, tensors = decode(body, checkpoint_limit(shapes) + 4096)
    if set(k[2:] for k in tensors if k.startswith("p.")) != set(shapes):
        raise ProtocolError("bad_checkpoint", f"a checkpoint holds exactly the parameters {sorted(shapes)}")
    for name, array in tensors.items():
        kind, _, rest = name.partition(".")
        param = rest if kind == "p" else rest.rsplit(".", 1)[0]
        if kind not in ("p", "opt") or param not in shapes or array.dtype != np.float32:
            raise ProtocolError("bad_checkpoint", f"unexpected tensor {name!r} ({array.dtype})")
        if array.shape != tuple(shapes[param]) and not (kind == "opt" and array.size == 1):
            raise ProtocolError(
                "bad_checkpoint", f"{name!r} has shape {list(array.shape)}, expected {list(shapes[param])}"
            )
        if not np.isfinite(array).all():
            raise ProtocolError("non_finite", f"{name!r} holds NaN or Inf")
    try:
        return int(metadata.get("updates", "0")), tensors
    except ValueError:
        raise ProtocolError("bad_checkpoint", "updates must be an integer") from None
