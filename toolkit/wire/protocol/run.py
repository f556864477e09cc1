"""The run as peers and aggregators receive it: the model to build, the flat parameter vector's
layout, and the settings every peer must share (batch, staleness, precision, codec, data).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from toolkit.wire.protocol.routes import _HEX64, _NAME, _NONNEG
from toolkit.wire.schema import Schema, limits


@dataclass(frozen=True, kw_only=True)
class ParamSpec(Schema):
    """One model parameter as the flat vector lays it out: ``flat[offset:offset+numel]``."""

    name: str = field(metadata=limits(max_len=512))
    shape: list[int]
    offset: int = field(metadata=_NONNEG)


@dataclass(frozen=True, kw_only=True)
class ModelSpec(Schema):
    """How peers build the run's model, as data: peers import code only from what they installed,
    never code chosen by the network (:func:`toolkit.models.build_model` enforces it).

    * ``kind = "toolkit"``: ``factory`` is ``toolkit.models:<Name>`` with ``kwargs``;
    * ``kind = "transformers"``: ``architecture`` is an ``AutoModel*`` class of the installed
      transformers and ``config`` its config (``model_type`` + fields); no remote code, ever;
    * ``kind = "module"``: ``factory`` is ``package.module:Name`` from a package the volunteer
      installed and named in ``join(..., trusted_models=[package])``; refused otherwise.
    """

    kind: str = field(default="toolkit", metadata=limits(choices=("toolkit", "transformers", "module")))
    factory: str = field(default="", metadata=_NAME)
    kwargs: dict[str, Any] = field(default_factory=dict)
    architecture: str = field(default="", metadata=_NAME)
    config: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class RunInfo(Schema):
    run_name: str = field(metadata=_NAME)
    protocol: int
    model: ModelSpec
    layout: list[ParamSpec]
    num_params: int = field(metadata=limits(gt=0))
    target_batch: int = field(metadata=limits(gt=0))
    total_steps: int = field(metadata=_NONNEG)
    max_staleness: int = field(metadata=limits(ge=0, le=8))
    heartbeat_interval_s: float = field(metadata=limits(gt=0))
    precision: str | None = None
    auth: str = field(default="open", metadata=limits(choices=("open", "hf")))
    """"hf": log in with a Hugging Face token (``RelayClient.login``) before joining."""
    compression: str = field(default="none", metadata=limits(pattern=r"none|float16|int8|topk2-[0-9]{1,4}"))
    """The codec of gradient uploads and parameter deltas (:mod:`toolkit.wire.compression`; the
    peer's ``get_codec`` checks a ``topk2-<K>``'s K)."""
    download_compression: str = field(default="", metadata=limits(pattern=r"|none|float16|int8|topk2-[0-9]{1,4}"))
    """The codec of parameter deltas when it differs from ``compression`` (empty: the same)."""
    download_feedback: float = field(default=1.0, metadata=limits(ge=0, le=1))
    """Share of the broadcast's residual an owner of the master keeps per version (aggregators
    publish their slices' deltas with it; peers need not read it)."""
    dataset: dict[str, Any] = field(default_factory=dict)
    wandb: dict[str, str] = field(default_factory=dict)
    """Where peers log their own W&B runs: {"project", "entity"} (empty: nowhere)."""
    tokenizer_sha256: str = field(default="", metadata=_HEX64)
    """sha256 of the run's ``tokenizer.json`` (``GET /api/tokenizer``); empty: the run has none."""
    objective: dict[str, Any] = field(default_factory=dict)
    """The run's ``[objective]`` (:class:`toolkit.data.objectives.ObjectiveConfig`); empty: none."""
    local_sgd: dict[str, Any] = field(default_factory=dict)
    """``run.mode = "local_sgd"``: the inner optimizer and budget (:mod:`toolkit.optimizer.local_sgd`);
    empty: sync mode, every step's gradient goes to the relay."""
    pipeline: dict[str, Any] = field(default_factory=dict)
    """The run's ``[pipeline]`` as workers need it (stages, micro-batch size, boundary codec) when
    the model is cut into stages (:mod:`toolkit.pipeline`); empty: every peer trains the whole model."""
