"""``join(role="expert_host")``: host experts of a run with mixture-of-experts layers
(:class:`~toolkit.moe.host.ExpertHost`) until ``max_seconds`` or the cell is interrupted, the
panel saying what this machine hosts and serves."""

from __future__ import annotations

import logging
import socket
import time

from toolkit.moe.host import ExpertHost
from toolkit.notebook.panel import PeerProgress, open_panel
from toolkit.roles.options import ExpertHostOptions
from toolkit.roles.result import JoinResult

log = logging.getLogger(__name__)


def host_experts(relay_url: str, options: ExpertHostOptions, started: float) -> JoinResult:
    """Serve experts until stopped, the panel saying so."""
    name = options.peer_name or socket.gethostname()[:64]
    host = ExpertHost(relay_url, capacity=options.capacity, token=options.token, name=name)
    view = open_panel(options.panel, f"{name}: hosting experts")

    def show(h: ExpertHost) -> None:
        state = h.collab_state
        if state is not None:
            view.update(
                PeerProgress(
                    peers_online=state.num_peers,
                    samples_per_s=state.samples_per_s,
                    global_step=state.step,
                    total_steps=0,
                    samples_accumulated=state.samples_accumulated,
                    target_batch=state.target_batch,
                    eta_s=state.eta_s,
                    contributed_samples=0,
                    local_samples_per_s=0.0,
                    loss=None,
                    first_contribution_s=None,
                    finished=state.finished,
                    hosting=h.describe(),
                )
            )

    try:
        host.run(options.max_seconds, on_progress=show)
    except KeyboardInterrupt:
        log.info("interrupted: handing the experts back")
    finally:
        view.close()
    return JoinResult(
        peer_id=host.peer_id,
        final_step=0,
        contributed_samples=0,
        local_steps=host.tasks_done,
        last_loss=None,
        seconds=time.monotonic() - started,
        finished=False,
        device=str(host.device),
        precision="fp32",
        hosted_experts=True,
    )
