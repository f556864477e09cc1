"""``toolkit.join``: the one call a volunteer's notebook makes.

It finds the accelerator, picks the precision (or takes the one the run pins), builds the run's
model (or uses yours), joins the relay, streams the run's data, trains until the run finishes,
the cell is interrupted, or a limit you set is hit, and always leaves cleanly. The loop inside is
the plain one in :mod:`toolkit.optimizer`'s docstring, with the precision policy around it, and
after each micro-batch one :class:`~toolkit.notebook.panel.PeerProgress` snapshot goes to the live panel
and to the peer's W&B run (a no-op unless a W&B project is configured).

Everything join opens (the relay connection, the optimizer's background thread, the data
source, the panel's widgets, the W&B run) is closed in one ``ExitStack`` before it returns or
raises, so re-running a notebook cell starts from nothing.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace
from typing import Any

import torch

from toolkit.runtime import environment
from toolkit.client import RelayClient
from toolkit.data.input_pipeline import check_run_data, peer_batches
from toolkit.runtime.environment import DeviceInfo
from toolkit.membership import Membership
from toolkit.errors import MESSAGES, AuthError, CollabError, DeviceOutOfMemory, RunFinished, is_out_of_memory
from toolkit.models import build_model, check_trusted, loss_of
from toolkit.moe.host import ExpertHost
from toolkit.moe.inflight import InFlightTrainer, call_threads
from toolkit.moe.remote import RelayExpertCaller
from toolkit.optimizer import CollaborativeOptimizer
from toolkit.notebook.panel import Panel, PanelKind, PeerProgress, open_panel
from toolkit.runtime.precision import PrecisionPolicy, choose_precision
from toolkit.wire.protocol import PROTOCOL_VERSION, JoinRequest, RunInfo
from toolkit.notebook.wandb_run import WandbTarget, open_wandb_run

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JoinResult:
    """What one ``join()`` did; :meth:`summary` says it in a sentence (what the notebook prints)."""

    peer_id: str
    final_step: int
    contributed_samples: int
    local_steps: int
    last_loss: float | None
    seconds: float
    finished: bool
    device: str
    precision: str
    first_contribution_s: float | None = None
    """Seconds from this peer's join to the relay accepting its first gradient, as the relay
    measured it (the number its dashboard shows); None: no gradient was accepted."""
    joined_step: int = 0
    """The global step when this peer joined."""
    hosted_experts: bool = False
    """``join(role="expert_host")``: ``local_steps`` counts expert tasks served, not micro-batches."""
    in_flight: int = 1
    """The most micro-batches this trainer kept in flight at once (a run with mixture layers)."""

    def summary(self) -> str:
        """One readable sentence, e.g. "Contributed 16 samples over 2 steps (first contribution
        3.2 s after joining); left at step 2 after 41 s."."""
        took = _duration(self.seconds)
        if self.hosted_experts:
            return f"Hosted experts for {took}: {self.local_steps:,} tasks served."
        steps = self.final_step - self.joined_step
        over = f"over {steps:,} step{'s' if steps != 1 else ''}"
        if self.contributed_samples and self.first_contribution_s is not None:
            what = (f"Contributed {self.contributed_samples:,} samples {over} (first contribution "
                    f"{self.first_contribution_s:.1f} s after joining)")
        elif self.contributed_samples:
            what = f"Contributed {self.contributed_samples:,} samples {over}"
        else:
            what = f"No samples contributed yet ({self.local_steps:,} micro-batches computed {over})"
        end = "the run finished" if self.finished else "left"
        return f"{what}; {end} at step {self.final_step:,} after {took}."


