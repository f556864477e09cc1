"""A pipeline run's peer (``join()`` on a run cut into stages, or ``join(role="stage_worker")``):
take a stage by this machine's memory, then serve tasks (:mod:`toolkit.pipeline.worker`) until
the run ends, ``max_steps`` or ``max_seconds`` pass, or the cell is interrupted."""

from __future__ import annotations

import hashlib
import logging
import socket
import time
from collections.abc import Mapping
from typing import Any

import torch

from toolkit.client import RelayClient
from toolkit.data.input_pipeline import peer_batches
from toolkit.notebook.panel import PeerProgress, open_panel
from toolkit.roles.options import StageWorkerOptions
from toolkit.roles.result import JoinResult, relay_credited_samples
from toolkit.run_membership import Membership
from toolkit.runtime import environment
from toolkit.wire.protocol import PROTOCOL_VERSION, JoinRequest, RunInfo

log = logging.getLogger(__name__)


def note_first(microbatch: int, batch: Any) -> None:
    """Say which data the relay counted as a first-stage micro-batch (verbose log: ``-v``): the
    sha256 of its tokens, so that a run can be replayed, or a sample traced, from the volunteers'
    logs without shipping the data itself."""
    if batch is None:  # no longer cached here (it cannot be: it was just computed); nothing to say
        return
    log.info("micro-batch %d taken from this worker's data (sha256 %s)", microbatch, batch_digest(batch))


def batch_digest(batch: Any) -> str:
    """sha256 of a batch's tokens: int64, row-major, a dict's tensors in key order."""
    sha = hashlib.sha256()
    for key in sorted(batch) if isinstance(batch, Mapping) else [None]:
        tensor = batch[key] if key is not None else batch
        if key is not None:
            sha.update(key.encode())
        sha.update(tensor.detach().to("cpu", torch.int64).contiguous().numpy().tobytes())
    return sha.hexdigest()


def work_a_stage(client: RelayClient, run: RunInfo, options: StageWorkerOptions, started: float) -> JoinResult:
    """Join as a stage worker, serve until told to stop, leave; what it did."""
    from toolkit.pipeline.worker import StageWorker  # the stage code: pipeline runs only

    info = environment.detect()
    name = options.peer_name or socket.gethostname()[:64]
    membership = Membership(
        client,
        JoinRequest(peer_name=name, protocol=PROTOCOL_VERSION, device=info.to_json(), precision=run.precision),
        what="stage worker",
    )
    joined = membership.join()
    membership.keep_alive(run.heartbeat_interval_s)  # from the join on: building the stage takes time
    peer_id, first_step = joined.peer_id, joined.state.step
    size = int(run.pipeline["microbatch_size"])
    seed = options.seed if options.seed is not None else peer_id
    batches = (
        iter(options.data)
        if options.data is not None
        else peer_batches(run, client, peer_id, batch_size=size, seed=seed)
    )
    worker = StageWorker(
        membership,
        run,
        batches,
        device=environment.device(info),
        memory_bytes=info.memory_bytes or 0,
        on_first=note_first,
    )
    view = open_panel(options.panel, f"{run.run_name}: {name} on {info.label}, pipeline stage")

    def show(p) -> None:
        """The panel from what the worker holds and the relay's answer to the membership's last
        heartbeat: no call to the relay of its own, so a relay away cannot end a worker here (the
        panel keeps its last figures until the relay answers again)."""
        state = membership.state
        if state is None:
            return
        view.update(
            PeerProgress(
                peers_online=state.num_peers,
                samples_per_s=state.samples_per_s,
                global_step=state.step,
                total_steps=run.total_steps,
                samples_accumulated=p.microbatches_held * size,
                target_batch=run.target_batch,
                eta_s=state.eta_s,
                contributed_samples=p.uploads,
                local_samples_per_s=worker.samples_per_s,
                loss=p.last_loss,
                first_contribution_s=None,
                finished=state.finished,
                hosting=f"stage {p.stage + 1} of {p.num_stages}: {p.tasks_done} tasks",
            )
        )

    def finished() -> bool:
        """The run reached its last step: as the relay's latest answer says (the last batch's
        version is published, never served), or as the parameters this worker holds say."""
        state = membership.state
        return (state is not None and state.finished) or 0 < run.total_steps <= worker.version

    def until() -> bool:
        return (
            (options.max_seconds is not None and time.monotonic() - started > options.max_seconds)
            or (options.max_steps is not None and worker.version - first_step >= options.max_steps)
            or finished()
        )

    try:
        worker.run(until=until, on_progress=show)
    except KeyboardInterrupt:
        log.info("interrupted: leaving the pipeline (its tasks go to other workers)")
    finally:
        worker.stop()
        view.close()
        membership.leave()
    return JoinResult(
        peer_id=peer_id,
        final_step=max(worker.version, first_step),
        contributed_samples=relay_credited_samples(client, peer_id),  # the relay's count, as its dashboard shows
        local_steps=worker.tasks_done,
        last_loss=worker.last_loss,
        seconds=time.monotonic() - started,
        finished=finished(),
        device=info.label,
        precision=worker.precision.name,
        joined_step=first_step,
    )
