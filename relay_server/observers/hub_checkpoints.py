"""Hugging Face Hub checkpoints: upload the relay's state every few steps, start a run from one.

Why the relay does it: it holds the master parameters and optimizer state (DESIGN.md s3), so a
checkpoint is one file it already wrote, not a donor peer's copy. Each upload is one commit to
``hub.repo_id`` holding

- ``model.safetensors``: the parameters by name (``model.load_state_dict(load_file(...))`` on the
  run's ``model.factory``); what ``hub.init_from`` starts a new run from;
- ``relay-state.safetensors``: the relay's step file as is (flat ``params`` + optimizer ``opt.*``),
  to restore a relay exactly;
- ``collabtrain.json`` (step, loss, run configuration) and a ``README.md`` model card.

Older checkpoints are the repo's earlier commits: ``hub.init_from = "owner/name@<commit>"``.

The repo is created (if missing) when the relay starts, so a wrong token shows in the log at
once. Uploads run on their own thread so a slow uplink never holds up the observer thread (which
would let the store prune the step file first): ``on_step`` only hard-links the step file into
``<data_dir>/hub-staging``. If uploads fall behind, the newest checkpoint replaces the one
waiting. The token is read from the environment variable named by ``hub.token_env`` and handed to
``huggingface_hub`` only; it is never logged or written anywhere.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from relay_server.core.config import ConfigError, RelayConfig
from relay_server.core.hub_files import download_hub_file, hub_endpoint, hub_token, parse_repo
from relay_server.observers.events import StepEvent
from relay_server.observers.pretrained import (
    MODEL_FILE,
    config_json,
    master_params,
    parameter_names,
    unflatten,
    write_pretrained,
)
from toolkit.wire.protocol import EvalRecord

log = logging.getLogger(__name__)

STATE_FILE = "relay-state.safetensors"
INFO_FILE = "collabtrain.json"
CLOSE_TIMEOUT_S = 60.0  # finish the upload in flight at shutdown, within systemd's default stop timeout


def parse_init_from(value: str) -> tuple[str, str | None]:
    """``"owner/name"`` or ``"owner/name@revision"`` -> (repo_id, revision or None)."""
    return parse_repo(value, "hub.init_from", pinned=False)


# --- upload -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Staged:
    """A step file linked out of the store's reach, with what the commit says about it."""

    step: int
    path: Path
    info: dict[str, Any]