def join(relay_url: str, *, token: str | None = None, model: torch.nn.Module | None = None,
         data: Iterable[torch.Tensor] | None = None, batch_size: int = 8, peer_name: str | None = None,
         seed: int | None = None, max_steps: int | None = None, max_seconds: float | None = None,
         delayed_updates: bool | None = None, panel: PanelKind | Panel = "auto", wandb_project: str | None = None,
         trusted_models: Sequence[str] = (), accumulate_on_host: bool = False, verbose: bool = False,
         role: str = "trainer", capacity: int = 8, moe_in_flight: int | None = None,
         report_interval_s: float = 0.5) -> JoinResult:
    """Contribute to the run at ``relay_url`` until it finishes (or ``max_steps`` global steps /
    ``max_seconds`` pass, or the cell is interrupted).

    ``accumulate_on_host`` keeps the gradient accumulator in (pinned) host memory: 4 bytes per
    parameter less on the accelerator, for a copy of each micro-batch's gradients.

    ``trusted_models`` names the packages whose own model classes this machine may import (a run
    with ``[model] kind = "module"``); any other run model is built from the toolkit or the
    installed transformers, and a run naming a package not listed is refused before any import.

    ``token`` is the volunteer's Hugging Face token (:func:`toolkit.notebook.hints.hf_token` finds it);
    open runs ignore it, and it is never logged. ``model`` must expose ``loss(batch) -> scalar``
    (the run's model is built if omitted); ``data`` yields batches for it (the run's dataset if
    omitted: its streamed shards, or the demo text the toolkit ships, tokenized with the run's
    tokenizer into its ``[objective]``'s dict batches on a background thread when it names one). ``panel`` is "auto",
    "widgets", "tqdm", "none" or your own :class:`~toolkit.notebook.panel.Panel`. ``wandb_project``
    ("project" or "entity/project") starts this peer's own W&B run (default: the project the run
    names, if any). ``delayed_updates`` (default: on when the run allows one step of staleness)
    keeps computing the next batch while a round is in flight. ``report_interval_s``: the least
    time between two progress reports of a trainer (0: one after every micro-batch, which keeps a
    step within the target plus one micro-batch per peer even when micro-batches take less than
    that: the demo's peers; a report costs the relay a request).

    ``role="expert_host"`` contributes to a run with mixture-of-experts layers by hosting
    ``capacity`` of its experts instead of training (:mod:`toolkit.moe.host`): until ``max_seconds``
    or the cell is interrupted. A trainer of such a run reaches the experts through the relay,
    and keeps several micro-batches in flight so their waits overlap (:mod:`toolkit.moe.inflight`):
    as many as its measured compute and expert waits call for (at most
    :data:`~toolkit.moe.inflight.MAX_IN_FLIGHT`), or exactly ``moe_in_flight`` (1: one micro-batch at
    a time, the plain loop; a number bounds the replicas' memory).
    """
    started = time.monotonic()
    if moe_in_flight is not None and (not isinstance(moe_in_flight, int) or moe_in_flight < 1):
        raise ValueError(f"moe_in_flight must be an integer >= 1 (or None: sized from measurements), "
                         f"got {moe_in_flight!r}")
    if role == "expert_host":
        return _host_experts(relay_url, token, capacity, peer_name, max_seconds, started, panel)
    if role != "trainer":
        raise ValueError(f"role must be 'trainer' or 'expert_host', got {role!r}")
    with ExitStack() as cleanup:
        client, run = _connect(relay_url, token)
        cleanup.callback(client.close)
        if run.pipeline:  # the model is cut into stages: this machine runs one of them
            return _run_stage(client, run, data, peer_name, seed, max_steps, max_seconds, started, panel)
        if data is None:
            check_run_data(run)  # a transformers run with nothing to tokenize its text: refused before joining
        info = environment.detect()
        policy = choose_precision(info, run.precision)  # PrecisionUnsupported before we join
        device = environment.device(info)
        if model is None:
            check_trusted(run.model, trusted_models)  # before anything else: nothing imported yet
            torch.manual_seed(0)  # the relay's parameters replace these at once; only the shapes matter
            model = build_model(run.model, trusted_models)
        model.to(device)
        name = peer_name or socket.gethostname()[:64]
        view = open_panel(panel, f"{run.run_name}: {name} on {info.label}, {policy.name}")
        cleanup.callback(view.close)
        opt = CollaborativeOptimizer(model, client=client, batch_size_per_step=batch_size, peer_name=name,
                                     delayed_updates=run.max_staleness >= 1 if delayed_updates is None
                                     else delayed_updates,
                                     device_info={**info.to_json(), "precision": policy.to_json()},
                                     precision=policy.name, accumulate_on_host=accumulate_on_host,
                                     report_interval_s=report_interval_s, verbose=verbose)
        cleanup.callback(opt.close)
        flight: InFlightTrainer | None = None
        if hasattr(model, "attach_caller"):  # mixture-of-experts layers: their experts live on volunteer hosts
            caller = RelayExpertCaller(client, opt.peer_id, max_workers=call_threads(moe_in_flight))
            cleanup.callback(caller.close)
            model.attach_caller(caller)
            if moe_in_flight != 1 and info.kind != "tpu":  # XLA's lazy graphs are built by one thread
                flight = InFlightTrainer(model, lambda m, p, b: _micro_batch(m, p, b, info, device), policy,
                                         shared=(caller,), jobs=moe_in_flight)
                cleanup.callback(flight.close)
        if opt.collab_state.finished:  # joined after the last step: say so rather than return 0 samples
            raise RunFinished("run_finished", MESSAGES["run_finished"][0].format(run=run.run_name,
                                                                                 step=opt.collab_state.step))
        target = WandbTarget.parse(wandb_project) or (
            WandbTarget(project=run.wandb["project"], entity=run.wandb.get("entity", "")) if run.wandb.get("project")
            else None)
        tracker = open_wandb_run(target, name=name, group=run.run_name,
                                 config=_wandb_config(run, info, policy.name, batch_size, opt.peer_id))
        cleanup.callback(tracker.close)
        batches: Iterator[Any] = iter(data) if data is not None else peer_batches(
            run, client, opt.peer_id, batch_size=batch_size, seed=seed if seed is not None else opt.peer_id)
        close_batches = getattr(batches, "close", None)
        if close_batches is not None:
            cleanup.callback(close_batches)  # a streaming source reports and releases the shards it holds

        first_step, local_steps, loss_value, first_contribution_s = opt.version, 0, None, None
        asked_at = 0  # contributed samples when the relay was last asked for the first contribution
        progress: PeerProgress | None = None

        def should_stop() -> bool:
            return opt.finished or (max_steps is not None and opt.version - first_step >= max_steps) or (
                max_seconds is not None and time.monotonic() - started > max_seconds)

        def after_micro_batch(loss: float) -> bool:
            """Panel, W&B and the first contribution after each micro-batch; True: stop."""
            nonlocal local_steps, loss_value, first_contribution_s, asked_at, progress
            local_steps, loss_value = local_steps + 1, loss
            if first_contribution_s is None and opt.contributed_samples > asked_at:
                asked_at = opt.contributed_samples
                first_contribution_s = relay_first_contribution(client, opt.peer_id)
            progress = PeerProgress.from_optimizer(opt, loss=loss_value, first_contribution_s=first_contribution_s)
            view.update(progress)
            tracker.update(progress)
            return should_stop()

        try:
            if flight is not None:
                flight.run(opt, batches, batch_size_of, lambda r: after_micro_batch(r.loss), should_stop)
            else:
                for batch in batches:
                    opt.zero_grad()
                    loss_now, finite = _micro_batch(model, policy, batch, info, device)
                    environment.optimizer_step(opt, info, batch_size=batch_size_of(batch), loss=loss_now,
                                               skip=not finite)
                    if after_micro_batch(loss_now):
                        break
        except KeyboardInterrupt:
            log.info("interrupted: leaving the collaboration")
        except CollabError as exc:
            if progress is not None:  # the panel's last word is what went wrong and what to do
                view.update(replace(progress, problem=exc.message, hint=exc.hint))
            raise
    return JoinResult(peer_id=opt.peer_id, final_step=opt.version, contributed_samples=opt.contributed_samples,
                      local_steps=local_steps, last_loss=loss_value, seconds=time.monotonic() - started,
                      finished=opt.finished, device=info.label, precision=policy.name,
                      first_contribution_s=first_contribution_s, joined_step=first_step,
                      in_flight=flight.most_jobs if flight is not None else 1)


