"""A stage worker for ``benchmarks/pipeline.py``: the toolkit's real StageWorker (what
``toolkit.join`` runs on a pipeline run) with emulated compute, an emulated slow link and
emulated disconnections.

    python benchmarks/pipeline_rig.py --relay URL --name w0 --speed 1 --unit-ms 40 \\
        [--delay-ms 120] [--disconnect-p 0.9 --offline-s 5 --window-s 2] [--after FILE --ready FILE --go FILE]

* **Compute**: before the real (tiny) computation of a task, it sleeps ``unit_ms x layers of its
  stage x work / speed``, work being 1 for a forward (``first``, ``forward``) and 3 for a task
  with a backward (``last``: forward + backward; ``backward``: the forward recomputed from the
  stored input + backward). ``--speed 0.645`` is a "2080": 55% slower (1 / 1.55). Sleeping costs
  no CPU, so six workers on a shared 2-core machine measure the system, not the machine.
* **Profile**: the stats file holds ``compute_s`` (the emulated compute slept) and
  ``real_compute_s`` (the real computation and the result's request after it), and the
  requests by route (``requests``: [count, seconds]): where a worker's time goes.
* **Link**: every request to the relay (task polls, results, tickets, heartbeats, downloads)
  waits ``delay_ms`` first: one round trip of a slow link. The stage-gradient upload goes
  through the client's slice sessions and is not delayed.
* **Disconnections**: when its heartbeat first sees a new batch (the relay's step) it draws,
  with probability ``disconnect_p``, a moment within ``window_s`` (whether or not it gets a task
  of that batch); at that moment (checked before
  each poll and when a task's compute ends, whose result is then lost, as on a dropped link) it
  goes silent for ``offline_s``: no polls, no heartbeats. Above the stage's lease deadline its
  leased task is re-dispatched; above the relay's peer TTL the relay also drops it (its unsent
  stage gradients are recomputed with ``dispatch = "pool"``), and when it comes back with the
  same peer id the relay re-admits the known peer, answers ``no_stage``, and StageWorker's own
  loop asks for a stage again.
* **Start**: with ``--after``/``--ready``/``--go``, it waits for the previous worker's ready
  file before asking for its stage (so stages are assigned in a fixed order), writes its own,
  and waits for the go file before its first task (so the first batch is not timed from when
  the first worker happened to be ready).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from toolkit.client import RelayClient  # noqa: E402
from toolkit.client.transport import Transport  # noqa: E402
from toolkit.errors import RelayUnreachable  # noqa: E402
from toolkit.pipeline.worker import StageWorker  # noqa: E402
from toolkit.run_membership import Membership  # noqa: E402
from toolkit.wire.protocol import PROTOCOL_VERSION, JoinRequest  # noqa: E402

WORK = {"first": 1, "forward": 1, "last": 3, "backward": 3}


class SlowTransport(Transport):
    """A transport whose every request first waits a round trip, and that is silent while its
    worker is offline (a request then fails as an unreachable relay would)."""

    def __init__(self, url: str, delay_s: float) -> None:
        super().__init__(url)
        self.delay_s = delay_s
        self.offline = threading.Event()
        self.profile: dict[str, list[float]] = {}
        """Route (its last path part without ids) -> [requests, seconds]: where a worker's time goes."""

    def request(self, method, path, **kwargs):
        if self.offline.is_set():
            raise RelayUnreachable("relay_unreachable", "emulated disconnection")
        if self.delay_s:
            time.sleep(self.delay_s)
        started = time.monotonic()
        try:
            return super().request(method, path, **kwargs)
        finally:
            entry = self.profile.setdefault(f"{method} {route_name(path)}", [0, 0.0])
            entry[0] += 1
            entry[1] += time.monotonic() - started


def route_name(path: str) -> str:
    """``/api/pipeline/workers/<id>/tasks/t12`` -> ``tasks``: the route without its ids."""
    parts = [p for p in path.split("?")[0].split("/") if p and not any(c.isdigit() for c in p)]
    return parts[-1] if parts else path


class SlowLink(RelayClient):
    """A relay client over a :class:`SlowTransport` (every call of it, stage routes included)."""

    def __init__(self, url: str, delay_s: float) -> None:
        super().__init__(url, transport=SlowTransport(url, delay_s))
        self.offline = self.transport.offline
        self.step = -1
        """The relay's step (= the batch in flight) as the last heartbeat answered it."""

    def heartbeat(self, peer_id, hb):
        state = super().heartbeat(peer_id, hb)
        self.step = max(self.step, state.step)
        return state