class HubCheckpointer:
    """Observer: every ``hub.every_steps`` steps (and at the run's last step), commit a checkpoint."""

    def __init__(self, config: RelayConfig) -> None:
        from huggingface_hub import HfApi

        self.config, self.hub = config, config.hub
        token = hub_token(self.hub)
        if token is None:
            raise ConfigError(
                f"hub.repo_id is set but the environment variable {self.hub.token_env} "
                f"(hub.token_env) is empty: export a Hugging Face write token in it, "
                "or clear hub.repo_id to run without Hub checkpoints"
            )
        self.api = HfApi(endpoint=hub_endpoint(self.hub), token=token)
        self.names = parameter_names(config)
        self.staging = Path(config.server.data_dir) / "hub-staging"
        shutil.rmtree(self.staging, ignore_errors=True)  # leftovers of a crash are stale
        self.staging.mkdir(parents=True)
        self.uploaded: list[tuple[int, str]] = []  # (step, commit id), for logs and tests
        self._waiting: _Staged | None = None
        self.validation: EvalRecord | None = None  # the latest evaluated version ([evaluation]), for the card
        self._closing = False
        self._repo_ready = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="hub-checkpoints", daemon=True)
        self._thread.start()

    def on_step(self, event: StepEvent) -> None:
        if event.step % self.hub.every_steps and not event.status.finished:
            return
        staged = self._stage(event)
        if staged is None:
            return
        with self._cond:
            if self._waiting is not None and self._waiting.path != staged.path:
                log.warning(
                    "Hub upload of step %d skipped: step %d is ready and uploads are slower than hub.every_steps = %d",
                    self._waiting.step,
                    staged.step,
                    self.hub.every_steps,
                )
                self._waiting.path.unlink(missing_ok=True)
            self._waiting = staged
            self._cond.notify()

    def on_evaluation(self, record: EvalRecord) -> None:
        """Keep the latest validation metrics: the next checkpoint's model card states them."""
        self.validation = record

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            log.warning(
                "Hub upload still running after %.0fs at shutdown; the last checkpoint may be missing", CLOSE_TIMEOUT_S
            )

    def _stage(self, event: StepEvent) -> _Staged | None:
        if event.state_path is None:
            log.info("step %d not uploaded to the Hub: aggregators hold slices of it", event.step)
            return None
        target = self.staging / event.state_path.name
        try:
            os.link(event.state_path, target)
        except FileExistsError:
            pass
        except OSError:
            try:  # another filesystem, or no hard links: copy
                shutil.copyfile(event.state_path, target)
            except FileNotFoundError:
                log.warning("step %d was pruned before its Hub upload (raise server.keep_checkpoints)", event.step)
                return None
        status, record = event.status, event.record
        info = {
            "format": "collabtrain-checkpoint/1",
            "run_name": status.run_name,
            "step": event.step,
            "loss": record.loss,
            "samples": record.samples,
            "contributors": record.contributors,
            "finalized_at": record.finalized_at,
            "model": self.config.model.spec().to_json(),
            "config": status.config.to_json() if status.config else None,
            "files": {MODEL_FILE: "parameters by name", STATE_FILE: "relay state: flat params + optimizer"},
        }
        return _Staged(event.step, target, info)

    def _run(self) -> None:
        try:  # at startup, so a token without write access shows in the log before the first step
            self._ensure_repo()
        except Exception as exc:
            log.error(
                "Hub repo %s is not usable: %s: %s. Check hub.repo_id and that the token in $%s "
                "(hub.token_env) may write there; uploads will retry",
                self.hub.repo_id,
                type(exc).__name__,
                _first_line(exc),
                self.hub.token_env,
            )
        while True:
            with self._cond:
                while self._waiting is None and not self._closing:
                    self._cond.wait()
                staged, self._waiting = self._waiting, None
            if staged is None:
                return
            try:
                self._upload(staged)
            except Exception as exc:  # the run goes on; the next checkpoint tries again
                log.error(
                    "Hub upload of step %d to %s failed: %s: %s",
                    staged.step,
                    self.hub.repo_id,
                    type(exc).__name__,
                    _first_line(exc),
                )
            finally:
                staged.path.unlink(missing_ok=True)

    def _ensure_repo(self) -> None:
        if not self._repo_ready:
            self.api.create_repo(self.hub.repo_id, repo_type="model", private=self.hub.private, exist_ok=True)
            self._repo_ready = True

    def _upload(self, staged: _Staged) -> None:
        from huggingface_hub import CommitOperationAdd

        self._ensure_repo()
        flat = master_params(staged.path)
        info = {**staged.info, "params_sha256": hashlib.sha256(flat.numpy().tobytes()).hexdigest()}
        if (validation := self.validation) is not None:
            info["validation"] = {k: v for k, v in validation.to_json().items() if k != "samples"}
        with tempfile.TemporaryDirectory(dir=self.staging) as tmp:
            files = write_pretrained(self.config, unflatten(flat, self.names), Path(tmp), {"step": str(staged.step)})
            del flat
            operations = [
                *(CommitOperationAdd(f.name, str(f)) for f in files),
                CommitOperationAdd(STATE_FILE, str(staged.path)),
                CommitOperationAdd(INFO_FILE, json.dumps(info, indent=1).encode()),
                CommitOperationAdd("README.md", _model_card(info, self.hub.repo_id).encode()),
            ]
            loss = info["loss"]
            commit = self.api.create_commit(
                self.hub.repo_id,
                operations,
                repo_type="model",
                commit_message=f"step {staged.step}" + (f": loss {loss:.4f}" if loss is not None else ""),
            )
        self.uploaded.append((staged.step, commit.oid))
        log.info("checkpoint of step %d uploaded to %s (commit %s)", staged.step, self.hub.repo_id, commit.oid[:8])


def _model_card(info: dict[str, Any], repo_id: str) -> str:
    loss = "n/a" if info["loss"] is None else f"{info['loss']:.4f}"
    model = info["model"]
    return f"""---
library_name: collabtrain
tags:
- collabtrain
- collaborative-training
---
# {info["run_name"]}

Checkpoint of a collaborative training run (collabtrain): step {info["step"]}, loss {loss},
{info["samples"]} samples from {info["contributors"]} peer(s) in the last round.
{_validation_line(info.get("validation"))}
- `model.safetensors`: parameters by name, for the model `{json.dumps(model)}`
- `relay-state.safetensors`: the relay's full state (flat parameters and optimizer state)
- `collabtrain.json`: step, loss and run configuration

{_load_snippet(model, repo_id)}

Start a new run from this checkpoint: `[hub] init_from = "{repo_id}@<commit>"` in the relay's configuration.
"""