def _micro_batch(model: torch.nn.Module, policy: PrecisionPolicy, batch: Any, info: DeviceInfo,
                 device: torch.device) -> tuple[float, bool]:
    """Forward and backward of one micro-batch under the precision policy: (loss, whether its
    gradients are finite); an out-of-memory error becomes :class:`DeviceOutOfMemory`, which says
    what to do."""
    try:
        batch = to_device(batch, device)
        with policy.autocast():
            loss = loss_of(model, batch)
        policy.scale_loss(loss).backward()
    except RuntimeError as exc:
        if not is_out_of_memory(exc):
            raise
        raise DeviceOutOfMemory("out_of_memory", f"the {info.label} ran out of memory on a micro-batch "
                                f"of {batch_size_of(batch)} samples") from None
    return loss.item(), policy.unscale_and_check(model.parameters())


def _host_experts(relay_url: str, token: str | None, capacity: int, peer_name: str | None,
                  max_seconds: float | None, started: float, panel: PanelKind | Panel) -> JoinResult:
    """``join(role="expert_host")``: serve experts until stopped, the panel saying so."""
    name = peer_name or socket.gethostname()[:64]
    host = ExpertHost(relay_url, capacity=capacity, token=token, name=name)
    view = open_panel(panel, f"{name}: hosting experts")

    def show(h: ExpertHost) -> None:
        state = h.collab_state
        if state is not None:
            view.update(PeerProgress(peers_online=state.num_peers, samples_per_s=state.samples_per_s,
                                     global_step=state.step, total_steps=0, samples_accumulated=state.samples_accumulated,
                                     target_batch=state.target_batch, eta_s=state.eta_s, contributed_samples=0,
                                     local_samples_per_s=0.0, loss=None, first_contribution_s=None,
                                     finished=state.finished, hosting=h.describe()))

    try:
        host.run(max_seconds, on_progress=show)
    except KeyboardInterrupt:
        log.info("interrupted: handing the experts back")
    finally:
        view.close()
    return JoinResult(peer_id=host.peer_id, final_step=0, contributed_samples=0, local_steps=host.tasks_done,
                      last_loss=None, seconds=time.monotonic() - started, finished=False, device=str(host.device),
                      precision="fp32", hosted_experts=True)


