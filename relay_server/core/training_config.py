"""What the collaboration trains and how its steps happen: ``[run]``, ``[model]``, ``[optimizer]``,
``[rounds]``.

Each section is a keyword-only dataclass with a docstring per field (what ``relay-server init``
and the README point organizers to) and a ``checks()`` method: (holds, message) pairs that
:meth:`relay_server.core.config.RelayConfig.validate` evaluates, each message naming the setting
and the values it accepts. Checks that involve two sections live in ``RelayConfig.validate``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from relay_server.core.typed import PATH
from toolkit.wire.compression import codec_error
from toolkit.wire.protocol import ModelSpec
from toolkit.wire.schedule import SCHEDULES

Checks = list[tuple[bool, str]]


@dataclass(kw_only=True)
class RunSection:
    """``[run]``: the experiment as a whole."""

    name: str = "demo"
    """Experiment name shown on the dashboard and in W&B."""
    target_batch: int = 64
    """Global batch B: samples the collaboration accumulates per optimizer step."""
    total_steps: int = 0
    """Stop after this many optimizer steps (0 = run forever). Also the LR schedule's horizon."""
    max_staleness: int = 1
    """Rounds a gradient may lag the master (1 allows delayed parameter updates; 0 = strict)."""
    seed: int = 0
    """Seed for the initial parameters."""
    precision: str = ""
    """Pin one precision policy for every peer ("bf16", "fp16", "fp32"); empty = each peer picks."""
    compression: str = "none"
    """Codec for gradients and parameters on the wire: "none", "float16", "int8" (blockwise) or
    "topk2-<K>" (the K largest of every 4096 values with 2-bit values, error feedback both ways:
    "topk2-64" is 0.29 bits per parameter)."""
    download_compression: str = ""
    """Codec of the parameter deltas the relay broadcasts, when it should differ from
    ``compression`` (which then codes uploads only); empty = the same. E.g. ``compression =
    "topk2-64"`` with ``download_compression = "topk2-256"``: peers' sparse uploads overlap in
    different places, so their mean is denser than any one of them, and a broadcast as sparse as one
    upload would leave the public copy lagging the master (it is still error-fed, never lost)."""
    download_feedback: float = 1.0
    """Share of the broadcast's unsent residual (master - public copy) the relay keeps after each
    version; the rest of the master is pulled back onto the public copy. 1 (default): exact error
    feedback, the public copy converges to the master. Below 1, for a sparse broadcast in local SGD
    (``topk2``): peers compute each pseudo-gradient from the public copy, so they find again what
    the residual still holds and a master that kept all of it counts it twice (measured: the
    master's final loss 9-13% above sync at 1, 1-2.5% at 0.5, ``benchmarks/low_bandwidth.py``).
    Peers are unaffected: they hold the public copy bit for bit either way."""
    mode: str = "sync"
    """"sync": every step's gradient goes to the relay (DeDLOC); "local_sgd": peers train locally
    for ``[local_sgd]``'s budget and send one pseudo-gradient per outer round (low bandwidth)."""

    def checks(self) -> Checks:
        """(holds, message) pairs for :meth:`RelayConfig.validate`."""
        return [
            (self.target_batch > 0, "run.target_batch must be > 0"),
            (self.total_steps >= 0, "run.total_steps must be >= 0"),
            (0 <= self.max_staleness <= 8, "run.max_staleness must be in 0..8"),
            (self.precision in ("", "bf16", "fp16", "fp32"), "run.precision must be bf16, fp16, fp32 or empty"),
            (codec_error(self.compression) is None, f"run.compression: {codec_error(self.compression)}"),
            (
                not self.download_compression or codec_error(self.download_compression) is None,
                f"run.download_compression: {codec_error(self.download_compression or 'none')} (or leave it empty: "
                "the same as run.compression)",
            ),
            (self.mode in ("sync", "local_sgd"), 'run.mode must be "sync" or "local_sgd"'),
            (
                0.0 <= self.download_feedback <= 1.0,
                "run.download_feedback must be in [0, 1] (1: exact error feedback; 0.5 for a sparse broadcast)",
            ),
        ]