def _validation_line(validation: dict[str, Any] | None) -> str:
    """The card's line on held-out validation (``[evaluation]``), empty without it."""
    if not validation:
        return ""
    parts = [f"loss {validation['loss']:.4f}"]
    if validation.get("perplexity") is not None:
        parts.append(f"perplexity {validation['perplexity']:.2f}")
    if validation.get("accuracy") is not None:
        parts.append(f"accuracy {100 * validation['accuracy']:.1f}%")
    return (
        f"\nLatest validation (held-out data, version {validation['step']}, {validation['targets']} targets): "
        f"{', '.join(parts)}.\n"
    )


def _load_snippet(model: dict[str, Any], repo_id: str) -> str:
    """How to load this checkpoint: one line for a transformers run (its tokenizer travels with it)."""
    if model.get("kind") == "transformers":
        return f"""```python
from transformers import AutoTokenizer, {model["architecture"]}

tokenizer = AutoTokenizer.from_pretrained("{repo_id}", revision="<commit>")
model = {model["architecture"]}.from_pretrained("{repo_id}", revision="<commit>")
```"""
    return f"""```python
from safetensors.torch import load_file
from toolkit.models import build_model
from toolkit.wire.protocol import ModelSpec

model = build_model(ModelSpec.from_json({model!r}))
model.load_state_dict(load_file("model.safetensors"), strict=False)
```"""


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:300]


# --- start a run from a checkpoint --------------------------------------------------------------
def load_hub_checkpoint(config: RelayConfig, *, cache_dir: str | Path | None = None) -> dict[str, torch.Tensor]:
    """The named parameters of ``hub.init_from`` (its ``model.safetensors``).

    Downloads into ``cache_dir`` (default: a temporary directory, removed afterwards: once the run
    starts, its state lives in the data dir). A missing repo, revision or file is a ConfigError
    naming ``hub.init_from``."""
    repo_id, revision = parse_init_from(config.hub.init_from)
    where = f"{repo_id}@{revision or 'main'} on {hub_endpoint(config.hub)}"
    with tempfile.TemporaryDirectory(prefix="collab-hub-") as tmp:
        path = download_hub_file(
            config.hub,
            config.hub.init_from,
            MODEL_FILE,
            "hub.init_from",
            pinned=False,
            cache_dir=str(cache_dir or tmp),
        )
        tensors = load_file(path)
    log.info("initial parameters from %s (%d tensors)", where, len(tensors))
    return tensors


def init_model_from_hub(model: torch.nn.Module, config: RelayConfig) -> None:
    """Copy the ``hub.init_from`` checkpoint into ``model``'s parameters, exactly.

    Every parameter must be present with its shape: a checkpoint of another model is a
    ConfigError that names both settings, not a silent partial load. A transformers run loads
    through the architecture's own ``from_pretrained``, so any ``save_pretrained`` checkpoint fits
    (tied weights stored once or twice, a base model's prefix, legacy names)."""
    tensors = load_hub_checkpoint(config)
    if config.model.kind == "transformers":
        tensors = _through_from_pretrained(tensors, config)
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(tensors))
    unexpected = sorted(set(tensors) - set(params))
    wrong = sorted(n for n in set(params) & set(tensors) if tensors[n].shape != params[n].shape)
    if missing or unexpected or wrong:
        raise ConfigError(
            f"hub.init_from = {config.hub.init_from!r} does not fit the run's model "
            f"{config.model.label()}: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}, wrong shape {wrong[:5]}"
        )
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(tensors[name])


def _through_from_pretrained(tensors: dict[str, torch.Tensor], config: RelayConfig) -> dict[str, torch.Tensor]:
    """The checkpoint as the run's architecture names its parameters, loaded by transformers."""
    import transformers

    with tempfile.TemporaryDirectory(prefix="collab-init-") as tmp:
        save_file(tensors, str(Path(tmp) / MODEL_FILE), metadata={"format": "pt"})
        (Path(tmp) / "config.json").write_text(config_json(config) or "{}")
        auto = getattr(transformers, config.model.architecture)
        loaded, info = auto.from_pretrained(tmp, output_loading_info=True)
    if info["missing_keys"] or info["mismatched_keys"]:
        raise ConfigError(
            f"hub.init_from = {config.hub.init_from!r} does not fit the run's model "
            f"{config.model.label()}: missing {sorted(info['missing_keys'])[:5]}, wrong shape "
            f"{[k[0] if isinstance(k, tuple) else k for k in info['mismatched_keys']][:5]}"
        )
    if info["unexpected_keys"]:
        log.warning(
            "hub.init_from: %d tensors the run's model does not use (e.g. %s)",
            len(info["unexpected_keys"]),
            sorted(info["unexpected_keys"])[:3],
        )
    return {name: p.detach() for name, p in loaded.named_parameters()}