def _run_stage(client: RelayClient, run: RunInfo, data: Iterable[Any] | None, peer_name: str | None,
               seed: int | None, max_steps: int | None, max_seconds: float | None, started: float,
               panel: PanelKind | Panel) -> JoinResult:
    """A pipeline run: take a stage by this machine's memory, then serve tasks (:mod:`toolkit.pipeline.worker`)."""
    from toolkit.pipeline.worker import StageWorker  # the stage code: pipeline runs only

    info = environment.detect()
    name = peer_name or socket.gethostname()[:64]
    membership = Membership(client, JoinRequest(peer_name=name, protocol=PROTOCOL_VERSION, device=info.to_json(),
                                                precision=run.precision), what="stage worker")
    joined = membership.join()
    peer_id, first_step = joined.peer_id, joined.state.step
    size = int(run.pipeline["microbatch_size"])
    batches = iter(data) if data is not None else peer_batches(run, client, peer_id, batch_size=size,
                                                               seed=seed if seed is not None else peer_id)
    worker = StageWorker(membership, run, batches, device=environment.device(info),
                         memory_bytes=info.memory_bytes or 0)
    view = open_panel(panel, f"{run.run_name}: {name} on {info.label}, pipeline stage")

    def show(p) -> None:
        state = client.get_progress()
        view.update(PeerProgress(peers_online=state.num_peers, samples_per_s=state.samples_per_s,
                                 global_step=state.step, total_steps=run.total_steps,
                                 samples_accumulated=p.microbatches_held * size, target_batch=run.target_batch,
                                 eta_s=state.eta_s, contributed_samples=p.uploads, local_samples_per_s=worker.samples_per_s,
                                 loss=p.last_loss, first_contribution_s=None, finished=state.finished,
                                 hosting=f"stage {p.stage + 1} of {p.num_stages}: {p.tasks_done} tasks"))

    def until() -> bool:
        return (max_seconds is not None and time.monotonic() - started > max_seconds) or (
            max_steps is not None and worker.version - first_step >= max_steps) or (
            0 < run.total_steps <= worker.version)

    try:
        worker.run(until=until, on_progress=show)
    except KeyboardInterrupt:
        log.info("interrupted: leaving the pipeline (its tasks go to other workers)")
    finally:
        worker.stop()
        view.close()
        membership.leave()
    return JoinResult(peer_id=peer_id, final_step=max(worker.version, first_step), contributed_samples=0,
                      local_steps=worker.tasks_done, last_loss=worker.last_loss, seconds=time.monotonic() - started,
                      finished=0 < run.total_steps <= worker.version, device=info.label, precision="fp32",
                      joined_step=first_step)