@dataclass(kw_only=True)
class ModelSection:
    """``[model]``: the architecture every peer builds, and where its first parameters come from."""

    kind: str = "toolkit"
    """"toolkit" (``factory`` from toolkit.models), "transformers" (``architecture`` + ``config``)
    or "module" (``factory`` from a package every volunteer installs and opts into by name)."""
    factory: str = "toolkit.models:ByteTransformer"
    """Model constructor: ``toolkit.models:<Name>``, or ``package.module:<Name>`` for kind "module"."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the factory."""
    architecture: str = ""
    """kind "transformers": an AutoModel class, e.g. "AutoModelForMaskedLM", "AutoModelForCausalLM"."""
    config: dict[str, Any] = field(default_factory=dict)
    """kind "transformers": the architecture's config as an inline table (``model_type`` + fields)."""
    config_file: str = field(default="", metadata=PATH)
    """kind "transformers": a config.json instead of ``config`` (relative to the run's TOML file)."""
    config_repo: str = ""
    """kind "transformers": "owner/name@revision" on the Hub, whose config.json the relay reads
    (peers receive it as data); pinned, so the run's architecture never moves."""
    init_checkpoint: str = field(default="", metadata=PATH)
    """Optional safetensors file with initial parameters (else: the factory's init with ``run.seed``);
    relative to the run's TOML file, and read when the configuration is loaded."""

    def label(self) -> str:
        """A short name for the dashboard: the factory, or architecture(model_type)."""
        if self.kind == "transformers":
            return f"{self.architecture}({self.config.get('model_type', '?')})"
        return self.factory

    def spec(self) -> ModelSpec:
        """The model as peers receive it in RunInfo (a config_file is sent as its content)."""
        if self.kind == "transformers":
            return ModelSpec(kind="transformers", architecture=self.architecture, config=dict(self.config))
        return ModelSpec(kind=self.kind, factory=self.factory, kwargs=dict(self.kwargs))

    def checks(self) -> Checks:
        """(holds, message) pairs for :meth:`RelayConfig.validate`."""
        return [
            (
                self.kind in ("toolkit", "transformers", "module"),
                'model.kind must be "toolkit", "transformers" or "module"',
            ),
            (
                self.kind != "transformers" or bool(self.architecture and self.config),
                'model.kind = "transformers" needs model.architecture (e.g. "AutoModelForMaskedLM") and '
                "model.config (or model.config_file)",
            ),
        ]


@dataclass(kw_only=True)
class OptimizerSection:
    """``[optimizer]``: the update the relay applies to the master parameters each step."""

    name: str = "adamw"
    """One of "adamw", "adam", "sgd", "lamb"; the relay applies it to the master parameters.
    "lamb" (sahajBERT's): Adam moments with a per-tensor trust ratio (relay_server/rounds/lamb.py);
    with aggregators the plan cuts the vector on tensor boundaries so every trust ratio is whole."""
    lr: float = 1e-3
    """Peak learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW, LAMB) or L2 penalty (Adam, SGD) on matrices; biases and
    norms (parameters with fewer than two dimensions) are never decayed."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """Adam / AdamW / LAMB betas: the decay rates of the first and second moment, each in [0, 1)."""
    momentum: float = 0.0
    """SGD momentum."""
    nesterov: bool = False
    """SGD: Nesterov momentum (needs momentum > 0)."""
    eps: float = 1e-8
    """Added to the second moment's square root (Adam family): keeps tiny moments from exploding a step."""
    lamb_clamp: float = 10.0
    """LAMB: the trust ratio's numerator is min(||w||, lamb_clamp) (0 = no clamp); torch_optimizer's
    clamp_value (default 10; sahajBERT used 10000)."""
    clip_grad_norm: float = 0.0
    """Clip the averaged gradient to this global norm before the step (0 = off). With aggregators
    the relay first collects every slice's squared norm, then each owner clips by the global one."""
    schedule: str = "constant"
    """"constant", "linear" (warmup then linear decay to 0 at total_steps) or "cosine"."""
    warmup_steps: int = 0
    """Steps of linear warmup from 0 to ``lr`` before the schedule starts."""
    state_bits: int = 32
    """32, or 8: AdamW's moments stored blockwise-quantized (bitsandbytes): 2.03 instead of 8 bytes
    per parameter -- on the backbone (CPU, each step ~5x slower; see benchmarks/memory.py), or in
    ``run.mode = "local_sgd"`` on each peer's accelerator, where the inner optimizer runs."""

    def checks(self) -> Checks:
        """(holds, message) pairs for :meth:`RelayConfig.validate`."""
        return [
            (self.name in ("adamw", "adam", "sgd", "lamb"), "optimizer.name must be adamw, adam, sgd or lamb"),
            (self.lr > 0, "optimizer.lr must be > 0"),
            (
                len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
                f"optimizer.betas must be two numbers in [0, 1), e.g. [0.9, 0.999]; got {self.betas}",
            ),
            (self.lamb_clamp >= 0, "optimizer.lamb_clamp must be >= 0 (0 = no clamp)"),
            (self.schedule in SCHEDULES, "optimizer.schedule must be constant, linear or cosine"),
            (self.state_bits in (8, 32), "optimizer.state_bits must be 8 or 32"),
            (
                not self.nesterov or (self.name == "sgd" and self.momentum > 0),
                "optimizer.nesterov = true needs optimizer.name = sgd and optimizer.momentum > 0",
            ),
            (
                self.state_bits == 32 or self.name == "adamw" or (self.name == "adam" and self.weight_decay == 0),
                "optimizer.state_bits = 8 needs optimizer.name = adamw (8-bit Adam decays weights like AdamW)",
            ),
        ]