class BenchWorker(StageWorker):
    def __init__(
        self,
        *args,
        unit_s: float,
        speed: float,
        disconnect_p: float,
        offline_s: float,
        window_s: float,
        rng: random.Random,
        start_gate,
        stats: dict,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.unit_s, self.speed = unit_s, speed
        self.disconnect_p, self.offline_s, self.window_s, self.rng = disconnect_p, offline_s, window_s, rng
        self.start_gate, self.stats = start_gate, stats
        self.batch_seen = -1
        self.offline_at: float | None = None

    def _take_stage(self) -> None:
        gate, self.start_gate = self.start_gate, None
        if gate is not None:
            gate.before()
        super()._take_stage()
        self.stats["stages"].append(self.assignment.stage)
        if gate is not None:
            gate.after()

    def _serve_once(self, wait_s: int) -> None:
        if self.client.step > self.batch_seen:  # a new batch: draw its disconnection, task or no task
            self.batch_seen = self.client.step
            if self.rng.random() < self.disconnect_p:
                self.offline_at = time.monotonic() + self.rng.uniform(0.0, self.window_s)
        if self._due():
            self._go_offline()
            return
        super()._serve_once(wait_s)

    def _do(self, task, inputs) -> None:
        layers = self.assignment.layers_per_stage[self.assignment.stage]
        compute_s = self.unit_s * layers * WORK[task.kind] / self.speed
        self.stats["compute_s"] += compute_s
        time.sleep(compute_s)
        if self._due():  # the link dropped while computing: the result never arrives
            self.stats["lost_results"] += 1
            self._go_offline()
            return
        started = time.monotonic()
        super()._do(task, inputs)
        self.stats["real_compute_s"] += time.monotonic() - started

    def _due(self) -> bool:
        return self.offline_at is not None and time.monotonic() >= self.offline_at

    def _go_offline(self) -> None:
        self.offline_at = None
        self.stats["disconnections"] += 1
        self.client.offline.set()
        time.sleep(self.offline_s)
        self.client.offline.clear()


class Gate:
    """Stages in a fixed order (``after`` -> own stage -> ``ready``), tasks only after ``go``."""

    def __init__(self, after: str | None, ready: str | None, go: str | None) -> None:
        self.after_file, self.ready_file, self.go_file = after, ready, go

    def before(self) -> None:
        while self.after_file and not os.path.exists(self.after_file):
            time.sleep(0.05)

    def after(self) -> None:
        if self.ready_file:
            Path(self.ready_file).write_text("ready")
        while self.go_file and not os.path.exists(self.go_file):
            time.sleep(0.05)


def data(seq_len: int, microbatch_size: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randint(0, 256, (microbatch_size, seq_len + 1), generator=g)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--relay", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--speed", type=float, default=1.0, help="1: a fast worker; 1/1.55: a '2080'")
    ap.add_argument("--unit-ms", type=float, default=40.0, help="emulated forward time of one layer at speed 1")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="added to every request: a slow link's round trip")
    ap.add_argument("--disconnect-p", type=float, default=0.0, help="chance of a disconnection per batch")
    ap.add_argument("--offline-s", type=float, default=5.0, help="how long a disconnection lasts")
    ap.add_argument(
        "--window-s",
        type=float,
        default=2.0,
        help="a disconnection starts within this many seconds of the batch's first task",
    )
    ap.add_argument("--after", help="wait for this file before asking for a stage")
    ap.add_argument("--ready", help="write this file once the stage is taken")
    ap.add_argument("--go", help="wait for this file before the first task")
    ap.add_argument("--stats", required=True, help="write what happened here (JSON) at the end")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    client = SlowLink(args.relay, args.delay_ms / 1000)
    run = client.get_run()
    membership = Membership(
        client, JoinRequest(peer_name=args.name, protocol=PROTOCOL_VERSION, device={}), what="stage worker"
    )
    membership.join()
    size = int(run.pipeline["microbatch_size"])
    stats = {
        "name": args.name,
        "stages": [],
        "disconnections": 0,
        "lost_results": 0,
        "compute_s": 0.0,
        "real_compute_s": 0.0,
    }
    worker = BenchWorker(
        membership,
        run,
        data(run.model.kwargs["seq_len"], size, args.seed),
        unit_s=args.unit_ms / 1000,
        speed=args.speed,
        disconnect_p=args.disconnect_p,
        offline_s=args.offline_s,
        window_s=args.window_s,
        rng=random.Random(args.seed),
        start_gate=Gate(args.after, args.ready, args.go),
        stats=stats,
    )
    signal.signal(signal.SIGTERM, lambda *_: worker.stop())
    try:
        worker.run(wait_s=1)
    finally:
        stats.update(
            tasks_done=worker.tasks_done,
            tasks_refused=worker.tasks_refused,
            uploads=worker.uploads,
            requests={k: [n, round(s, 3)] for k, (n, s) in client.transport.profile.items()},
        )
        Path(args.stats).write_text(json.dumps(stats))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