def _connect(relay_url: str, token: str | None) -> tuple[RelayClient, RunInfo]:
    """The relay connection, logged in when the run requires it: the relay trades the Hugging
    Face token for an access pass once, and every later request is signed. The token goes into
    no log line, repr or error message."""
    client = RelayClient(relay_url)
    run = client.get_run()
    if run.auth == "hf":
        if not token:
            client.close()
            raise AuthError("token_required", f"run {run.run_name!r} needs a Hugging Face login",
                            "In a notebook: add your token as the HF_TOKEN secret (or answer the prompt) and run "
                            "the cell again. From a shell: export HF_TOKEN=... (python -m toolkit.peer "
                            "--token-env NAME reads another variable).")
        client.login(token)
    return client, run


def relay_first_contribution(client: RelayClient, peer_id: str) -> float | None:
    """This peer's first contribution as the relay measured it: seconds from its join to the
    relay accepting its first gradient, on the relay's clock. Asked once this peer's samples were
    applied (the relay counted them by then); the panel, the summary and the dashboard then show
    one number. None when the relay cannot say right now (asked again after the next applied step)."""
    try:
        status = client.get_status()
    except CollabError as exc:
        log.debug("could not ask the relay for the first contribution: %s", exc)
        return None
    return next((p.first_contribution_s for p in status.peers if p.peer_id == peer_id), None)


def _duration(seconds: float) -> str:
    """``41 s``, ``12 min``, ``3.5 h``: how long a session took, in the unit a person reads."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def _wandb_config(run: RunInfo, info: DeviceInfo, precision: str, batch_size: int, peer_id: str) -> dict:
    """What a volunteer's W&B run records about this peer (no secrets, no URLs with credentials)."""
    return {"run_name": run.run_name, "peer_id": peer_id, "device": info.label, "device_kind": info.kind,
            "platform": info.platform or "", "precision": precision, "batch_size": batch_size,
            "target_batch": run.target_batch, "model": run.model.factory or run.model.architecture}


def to_device(batch: Any, device: torch.device) -> Any:
    """A tensor batch, or a dict of tensors (HF models), on ``device``."""
    if isinstance(batch, Mapping):
        return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    return batch.to(device, non_blocking=True)


def batch_size_of(batch: Any) -> int:
    if isinstance(batch, Mapping):
        return int(next(v for v in batch.values() if isinstance(v, torch.Tensor)).shape[0])
    return int(batch.shape[0])