@dataclass(kw_only=True)
class RoundsSection:
    """``[rounds]``: when a round opens and closes, and how the peers' gradients are combined."""

    heartbeat_interval_s: float = 1.0
    """How often peers report progress while they have nothing else to send."""
    peer_ttl_s: float = 6.0
    """A peer silent for this long is offline and leaves the current round."""
    deadline_floor_s: float = 2.0
    """Never close a round's upload window sooner than this after it opens."""
    deadline_ceiling_s: float = 60.0
    """Never keep a round open longer than this, however slow peers were before."""
    deadline_initial_s: float = 30.0
    """The upload window before any round's arrival times were observed."""
    deadline_slack: float = 3.0
    """Upload window = this x the 90th percentile of recent arrival times (within floor and ceiling)."""
    open_round: str = "reported"
    """"reported": a round opens when reported samples reach the target (a step applies T to T + one
    micro-batch per peer); "projected": also counting each other peer's micro-batch in flight (closer to T)."""
    aggregation: str = "mean"
    """"mean" (sample-weighted, streamed: the relay holds one P-sized sum) or "centered_clip"
    (robust to a minority of peers sending outliers: the relay keeps every peer's gradient while a
    round is open, n_peers x P float32 -- 8 peers of a 100M-parameter model need 3.2 GB)."""
    clip_iterations: int = 3
    """CenteredClip iterations, starting from the coordinate-wise median (>= 1)."""
    clip_tau: float = 0.0
    """CenteredClip radius per chunk of 2**20 values; 0 = automatic (clip_tau_scale x the median
    distance of the peers' gradients from the median)."""
    clip_tau_scale: float = 1.0
    """Automatic radius = this x the median residual norm (1-2 barely clips honest peers)."""
    clip_max_weight_ratio: float = 2.0
    """Cap each peer's weight at this multiple of the median weight (0 = no cap): samples are
    self-reported, and an uncapped weight would let one peer own the center."""

    def checks(self) -> Checks:
        """(holds, message) pairs for :meth:`RelayConfig.validate`."""
        return [
            (
                0 < self.deadline_floor_s <= self.deadline_ceiling_s,
                "rounds.deadline_floor_s must be > 0 and <= rounds.deadline_ceiling_s",
            ),
            (self.peer_ttl_s > self.heartbeat_interval_s, "rounds.peer_ttl_s must exceed rounds.heartbeat_interval_s"),
            (self.open_round in ("reported", "projected"), "rounds.open_round must be reported or projected"),
            (self.aggregation in ("mean", "centered_clip"), "rounds.aggregation must be mean or centered_clip"),
            (
                self.clip_iterations >= 1 and self.clip_tau >= 0 and self.clip_tau_scale > 0,
                "rounds.clip_iterations must be >= 1, rounds.clip_tau >= 0 and rounds.clip_tau_scale > 0",
            ),
            (
                self.clip_max_weight_ratio == 0 or self.clip_max_weight_ratio >= 1,
                "rounds.clip_max_weight_ratio must be 0 (no cap) or >= 1",
            ),
        ]
