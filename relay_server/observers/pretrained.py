"""A relay version as a folder users load with their usual tools.

For a transformers run that is ``save_pretrained``'s layout: ``config.json`` (the run's config,
with ``architectures``), ``model.safetensors`` holding the architecture's own parameter names
(shared and tied weights once, as ``from_pretrained`` expects; it re-ties them on load), and the
run's tokenizer as ``AutoTokenizer`` loads it, special tokens at their own ids
(:mod:`.hf_tokenizer`). For the toolkit's own models it is ``model.safetensors`` plus
``collabtrain-model.json`` (the ModelSpec to build it with ``toolkit.models.build_model``).

Used by Hub checkpoints (each upload is such a folder plus the relay's own state) and by
``relay-server export`` for a local checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from relay_server.core.config import ConfigError, RelayConfig
from relay_server.observers.hf_tokenizer import RunTokenizer, run_tokenizer, write_tokenizer
from relay_server.rounds.store import Store
from toolkit.models import build_own_model
from toolkit.models.hf import transformers_config

MODEL_FILE = "model.safetensors"
SPEC_FILE = "collabtrain-model.json"


def config_json(config: RelayConfig, tokenizer: RunTokenizer | None = None) -> str | None:
    """The transformers ``config.json`` of the run's model (None for the toolkit's models), with
    the special token ids of ``tokenizer`` where the run's config leaves them to the model type's
    defaults (GPT-2's eos 50256 is no token of a 64-token vocabulary)."""
    if config.model.kind != "transformers":
        return None
    auto, cfg = transformers_config(config.model.architecture, config.model.config)
    with torch.device("meta"):  # only the concrete class's name is wanted, not its weights
        model = auto.from_config(cfg)
    cfg.architectures = [type(model).__name__]
    for name, value in (tokenizer.token_ids() if tokenizer else {}).items():
        if name not in config.model.config and hasattr(cfg, name):
            setattr(cfg, name, value)
    return cfg.to_json_string()


def write_pretrained(
    config: RelayConfig, tensors: dict[str, torch.Tensor], out_dir: Path, metadata: dict[str, str] | None = None
) -> list[Path]:
    """Write the folder; returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / MODEL_FILE]
    save_file(tensors, str(written[0]), metadata={**(metadata or {}), "format": "pt"})
    tokenizer = run_tokenizer(config)
    cfg = config_json(config, tokenizer)
    if cfg is not None:
        (out_dir / "config.json").write_text(cfg)
        written.append(out_dir / "config.json")
    else:
        (out_dir / SPEC_FILE).write_text(json.dumps(config.model.spec().to_json(), indent=1))
        written.append(out_dir / SPEC_FILE)
    if tokenizer is not None:
        written += write_tokenizer(tokenizer, out_dir)
    for path in written:  # a checkpoint is for others to load: readable, whatever the umask or the writer
        path.chmod(0o644)
    return written


def parameter_names(config: RelayConfig) -> list[tuple[str, torch.Size]]:
    """(name, shape) of the run's parameters in flat-vector order (``master.layout_of``).

    Built on the meta device: the relay already holds the parameters, a second real copy of a
    large model would only cost memory."""
    spec = config.model.spec()
    try:
        with torch.device("meta"):
            model = build_own_model(spec)
    except Exception:  # a factory that computes on its tensors at init: build it for real once
        model = build_own_model(spec)
    return [(name, p.shape) for name, p in model.named_parameters()]


def unflatten(flat: torch.Tensor, names: list[tuple[str, torch.Size]]) -> dict[str, torch.Tensor]:
    """The flat (P,) vector as named tensors (copies: safetensors refuses tensors sharing memory)."""
    total = sum(shape.numel() for _, shape in names)
    if flat.numel() != total:
        raise ValueError(f"checkpoint holds {flat.numel()} parameters, the model has {total}")
    out, offset = {}, 0
    for name, shape in names:
        out[name] = flat[offset : offset + shape.numel()].reshape(shape).clone()
        offset += shape.numel()
    return out


def master_params(state_path: Path) -> torch.Tensor:
    """The master parameters (P,) of a relay state file. With a lossy wire codec the file holds
    both the copy peers hold ("params") and the exact master ("master"); a checkpoint is the master."""
    with safe_open(str(state_path), framework="pt") as f:
        return _master_of(f)


def _master_of(state: Any) -> torch.Tensor:
    """The master parameters of an open state file (``safe_open``'s handle)."""
    return state.get_tensor("master" if "master" in state.keys() else "params")


def export_version(
    config: RelayConfig, data_dir: Path, out_dir: Path, step: int | None = None, *, config_source: str = "the config"
) -> int:
    """Write version ``step`` (default: the latest) of the relay state in ``data_dir`` as a
    loadable folder; returns the step written. A ``config`` of another run than the one in
    ``data_dir`` (``config_source`` says where it came from) is refused before anything is written."""
    try:  # a read-only snapshot: the relay may be running (Store.reader says why it is consistent)
        store = Store.reader(data_dir)
    except FileNotFoundError:
        raise ConfigError(
            f"{data_dir} holds no version yet: point --data-dir at the relay's server.data_dir"
        ) from None
    try:
        step = store.latest_step() if step is None else step
        if step is None:
            raise ConfigError(f"{data_dir} holds no version yet: point --data-dir at the relay's server.data_dir")
        path = store.state_path(step)
        try:  # opened once: the file stays readable even if the relay prunes it meanwhile
            with safe_open(str(path), framework="pt") as f:
                flat = _master_of(f)
                run = (f.metadata() or {}).get("run", "?")
        except FileNotFoundError:
            raise ConfigError(f"version {step} is not in {data_dir} (pruned? see server.keep_checkpoints)") from None
    finally:
        store.close()
    names = parameter_names(config)
    expected = sum(shape.numel() for _, shape in names)
    if flat.numel() != expected:
        raise ConfigError(
            f"{data_dir} holds run {run!r} ({flat.numel()} parameters), but {config_source} is run "
            f"{config.run.name!r} ({expected} parameters, model {config.model.label()}): pass "
            f"--config with the TOML that `relay-server serve` ran {run!r} with"
        )
    write_pretrained(config, unflatten(flat, names), out_dir, {"step": str(step)})
    return step
