"""A pipeline run's peer (``join()`` on a run cut into stages, or ``join(role="stage_worker")``):
take a stage by this machine's memory, then serve tasks (:mod:`toolkit.pipeline.worker`) until
the run ends, ``max_steps`` or ``max_seconds`` pass, or the cell is interrupted."""

from __future__ import annotations

import logging
import socket
import time

from toolkit.client import RelayClient
from toolkit.data.input_pipeline import peer_batches
from toolkit.notebook.panel import PeerProgress, open_panel
from toolkit.roles.options import StageWorkerOptions
from toolkit.roles.result import JoinResult
from toolkit.run_membership import Membership
from toolkit.runtime import environment
from toolkit.wire.protocol import PROTOCOL_VERSION, JoinRequest, RunInfo

log = logging.getLogger(__name__)


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
    peer_id, first_step = joined.peer_id, joined.state.step
    size = int(run.pipeline["microbatch_size"])
    seed = options.seed if options.seed is not None else peer_id
    batches = (
        iter(options.data)
        if options.data is not None
        else peer_batches(run, client, peer_id, batch_size=size, seed=seed)
    )
    worker = StageWorker(
        membership, run, batches, device=environment.device(info), memory_bytes=info.memory_bytes or 0
    )
    view = open_panel(options.panel, f"{run.run_name}: {name} on {info.label}, pipeline stage")

    def show(p) -> None:
        state = client.get_progress()
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

    def until() -> bool:
        return (
            (options.max_seconds is not None and time.monotonic() - started > options.max_seconds)
            or (options.max_steps is not None and worker.version - first_step >= options.max_steps)
            or (0 < run.total_steps <= worker.version)
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
        contributed_samples=0,
        local_steps=worker.tasks_done,
        last_loss=worker.last_loss,
        seconds=time.monotonic() - started,
        finished=0 < run.total_steps <= worker.version,
        device=info.label,
        precision=worker.precision.name,
        joined_step=first_step,
    )
