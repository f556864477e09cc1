"""The run's configuration: one TOML file, overridable by environment variables.

The sections, each a keyword-only dataclass with a docstring per field, live by concern:
``[run]``, ``[model]``, ``[optimizer]``, ``[rounds]`` in :mod:`.training_config`; ``[server]``,
``[auth]``, ``[limits]``, ``[admin]``, ``[wandb]``, ``[hub]``, ``[aggregators]`` in
:mod:`.service_config`; ``[connections]`` in :mod:`.connections`; ``[moe]`` in :mod:`relay_server.moe.moe_config`;
``[tokenizer]`` (and the checks of ``[objective]``) in :mod:`.run_data`; ``[evaluation]`` in
:mod:`relay_server.evaluation.evaluation_config`; ``[pipeline]`` in
:mod:`relay_server.pipeline.pipeline_config`. ``[dataset]`` and ``[objective]`` are free-form tables the toolkit
reads (:class:`RelayConfig` says where). Everything is importable from here.

**Types.** Every value is checked against its field's type, from the file and from the
environment alike (:mod:`.typed` states the rules); a wrong one ends in one line naming the setting.

**Environment overrides.** ``RELAY_<SECTION>_<FIELD>`` overrides one field
(``RELAY_RUN_TARGET_BATCH=4096``); ``RELAY_DATASET`` / ``RELAY_OBJECTIVE`` replace those tables
whole. Lists are written as an array or comma-separated (``RELAY_AUTH_ALLOW_USERS=alice,bob``,
``RELAY_AUTH_ALLOW_USERS='["alice", "bob"]'``, ``RELAY_MOE_GRID=4,4``,
``RELAY_OPTIMIZER_BETAS='[0.9, 0.95]'``), tables as a TOML inline table or JSON object
(``RELAY_MOE_EXPERT='{ kind = "ffn", d = 32, hidden = 64 }'``). An override that names no setting
is refused like a misspelled key (:mod:`.overrides`). Order: file, then environment, then the
command line (``relay-server serve --port/--host/--data-dir``).

**Paths.** A relative path written in the file (``server.data_dir``, ``model.config_file``,
``model.init_checkpoint``, ``tokenizer.file``, ``admin.token_file``, local ``data_files`` of
``[[dataset.sources]]`` and of ``[evaluation]``) is resolved against the file's directory, so
``relay-server serve --config ../org/run.toml`` finds the same run from anywhere; one given in the environment or on
the command line is resolved against the working directory, as any shell path. After loading,
every path is absolute. ``server.data_dir`` has no default: ``relay-server serve`` refuses
without one rather than start a new run in whatever directory it was started from.

Cross-section checks fail before anything is created and name the setting to change. They run
before the checks that build the model or read the tokenizer (:mod:`.model_checks`, seconds of CPU
for a transformers model), so a mistake in the file's own settings is refused at once.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from relay_server.core.connections import ConnectionsSection
from relay_server.core.hub_files import download_hub_file
from relay_server.core.overrides import apply_env
from relay_server.core.run_data import TokenizerSection, resolve_run_data
from relay_server.core.service_config import (
    AdminSection,
    AggregatorsSection,
    AuthSection,
    HubSection,
    LimitsSection,
    ServerSection,
    WandbSection,
)
from relay_server.core.training_config import ModelSection, OptimizerSection, RoundsSection, RunSection
from relay_server.core.typed import ConfigError, build_section, path_settings, set_setting
from relay_server.evaluation.evaluation_config import EvaluationSection, check_evaluation
from relay_server.local_sgd.local_sgd_config import LocalSgdSection, mode_checks
from relay_server.moe.moe_config import MoeSection
from relay_server.pipeline.pipeline_config import PipelineSection

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 (some TPU VMs): the same parser from PyPI
    import tomli as tomllib

__all__ = [
    "AdminSection",
    "AggregatorsSection",
    "AuthSection",
    "ConfigError",
    "ConnectionsSection",
    "EvaluationSection",
    "HubSection",
    "LimitsSection",
    "LocalSgdSection",
    "ModelSection",
    "MoeSection",
    "OptimizerSection",
    "PipelineSection",
    "RelayConfig",
    "RoundsSection",
    "RunSection",
    "ServerSection",
    "TokenizerSection",
    "WandbSection",
    "load_config",
    "resolve_paths",
]


@dataclass(kw_only=True)
class RelayConfig:
    """The whole run: one field per TOML section."""

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
    """Free-form dataset description forwarded to peers (sources, shards, mixing), checked by the
    toolkit's :class:`toolkit.data.StreamConfig` where it is read."""
    tokenizer: TokenizerSection = field(default_factory=TokenizerSection)
    connections: ConnectionsSection = field(default_factory=ConnectionsSection)
    """Connection caps, idle and body timeouts, upload bytes in flight."""
    moe: MoeSection = field(default_factory=MoeSection)
    """DMoE layers: experts hosted by volunteers, calls brokered by the relay."""
    pipeline: PipelineSection = field(default_factory=PipelineSection)
    """A model cut into stages that volunteers run; the relay holds the boundaries."""
    evaluation: EvaluationSection = field(default_factory=EvaluationSection)
    """Held-out validation and live samples of the published versions, off the round's path."""
    local_sgd: LocalSgdSection = field(default_factory=LocalSgdSection)
    """The inner budget and outer optimizer of ``run.mode = "local_sgd"``."""
    objective: dict[str, Any] = field(default_factory=dict)
    """What peers train on: name = "masked-lm" | "causal-lm" | "classification", seq_len, ... (see
    toolkit.data.objectives.ObjectiveConfig); empty = the byte-level stream."""

    def validate(self) -> "RelayConfig":
        """Every section's own checks, then those that involve two sections; the first failure
        raises its message."""
        checks = [
            *self.run.checks(),
            *self.model.checks(),
            *self.optimizer.checks(),
            *self.rounds.checks(),
            *self.server.checks(),
            *self.auth.checks(),
            *self.wandb.checks(),
            *self.hub.checks(),
            *self.limits.checks(),
            *self.aggregators.checks(),
            *self.connections.checks(),
            *self.moe.checks(self.model),
            *self.evaluation.checks(),
            *self.pipeline.checks(self.run.target_batch, self.run.max_staleness, self.moe.enabled),
            (
                self.optimizer.schedule == "constant" or self.run.total_steps > 0,
                "optimizer.schedule linear/cosine needs run.total_steps > 0",
            ),
            (
                not (self.hub.init_from and self.model.init_checkpoint),
                "set only one of model.init_checkpoint and hub.init_from",
            ),
            (
                not (self.pipeline.enabled and self.run.compression.startswith("topk2-")),
                f"run.compression = {self.run.compression!r}: pipeline stages upload their gradients without "
                "error feedback, so a sparse codec would drop most of each; use none, float16 or int8 with [pipeline]",
            ),
            (
                not (self.pipeline.enabled and self.run.download_compression not in ("", self.run.compression)),
                "run.download_compression: [pipeline] stages publish in run.compression; leave it empty",
            ),
            *mode_checks(self),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        return self

    def volunteer_extras(self) -> str:
        """The collabtrain extras a volunteer's install needs for this run, comma-separated
        (``GET /api/toolkit``; ``relay-server notebook`` writes them into the one cell): ``hf``
        always, ``peer8bit`` (bitsandbytes) where local SGD keeps the peers' inner state in 8 bits."""
        eight_bit = self.run.mode == "local_sgd" and self.optimizer.state_bits == 8
        return "hf,peer8bit" if eight_bit else "hf"

    def master_optimizer(self) -> OptimizerSection:
        """The optimizer the relay applies to the master parameters: ``[optimizer]`` in sync mode,
        the outer SGD of ``[local_sgd]`` in local SGD mode (where ``[optimizer]`` runs on the peers)."""
        return self.local_sgd.outer_optimizer() if self.run.mode == "local_sgd" else self.optimizer


def load_config(
    path: str | Path | None = None,
    env: dict[str, str] | None = None,
    overrides: dict[str, dict[str, Any]] | None = None,
    run_data: bool = True,
) -> RelayConfig:
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
    base = Path(path).absolute().parent if path is not None else Path.cwd()
    config = build_section(RelayConfig, raw, "")
    resolve_paths(config, base)  # paths written in the file: against its directory
    apply_env(config, os.environ if env is None else env)
    for section, values in (overrides or {}).items():
        for key, value in values.items():
            set_setting(config, section, key, value)
    resolve_paths(config, Path.cwd())  # the environment's and the command line's: against the working directory
    if config.model.config_file or config.model.config_repo:
        config.model.config = _read_model_config(config)
    if config.model.init_checkpoint and not Path(config.model.init_checkpoint).is_file():
        raise ConfigError(
            f"model.init_checkpoint: no file {config.model.init_checkpoint} (relative paths "
            "start at the config file's directory)"
        )
    config.validate()  # cheap checks first: a missing allowlist must not wait for the model to be built
    tokenizer = resolve_run_data(config, base, read_tokenizer=run_data)  # the tokenizer, then the model's checks
    check_evaluation(config, tokenizer)  # needs the tokenizer (the mask token) and the other sections
    return config


def resolve_paths(config: RelayConfig, base: Path) -> None:
    """Make every relative path setting absolute against ``base`` (empty ones stay empty)."""
    for section in dataclasses.fields(config):
        value = getattr(config, section.name)
        if dataclasses.is_dataclass(value):
            for name in path_settings(value):
                if getattr(value, name):
                    setattr(value, name, _absolute(getattr(value, name), base))
    if not config.evaluation.repo:  # local validation files, like [[dataset.sources]] without a repo
        config.evaluation.data_files = [_local(f, base) for f in config.evaluation.data_files]
    for source in config.dataset.get("sources") or []:
        if isinstance(source, dict) and not source.get("repo"):
            files = source.get("data_files")
            if isinstance(files, (str, list)):
                resolved = [_local(f, base) for f in ([files] if isinstance(files, str) else files)]
                source["data_files"] = resolved[0] if isinstance(files, str) else resolved


def _local(pattern: Any, base: Path) -> Any:
    """A local shard path or glob, made absolute; URLs (``hf://...``) and non-strings unchanged."""
    return pattern if not isinstance(pattern, str) or "://" in pattern else _absolute(pattern, base)


def _absolute(path: str, base: Path) -> str:
    """``path`` (``~`` expanded) against ``base``, normalized (``org/../x`` is ``x``); symlinks kept."""
    return os.path.normpath(base / Path(path).expanduser())


def _read_model_config(config: RelayConfig) -> dict[str, Any]:
    model = config.model
    if model.config or (model.config_file and model.config_repo):
        raise ConfigError("set one of model.config, model.config_file and model.config_repo")
    where = (
        download_hub_file(config.hub, model.config_repo, "config.json", "model.config_repo")
        if model.config_repo
        else Path(model.config_file)
    )
    try:
        value = json.loads(where.read_text())
    except OSError as exc:
        raise ConfigError(f"model.config_file: cannot read {where}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"model.config_file: {where} is not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"model.config_file: {where} must hold a JSON object (a transformers config.json)")
    return value
