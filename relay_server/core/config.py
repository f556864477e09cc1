"""The run's configuration: one TOML file, overridable by environment variables.

Each section is a keyword-only dataclass with a docstring per field. ``RELAY_<SECTION>_<FIELD>``
overrides a value (``RELAY_SERVER_PORT=9000``), so an organizer can keep one file and tweak a
deployment. Cross-field checks fail early and name the setting to change.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from relay_server.core.connections import ConnectionsSection
from relay_server.core.moe_config import MoeSection
from relay_server.core.run_data import TokenizerSection, resolve_run_data
from relay_server.core.hub_files import download_hub_file
from relay_server.core.typed import ConfigError, apply_env, build_section, set_setting
from toolkit.wire.protocol import ModelSpec

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 (some TPU VMs): the same parser from PyPI
    import tomli as tomllib  # type: ignore[no-redef]


@dataclass(kw_only=True)
class RunSection:
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
    """Codec for gradients and parameters on the wire: "none", "float16" or "int8" (blockwise)."""


@dataclass(kw_only=True)
class ModelSection:
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
    config_file: str = ""
    """kind "transformers": a config.json instead of ``config`` (relative to the run's TOML file)."""
    config_repo: str = ""
    """kind "transformers": "owner/name@revision" on the Hub, whose config.json the relay reads
    (peers receive it as data); pinned, so the run's architecture never moves."""
    init_checkpoint: str = ""
    """Optional safetensors file with initial parameters (else: the factory's init with ``run.seed``)."""

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


@dataclass(kw_only=True)
class OptimizerSection:
    name: str = "adamw"
    """One of "adamw", "adam", "sgd", "lamb"; the relay applies it to the master parameters.
    "lamb" (sahajBERT's): Adam moments with a per-tensor trust ratio (relay_server/rounds/lamb.py);
    with aggregators the plan cuts the vector on tensor boundaries so every trust ratio is whole."""
    lr: float = 1e-3
    """Peak learning rate."""
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """Adam betas."""
    momentum: float = 0.0
    """SGD momentum."""
    eps: float = 1e-8
    lamb_clamp: float = 10.0
    """LAMB: the trust ratio's numerator is min(||w||, lamb_clamp) (0 = no clamp); torch_optimizer's
    clamp_value (default 10; sahajBERT used 10000)."""
    clip_grad_norm: float = 0.0
    """Clip the averaged gradient to this global norm before the step (0 = off). With aggregators
    the relay first collects every slice's squared norm, then each owner clips by the global one."""
    schedule: str = "constant"
    """"constant", "linear" (warmup then linear decay to 0 at total_steps) or "cosine"."""
    warmup_steps: int = 0
    state_bits: int = 32
    """32, or 8: AdamW's moments stored blockwise-quantized (bitsandbytes, CPU): 2.03 instead of 8
    bytes per parameter on the backbone, each step ~5x slower (see benchmarks/memory.py)."""


@dataclass(kw_only=True)
class RoundsSection:
    heartbeat_interval_s: float = 1.0  # how often peers report progress when idle
    peer_ttl_s: float = 6.0
    """A peer silent for this long is offline and leaves the current round."""
    deadline_floor_s: float = 2.0
    """Never close a round's upload window sooner than this after it opens."""
    deadline_ceiling_s: float = 60.0
    """Never keep a round open longer than this, however slow peers were before."""
    deadline_initial_s: float = 30.0  # the upload window before any round timings were observed
    deadline_slack: float = 3.0  # window = slack x p90 of recent arrival times (within floor/ceiling)
    open_round: str = "reported"
    """"reported": a round opens when reported samples reach the target (a step applies T to T + one
    micro-batch per peer); "projected": also counting each other peer's micro-batch in flight (closer to T)."""
    aggregation: str = "mean"
    """"mean" (sample-weighted, streamed: the relay holds one P-sized sum) or "centered_clip"
    (robust to a minority of peers sending outliers: the relay keeps every peer's gradient while a
    round is open, n_peers x P float32 -- 8 peers of a 100M-parameter model need 3.2 GB)."""
    clip_iterations: int = 3  # CenteredClip iterations from the coordinate-wise median (>= 1)
    clip_tau: float = 0.0
    """CenteredClip radius per chunk of 2**20 values; 0 = automatic (clip_tau_scale x the median
    distance of the peers' gradients from the median)."""
    clip_tau_scale: float = 1.0
    """Automatic radius = this x the median residual norm (1-2 barely clips honest peers)."""
    clip_max_weight_ratio: float = 2.0
    """Cap each peer's weight at this multiple of the median weight (0 = no cap): samples are
    self-reported, and an uncapped weight would let one peer own the center."""


@dataclass(kw_only=True)
class ServerSection:
    host: str = "127.0.0.1"
    """Bind address; use 0.0.0.0 on a VM behind a TLS reverse proxy."""
    port: int = 8750
    data_dir: str = "relay-data"
    """Everything that must survive a restart: SQLite store, parameters, optimizer state."""
    keep_checkpoints: int = 3
    """Older step files beyond this many are deleted."""
    fsync: bool = False
    """fsync state files: survives power loss, not just a process crash, at some cost per step."""


@dataclass(kw_only=True)
class AuthSection:
    mode: str = "hf"
    """"hf" (Hugging Face login + allowlist; the default) or "open" (anyone who can reach the
    relay may join and send gradients: local experiments only; logged loudly)."""
    hf_endpoint: str = ""
    """Identity provider for whoami (empty = HF_ENDPOINT or https://huggingface.co)."""
    allow_users: list[str] = field(default_factory=list)
    """Hugging Face usernames allowed to join."""
    allow_orgs: list[str] = field(default_factory=list)
    """Hugging Face organizations whose members may join."""
    allow_any_hf_user: bool = False
    """Admit any Hugging Face account (identity, leaderboard and bans still apply)."""
    pass_ttl_s: float = 3600.0
    """Access pass lifetime; peers refresh at half-life."""
    reauth_after_s: float = 86400.0
    """Refresh passes without the HF token until this long after the last HF check."""
    max_skew_s: float = 60.0
    """Allowed clock offset of a signed request; nonces are remembered for twice this."""
    login_timeout_s: float = 15.0
    """Give up on the identity provider after this long (the login answers 503 with a hint)."""


@dataclass(kw_only=True)
class WandbSection:
    project: str = ""
    """Weights & Biases project for the collaboration's metrics (empty = no W&B logging)."""
    entity: str = ""
    """W&B team or user (empty = the API key's default entity)."""
    mode: str = ""
    """"online", "offline" or "disabled"; empty = W&B's own default (or WANDB_MODE)."""


@dataclass(kw_only=True)
class HubSection:
    repo_id: str = ""
    """Hugging Face Hub model repo that receives checkpoints (empty = no uploads)."""
    every_steps: int = 0
    """Upload a checkpoint every this many steps (0 = never)."""
    private: bool = True
    """Create the repo as private if it does not exist."""
    endpoint: str = ""
    """Hub API endpoint (empty = HF_ENDPOINT or https://huggingface.co)."""
    token_env: str = "HF_TOKEN"
    """Name of the environment variable holding the organizer's write token (never put the token here)."""
    init_from: str = ""
    """Start a new run from a Hub checkpoint: "repo_id" or "repo_id@revision" (ignored on restart)."""


@dataclass(kw_only=True)
class LimitsSection:
    """Token buckets per user (signed requests) or per address (everything unsigned): a bucket
    holds ``*_burst`` requests and refills at ``*_per_s``. Sized to stop floods, not to shape a
    well-behaved peer: a refused heartbeat costs a peer nothing (it reports again next step)."""

    enabled: bool = True
    """Turn every limit off (a benchmark on a private network)."""
    exempt_loopback: bool = True
    """Do not limit unsigned requests from 127.0.0.1/::1 (a local experiment: every peer, script
    and dashboard is loopback). Signed requests are limited per user wherever they come from.
    Logins are limited on loopback too (see ``exempt_loopback_logins``)."""
    exempt_loopback_logins: bool = False
    """Also exempt logins from loopback. Off: behind a proxy that sends no X-Forwarded-For every
    volunteer is 127.0.0.1, and would share one unlimited bucket of whoami calls (issue 17)."""
    trust_forwarded_for: bool = True
    """A loopback request with X-Forwarded-For came through a reverse proxy on this host (the README's
    Caddy / nginx): key it by the header's last hop. No other address may name itself."""
    poll_per_s: float = 50.0
    """Heartbeats, progress and state polls, leave, shard leases: frequent and cheap."""
    poll_burst: float = 500.0
    transfer_per_s: float = 20.0
    """Gradient uploads and parameter downloads: one or two per round per peer."""
    transfer_burst: float = 200.0
    join_per_s: float = 0.5
    """Joins: each one adds a registry entry and a database row."""
    join_burst: float = 30.0
    login_per_s: float = 0.2
    """Logins and pass refreshes, per address (a login calls Hugging Face's rate-limited whoami)."""
    login_burst: float = 10.0
    observe_per_s: float = 10.0
    observe_burst: float = 100.0  # unsigned reads per address: status, run, the dashboard (every 1.5 s)
    tasks_per_s: float = 400.0
    """Expert calls, task polls and results ([moe]: a trainer makes k x layers x 2 per micro-batch)."""
    tasks_burst: float = 4000.0
    auth_failures_per_s: float = 1.0
    """Refused signed requests (bad pass, signature, nonce...) per address: past this the
    address is answered 429 before any signature is checked."""
    auth_failures_burst: float = 50.0


@dataclass(kw_only=True)
class AdminSection:
    token_file: str = ""
    """The organizer's admin token for /api/admin and ``relay-server admin`` (empty =
    <server.data_dir>/admin_token, generated 0600 on first start)."""


@dataclass(kw_only=True)
class AggregatorsSection:
    """Extra aggregator servers (``relay-server aggregator``) and the plan that slices the vector
    among them and the relay (DESIGN.md s5-6). Without registered aggregators none of this runs."""

    heartbeat_interval_s: float = 1.0
    """How often aggregators report to the relay."""
    ttl_s: float = 5.0
    """An aggregator silent this long is dead: the next round recovers its slice and re-plans."""
    call_timeout_s: float = 30.0
    """Relay -> aggregator calls (finalize, assign, state pulls) fail after this long; a failed
    finalize marks the aggregator dead."""
    default_bandwidth_mbps: float = 100.0
    """Bandwidth assumed for a link until a real transfer measured it (Mbit/s)."""
    replan_interval_s: float = 10.0
    """Solve the plan at most this often for changed measurements (membership changes: 1 s)."""
    replan_change: float = 0.2
    """A measurement moving by more than this fraction since the last solve is a material change."""
    min_share_change: float = 0.05
    """Move slices only when some owner's share moves by more than this (a move costs two
    transfers of the whole state through the relay)."""
    state_copy_every: int = 10
    """Pull every aggregator's optimizer state into the relay's recovery copy every this many
    steps (parameters are pulled after every step)."""


@dataclass(kw_only=True)
class RelayConfig:
    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    rounds: RoundsSection = field(default_factory=RoundsSection)
    server: ServerSection = field(default_factory=ServerSection)
    auth: AuthSection = field(default_factory=AuthSection)
    wandb: WandbSection = field(default_factory=WandbSection)
    hub: HubSection = field(default_factory=HubSection)
    limits: LimitsSection = field(default_factory=LimitsSection)
    admin: AdminSection = field(default_factory=AdminSection)
    aggregators: AggregatorsSection = field(default_factory=AggregatorsSection)
    dataset: dict[str, Any] = field(default_factory=dict)
    """Free-form dataset description forwarded to peers (sources, shards, mixing)."""
    tokenizer: TokenizerSection = field(default_factory=TokenizerSection)
    connections: ConnectionsSection = field(default_factory=ConnectionsSection)  # caps, idle and body timeouts
    moe: MoeSection = field(default_factory=MoeSection)  # DMoE layers: experts hosted by volunteers
    objective: dict[str, Any] = field(default_factory=dict)
    """What peers train on: name = "masked-lm" | "causal-lm" | "classification", seq_len, ... (see
    toolkit.data.objectives.ObjectiveConfig); empty = the byte-level stream."""

    def validate(self) -> "RelayConfig":
        checks = [
            (self.run.target_batch > 0, "run.target_batch must be > 0"),
            (self.run.total_steps >= 0, "run.total_steps must be >= 0"),
            (0 <= self.run.max_staleness <= 8, "run.max_staleness must be in 0..8"),
            (self.run.precision in ("", "bf16", "fp16", "fp32"), "run.precision must be bf16, fp16, fp32 or empty"),
            (self.optimizer.name in ("adamw", "adam", "sgd", "lamb"), "optimizer.name must be adamw, adam, sgd or lamb"),
            (self.optimizer.lamb_clamp >= 0, "optimizer.lamb_clamp must be >= 0 (0 = no clamp)"),
            (self.optimizer.schedule in ("constant", "linear", "cosine"), "optimizer.schedule must be constant, linear or cosine"),
            (self.optimizer.lr > 0, "optimizer.lr must be > 0"),
            (self.optimizer.state_bits in (8, 32), "optimizer.state_bits must be 8 or 32"),
            (self.optimizer.state_bits == 32 or self.optimizer.name == "adamw"
             or (self.optimizer.name == "adam" and self.optimizer.weight_decay == 0),
             "optimizer.state_bits = 8 needs optimizer.name = adamw (8-bit Adam decays weights like AdamW)"),
            (self.optimizer.schedule == "constant" or self.run.total_steps > 0,
             "optimizer.schedule linear/cosine needs run.total_steps > 0"),
            (0 < self.rounds.deadline_floor_s <= self.rounds.deadline_ceiling_s,
             "rounds.deadline_floor_s must be > 0 and <= rounds.deadline_ceiling_s"),
            (self.rounds.peer_ttl_s > self.rounds.heartbeat_interval_s,
             "rounds.peer_ttl_s must exceed rounds.heartbeat_interval_s"),
            *self.connections.checks(), *self.moe.checks(self.model),
            (self.auth.mode in ("open", "hf"), "auth.mode must be 'open' or 'hf'"),
            (self.auth.mode != "hf" or bool(self.auth.allow_users or self.auth.allow_orgs or self.auth.allow_any_hf_user),
             "auth.mode = 'hf' needs auth.allow_users, auth.allow_orgs or auth.allow_any_hf_user = true "
             "(or auth.mode = 'open' for a local experiment)"),
            (self.auth.pass_ttl_s >= 60 and self.auth.max_skew_s > 0,
             "auth.pass_ttl_s must be >= 60 and auth.max_skew_s > 0"),
            (self.run.compression in ("none", "float16", "int8"), "run.compression must be none, float16 or int8"),
            (self.wandb.mode in ("", "online", "offline", "disabled"),
             "wandb.mode must be online, offline, disabled or empty"),
            (self.hub.every_steps >= 0, "hub.every_steps must be >= 0"),
            (self.rounds.aggregation in ("mean", "centered_clip") and self.rounds.open_round in ("reported", "projected"),
             "rounds.aggregation must be mean or centered_clip, rounds.open_round reported or projected"),
            (self.rounds.clip_iterations >= 1 and self.rounds.clip_tau >= 0 and self.rounds.clip_tau_scale > 0,
             "rounds.clip_iterations must be >= 1, rounds.clip_tau >= 0 and rounds.clip_tau_scale > 0"),
            (self.rounds.clip_max_weight_ratio == 0 or self.rounds.clip_max_weight_ratio >= 1,
             "rounds.clip_max_weight_ratio must be 0 (no cap) or >= 1"),
            (all(getattr(self.limits, f.name) > 0 for f in dataclasses.fields(self.limits)
                 if f.name.endswith(("_per_s", "_burst"))),
             "every limits.*_per_s and limits.*_burst must be > 0 (limits.enabled = false turns them off)"),
            (not self.hub.every_steps or self.hub.repo_id, "hub.every_steps needs hub.repo_id"),
            (self.model.kind in ("toolkit", "transformers", "module"),
             'model.kind must be "toolkit", "transformers" or "module"'),
            (self.model.kind != "transformers" or bool(self.model.architecture and self.model.config),
             'model.kind = "transformers" needs model.architecture (e.g. "AutoModelForMaskedLM") and '
             "model.config (or model.config_file)"),
            (not (self.hub.init_from and self.model.init_checkpoint),
             "set only one of model.init_checkpoint and hub.init_from"),
            (not self.hub.init_from or bool(re.fullmatch(r"[\w.-]+/[\w.-]+(@[^@\s]+)?", self.hub.init_from)),
             "hub.init_from must be 'owner/name' or 'owner/name@revision'"),
            (self.aggregators.ttl_s > self.aggregators.heartbeat_interval_s > 0, "aggregators.ttl_s must exceed "
             "aggregators.heartbeat_interval_s (> 0)"), (self.aggregators.default_bandwidth_mbps > 0 and self.aggregators.state_copy_every >= 1,
             "aggregators.default_bandwidth_mbps must be > 0 and aggregators.state_copy_every >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        return self


def load_config(path: str | Path | None = None, env: dict[str, str] | None = None,
                overrides: dict[str, dict[str, Any]] | None = None, run_data: bool = True) -> RelayConfig:
    """Read ``path`` (TOML; None = the embedded demo default), apply env then explicit overrides.
    ``run_data=False`` skips reading the tokenizer (``relay-server tokenizer train`` writes it)."""
    if path is None:
        text = resources.files("relay_server").joinpath("defaults/demo.toml").read_text()
    else:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path or 'default config'} is not valid TOML: {exc}") from None
    config = build_section(RelayConfig, raw, "")
    apply_env(config, os.environ if env is None else env)
    for section, values in (overrides or {}).items():
        for key, value in values.items():
            set_setting(config, section, key, value)
    if config.model.config_file or config.model.config_repo:
        config.model.config = _read_model_config(config, Path(path).parent if path is not None else Path.cwd())
    resolve_run_data(config, Path(path).parent if path is not None else Path.cwd(), read_tokenizer=run_data)
    return config.validate()


def _read_model_config(config: RelayConfig, base: Path) -> dict[str, Any]:
    model = config.model
    if model.config or (model.config_file and model.config_repo):
        raise ConfigError("set one of model.config, model.config_file and model.config_repo")
    where = (download_hub_file(config.hub, model.config_repo, "config.json", "model.config_repo")
             if model.config_repo else base / model.config_file)
    try:
        value = json.loads(where.read_text())
    except OSError as exc:
        raise ConfigError(f"model.config_file: cannot read {where}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"model.config_file: {where} is not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"model.config_file: {where} must hold a JSON object (a transformers config.json)")
    return value
