"""A trainer (``join()`` on a run the whole model of which each peer trains): the plain loop of
:mod:`toolkit.optimizer`'s docstring with the precision policy around it, and after each
micro-batch one :class:`~toolkit.notebook.panel.PeerProgress` snapshot to the live panel and to
the peer's W&B run (a no-op unless a W&B project is configured). A run with mixture-of-experts
layers reaches their experts through the relay and keeps several micro-batches in flight
(:mod:`toolkit.moe.inflight`).

Everything it opens (the optimizer's background thread, the data source, the panel's widgets,
the W&B run, the expert caller) is closed in one ``ExitStack`` before it returns or raises.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from dataclasses import replace
from typing import Any

import torch

from toolkit.client import RelayClient
from toolkit.data.input_pipeline import check_run_data, peer_batches
from toolkit.errors import MESSAGES, CollabError, DeviceOutOfMemory, RunFinished, is_out_of_memory
from toolkit.models import build_model, check_trusted, loss_of
from toolkit.moe.inflight import InFlightTrainer, call_threads
from toolkit.moe.remote import RelayExpertCaller
from toolkit.notebook.panel import PeerProgress, open_panel
from toolkit.notebook.wandb_run import WandbTarget, open_wandb_run
from toolkit.optimizer import CollaborativeOptimizer
from toolkit.roles.options import TrainerOptions
from toolkit.roles.result import JoinResult
from toolkit.runtime import environment
from toolkit.runtime.environment import DeviceInfo
from toolkit.runtime.precision import PrecisionPolicy, choose_precision
from toolkit.wire.protocol import RunInfo

log = logging.getLogger(__name__)


def train(client: RelayClient, run: RunInfo, options: TrainerOptions, started: float) -> JoinResult:
    """Join as a trainer, train until the run finishes or a limit is hit, leave; what it did."""
    model, data, batch_size, seed = options.model, options.data, options.batch_size, options.seed
    max_steps, max_seconds, moe_in_flight = options.max_steps, options.max_seconds, options.moe_in_flight
    with ExitStack() as cleanup:
        if data is None:
            check_run_data(run)  # a transformers run with nothing to tokenize its text: refused before joining
        info = environment.detect()
        policy = choose_precision(info, run.precision)  # PrecisionUnsupported before we join
        device = environment.device(info)
        if model is None:
            check_trusted(run.model, options.trusted_models)  # before anything else: nothing imported yet
            torch.manual_seed(0)  # the relay's parameters replace these at once; only the shapes matter
            model = build_model(run.model, options.trusted_models)
        model.to(device)
        name = options.peer_name or socket.gethostname()[:64]
        view = open_panel(options.panel, f"{run.run_name}: {name} on {info.label}, {policy.name}")
        cleanup.callback(view.close)
        opt = CollaborativeOptimizer(
            model,
            client=client,
            batch_size_per_step=batch_size,
            peer_name=name,
            delayed_updates=run.max_staleness >= 1 if options.delayed_updates is None else options.delayed_updates,
            device_info={**info.to_json(), "precision": policy.to_json()},
            precision=policy.name,
            accumulate_on_host=options.accumulate_on_host,
            report_interval_s=options.report_interval_s,
            verbose=options.verbose,
        )
        cleanup.callback(opt.close)
        flight: InFlightTrainer | None = None
        if hasattr(model, "attach_caller"):  # mixture-of-experts layers: their experts live on volunteer hosts
            caller = RelayExpertCaller(client, opt.peer_id, max_workers=call_threads(moe_in_flight))
            cleanup.callback(caller.close)
            model.attach_caller(caller)
            if moe_in_flight != 1 and info.kind != "tpu":  # XLA's lazy graphs are built by one thread
                flight = InFlightTrainer(
                    model,
                    lambda m, p, b: _micro_batch(m, p, b, info, device),
                    policy,
                    shared=(caller,),
                    jobs=moe_in_flight,
                )
                cleanup.callback(flight.close)
        if opt.collab_state.finished:  # joined after the last step: say so rather than return 0 samples
            raise RunFinished(
                "run_finished", MESSAGES["run_finished"][0].format(run=run.run_name, step=opt.collab_state.step)
            )
        target = WandbTarget.parse(options.wandb_project) or (
            WandbTarget(project=run.wandb["project"], entity=run.wandb.get("entity", ""))
            if run.wandb.get("project")
            else None
        )
        tracker = open_wandb_run(
            target,
            name=name,
            group=run.run_name,
            config=_wandb_config(run, info, policy.name, batch_size, opt.peer_id),
        )
        cleanup.callback(tracker.close)
        batches: Iterator[Any] = (
            iter(data)
            if data is not None
            else peer_batches(
                run, client, opt.peer_id, batch_size=batch_size, seed=seed if seed is not None else opt.peer_id
            )
        )
        close_batches = getattr(batches, "close", None)
        if close_batches is not None:
            cleanup.callback(close_batches)  # a streaming source reports and releases the shards it holds

        first_step, local_steps, loss_value, first_contribution_s = opt.version, 0, None, None
        asked_at = 0  # contributed samples when the relay was last asked for the first contribution
        progress: PeerProgress | None = None

        def should_stop() -> bool:
            return (
                opt.finished
                or (max_steps is not None and opt.version - first_step >= max_steps)
                or (max_seconds is not None and time.monotonic() - started > max_seconds)
            )

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
                    opt.hold()  # not a micro-batch that could only overshoot the round about to open
                    if opt.finished:
                        break
                    opt.zero_grad()
                    loss_now, finite = _micro_batch(model, policy, batch, info, device)
                    environment.optimizer_step(
                        opt, info, batch_size=batch_size_of(batch), loss=loss_now, skip=not finite
                    )
                    if after_micro_batch(loss_now):
                        break
        except KeyboardInterrupt:
            log.info("interrupted: leaving the collaboration")
        except CollabError as exc:
            if progress is not None:  # the panel's last word is what went wrong and what to do
                view.update(replace(progress, problem=exc.message, hint=exc.hint))
            raise
    return JoinResult(
        peer_id=opt.peer_id,
        final_step=opt.version,
        contributed_samples=opt.contributed_samples,
        local_steps=local_steps,
        last_loss=loss_value,
        seconds=time.monotonic() - started,
        finished=opt.finished,
        device=info.label,
        precision=policy.name,
        first_contribution_s=first_contribution_s,
        joined_step=first_step,
        in_flight=flight.most_jobs if flight is not None else 1,
    )


def _micro_batch(
    model: torch.nn.Module, policy: PrecisionPolicy, batch: Any, info: DeviceInfo, device: torch.device
) -> tuple[float, bool]:
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
        raise DeviceOutOfMemory(
            "out_of_memory", f"the {info.label} ran out of memory on a micro-batch of {batch_size_of(batch)} samples"
        ) from None
    return loss.item(), policy.unscale_and_check(model.parameters())


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


def _wandb_config(run: RunInfo, info: DeviceInfo, precision: str, batch_size: int, peer_id: str) -> dict:
    """What a volunteer's W&B run records about this peer (no secrets, no URLs with credentials)."""
    return {
        "run_name": run.run_name,
        "peer_id": peer_id,
        "device": info.label,
        "device_kind": info.kind,
        "platform": info.platform or "",
        "precision": precision,
        "batch_size": batch_size,
        "target_batch": run.target_batch,
        "model": run.model.factory or run.model.architecture,
    }


def to_device(batch: Any, device: torch.device) -> Any:
    """A tensor batch, or a dict of tensors (HF models), on ``device``."""
    if isinstance(batch, Mapping):
        return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    return batch.to(device, non_blocking=True)


def batch_size_of(batch: Any) -> int:
    if isinstance(batch, Mapping):
        return int(next(v for v in batch.values() if isinstance(v, torch.Tensor)).shape[0])
    return int(batch.shape[0])
