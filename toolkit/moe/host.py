"""A volunteer that hosts experts: ``python -m toolkit.moe.host --relay URL --capacity N``.

The host is an ordinary peer of the run (it joins and heartbeats, so the relay's TTL tells when it
is gone) that cannot be reached: everything is outbound. It leases experts from the relay
(orphans first: a dead host's experts resume here from their last checkpoint), long-polls the
tasks of the experts it holds, computes them, and sends results back; every
``checkpoint_every_s`` (and when it stops) it uploads each expert's parameters and optimizer state.

**Batches** (Learning@home s3.3 and Appendix D; hivemind's TaskPool): one poll takes every queued
call of the host's experts up to ``max_rows`` rows, and the calls of one expert and kind run as
ONE forward or ONE backward on their rows stacked, the answer split back per call. Per expert, a
batch's forwards run first, then its backwards as one backward pass and ONE optimizer step on the
summed parameter gradient (hivemind's rule: one step per batch of backward tasks). Every row of
the expert is computed independently of the others, so each call's answer (its ``y``, or its
``d loss / d x``) is exactly what it would get computed alone at the parameters the batch ran at;
what batching changes is how many steps the expert takes, not what any caller receives.

**Recovery**: a host never exits on an error it can wait out. The relay unreachable (a blip, a
restart), a refused lease or checkpoint, a poll that finds its leases gone (``no_lease``: the
host was away longer than the peer TTL, or the relay restarted), its peer id forgotten
(``unknown_peer``: it joins again): each is logged, said on the panel (:meth:`describe`) and
retried with the backoff every role shares (:mod:`toolkit.run_membership`, which also joins,
heartbeats and leaves for it). Back from a blip, the host leases again; an expert it still holds
in memory is kept unless the relay's checkpoint is ahead of it (another host trained it
meanwhile), an expert it no longer leases is dropped.

The computation is :class:`~toolkit.moe.calls.LoopbackCaller`'s on one runtime thread: forward
under ``no_grad``, backward by recomputing the forward (Appendix D). Experts are built from the
run's ``[moe] expert`` (:mod:`toolkit.moe.experts`): nothing the network sends is executed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import logging
import os
import signal
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from toolkit.client import RelayClient
from toolkit.errors import CollabError, RelayRejected, RelayUnreachable
from toolkit.moe.calls import ExpertFailed, LoopbackCaller
from toolkit.moe.experts import build_expert, checkpoint_state, expert_shapes, make_optimizer, restore
from toolkit.run_membership import Membership
from toolkit.runtime.parent import die_with_parent
from toolkit.wire import payloads
from toolkit.wire.compression import get_codec
from toolkit.wire.protocol import PROTOCOL_VERSION, CollabState, JoinRequest, TaskHead

log = logging.getLogger(__name__)
RESULT_UPLOADERS = 4
"""Threads that send results back, so the runtime computes the next task meanwhile: sent from the
runtime thread, each result cost the host a round trip to the relay (at 200 ms, 9 tasks/s instead
of 100; benchmarks/moe_latency.py --hosts-through-proxy)."""
LEASE_EVERY_S = 1.0  # how often a host asks for more experts (orphans of a host that died)

Task = tuple[TaskHead, dict[str, np.ndarray]]


class ExpertHost:
    """One host process: ``run()`` until ``stop()`` (or SIGTERM via the CLI). ``batching=False``
    runs every call alone (benchmarks/moe_batching.py's baseline)."""

    def __init__(
        self,
        relay_url: str,
        *,
        capacity: int,
        token: str | None = None,
        name: str = "expert-host",
        max_rows: int = 4096,
        poll_s: int = 2,
        device: str | None = None,
        batching: bool = True,
    ) -> None:
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.client = RelayClient(relay_url)
        self.run_info = run = self.client.get_run()
        if run.auth == "hf":
            if not token:
                raise CollabError(
                    "token_required",
                    f"run {run.run_name!r} needs a Hugging Face login",
                    "export HF_TOKEN=... (python -m toolkit.moe.host --token-env NAME reads another)",
                )
            self.client.login(token)
        self.name = name
        self._stop, self._rejoined = threading.Event(), threading.Event()
        self.membership = Membership(
            self.client,
            JoinRequest(
                peer_name=name,
                protocol=PROTOCOL_VERSION,
                precision=run.precision or None,
                device={"role": "expert_host"},
            ),
            on_rejoin=lambda _: self._rejoined.set(),
            what="host",
        )
        self.membership.join()
        self.membership.keep_alive(run.heartbeat_interval_s)  # from the join on: building experts takes time
        self.capacity, self.max_rows, self.poll_s, self.batching = capacity, max_rows, poll_s, batching
        self.spec = self.client.moe.spec()
        self.shapes = expert_shapes(self.spec.expert)
        self.codec = get_codec(self.spec.codec)
        self.runtime = LoopbackCaller({}, optimizer_factory=lambda m: make_optimizer(self.spec.optimizer, m))
        self.updates: dict[str, int] = {}
        self._uploads = concurrent.futures.ThreadPoolExecutor(
            RESULT_UPLOADERS, thread_name_prefix="collab-host-result"
        )
        self.tasks_done = self.batches_done = 0
        self.last_checkpoint: float | None = None
        self.waiting: str | None = None
        """What the host is waiting for now (None while it serves): the panel's last words."""

    @property
    def peer_id(self) -> str:
        """This host's id in the run (its membership's: a new one after the relay forgot it)."""
        return self.membership.peer_id

    @property
    def collab_state(self) -> CollabState | None:
        """The relay's last answer to this host's join or heartbeat (for a panel)."""
        return self.membership.state

    # --- experts --------------------------------------------------------------------------------
    def lease(self) -> list[str]:
        """Ask for ``capacity`` experts (the ones held here first, should their leases have lapsed);
        adopt the new ones, drop those leased elsewhere now."""
        lease = self.client.moe.lease(self.peer_id, self.capacity, held=sorted(self.runtime.experts))
        uids = lease.uids
        for uid in [u for u in self.runtime.experts if u not in uids]:
            log.warning("expert %s is no longer leased here (another host holds it); dropping it", uid)
            self._drop(uid)
        regained = [uid for uid in lease.granted if uid in self.runtime.experts]
        new = [uid for uid in uids if uid not in self.runtime.experts]
        for uid in regained:
            self._catch_up(uid)
        for uid in new:
            self._adopt(uid)
        if new or regained:
            log.info("hosting %d experts: %s", len(uids), " ".join(uids))
        return uids

    def _adopt(self, uid: str) -> None:
        module = build_expert(self.spec.expert, uid, self.spec.seed).to(self.device)
        optimizer = make_optimizer(self.spec.optimizer, module)
        body = self.client.moe.get_checkpoint(self.peer_id, uid)
        self.updates[uid] = 0  # a fresh expert: the run's seed and the uid give its weights
        if body is not None:
            self.updates[uid] = restore(module, optimizer, body, self.shapes)
            log.info("expert %s resumed from its checkpoint (%d updates)", uid, self.updates[uid])
        self.runtime.experts[uid] = module
        self.runtime.optimizers[uid] = optimizer

    def _catch_up(self, uid: str) -> None:
        """An expert leased again after a lapse: keep what this host holds unless the relay's
        checkpoint is ahead of it (another host trained it in between)."""
        body = self.client.moe.get_checkpoint(self.peer_id, uid)
        module, optimizer = self.runtime.experts[uid], self.runtime.optimizers.get(uid)
        ahead = -1 if body is None else payloads.read_checkpoint(body, self.shapes)[0]
        if ahead > self.updates.get(uid, 0):
            self.updates[uid] = restore(module, optimizer, body, self.shapes)
            log.info("expert %s leased again; its checkpoint is ahead (%d updates): restored", uid, ahead)
        else:
            log.info("expert %s leased again; kept this host's copy (%d updates)", uid, self.updates.get(uid, 0))

    def _drop(self, uid: str) -> None:
        self.runtime.experts.pop(uid, None)
        self.runtime.optimizers.pop(uid, None)
        self.updates.pop(uid, None)

    def checkpoint(self) -> bool:
        """Upload every expert's checkpoint; False if the relay holds no lease of this host on
        some of them (its leases lapsed: the next lease takes them back or drops them; a copy is
        not thrown away on a checkpoint's refusal)."""
        stored = True
        for uid, module in list(self.runtime.experts.items()):
            tensors = checkpoint_state(module, self.runtime.optimizers.get(uid))
            try:
                self.client.moe.put_checkpoint(self.peer_id, uid, tensors, {"updates": str(self.updates.get(uid, 0))})
            except RelayRejected as exc:
                if exc.code != "not_your_expert":
                    raise
                log.warning("the relay holds no lease of this host on expert %s: not checkpointed", uid)
                stored = False
        return stored

    # --- tasks ----------------------------------------------------------------------------------
    def serve_once(self) -> int:
        """One poll: the leased tasks, run in batches (or one by one); returns how many."""
        body = self.client.moe.tasks(self.peer_id, max_rows=self.max_rows, wait_s=self.poll_s)
        if body is None:
            return 0
        tasks = payloads.read_task_batch(body, len(body), self.spec.width, self.codec)
        for group in batches(tasks) if self.batching else [[task] for task in tasks]:
            self._run(group)
        return len(tasks)

    def _run(self, group: list[Task]) -> None:
        """One forward or backward of one expert over the rows of ``group``'s calls."""
        head = group[0][0]
        x = torch.from_numpy(np.concatenate([arrays["x"] for _, arrays in group])).to(self.device)
        version = {payloads.RESULT_VERSION: str(self.updates.get(head.uid, 0))}  # the relay's checks compute it there
        try:
            if head.kind == "forward":
                out, name = self.runtime.forward(head.uid, x).result(), "y"
            else:
                grad_y = torch.from_numpy(np.concatenate([arrays["g"] for _, arrays in group])).to(self.device)
                out, name = self.runtime.backward(head.uid, x, grad_y).result(), "g"
                self.updates[head.uid] = self.updates.get(head.uid, 0) + 1
        except ExpertFailed as exc:  # not ours any more (a lease moved): the calls time out there
            log.warning("%d %s calls for %s: %s", len(group), head.kind, head.uid, exc.message)
            return
        self.batches_done += 1
        log.info("ran %d %s calls of %s (%d rows) as one batch", len(group), head.kind, head.uid, x.shape[0])
        rows = out.float().cpu().numpy()
        offset = 0
        for task, _ in group:
            answer, offset = rows[offset : offset + task.rows], offset + task.rows
            try:
                body = payloads.encode(payloads.encode_rows(name, answer, self.codec), version)
            except ValueError as exc:  # not representable in the run's codec (NaN, out of range): let it time out
                log.warning("result of %s for %s not sent: %s", task.kind, task.uid, exc)
                continue
            self._uploads.submit(self._send_result, task, body)
            self.tasks_done += 1

    def _send_result(self, task: TaskHead, body: bytes) -> None:
        try:
            self.client.moe.result(self.peer_id, task.task_id, body)
        except RelayRejected as exc:  # the call timed out meanwhile: nothing to do
            log.debug("result for %s refused: [%s] %s", task.uid, exc.code, exc.message)
        except CollabError as exc:  # the relay is unreachable: the call will time out there
            log.warning("result for %s not delivered: %s", task.uid, exc.message)

    # --- the loop -------------------------------------------------------------------------------
    def run(self, max_seconds: float | None = None, on_progress: Callable[[ExpertHost], None] | None = None) -> None:
        """Serve until stopped; ``on_progress(self)`` after every poll (a panel's update). Errors
        the host can wait out never leave this loop (:meth:`_recover` says which)."""
        started = last_checkpoint = time.monotonic()
        last_lease = float("-inf")
        try:
            while not self._stop.is_set() and (max_seconds is None or time.monotonic() - started < max_seconds):
                if self._rejoined.is_set():  # a new peer id: the leases of the old one are gone
                    self._rejoined.clear()
                    last_lease = float("-inf")
                try:
                    now = time.monotonic()
                    if now - last_lease >= LEASE_EVERY_S:
                        self.lease()
                        last_lease = now
                    if not self.runtime.experts:
                        self.waiting = "waiting for an expert to host (every expert of the run has a host)"
                        self._stop.wait(LEASE_EVERY_S)
                    else:
                        self.serve_once()
                        if now - last_checkpoint >= self.spec.checkpoint_every_s:
                            if not self.checkpoint():
                                last_lease = float("-inf")  # lease again at once
                            last_checkpoint = self.last_checkpoint = now
                        self.waiting = None
                    self.membership.succeeded()
                except CollabError as exc:
                    if self._recover(exc):
                        last_lease = float("-inf")  # lease again at once
                if on_progress is not None:
                    try:
                        on_progress(self)
                    except CollabError as exc:  # the display is cosmetic: never the end of a host
                        log.info("progress not shown this time: %s", exc.message)
        finally:
            self._stop.set()
            self._uploads.shutdown(wait=True)  # results in flight reach the relay before the host leaves
            try:
                self.checkpoint()  # what the next host resumes from
            except CollabError as exc:
                log.warning("could not hand the experts back cleanly: %s", exc)
            finally:
                self.membership.leave()  # heartbeats went on until here: the final checkpoint found us registered
            self.runtime.close()
            self.client.close()

    def _recover(self, exc: CollabError) -> bool:
        """Say what went wrong and what the host waits for; True when leasing again at once is the
        cure (the relay lost this host's leases, or its peer id: the membership joined again).
        Anything else waits the membership's backoff."""
        code = exc.code
        if code == "banned":  # caught lying (or banned by the organizer): the relay takes no more of its work
            self.waiting = f"stopped: {exc.message}"
            log.error("%s", self.waiting)
            self._stop.set()
            return False
        if code == "no_lease":
            self.waiting = "leasing experts again (the relay had ended this host's leases)"
            log.warning(
                "the relay holds no lease of this host (away past the peer TTL, or a relay restart); leasing again"
            )
            return True
        if code == "unknown_peer":
            self.waiting = "joining again (the relay no longer knows this host)"
        elif isinstance(exc, RelayUnreachable):
            self.waiting = f"waiting for the relay (unreachable: {exc.message})"
        elif isinstance(exc, RelayRejected):
            self.waiting = f"retrying: the relay refused [{code}] {exc.message}"
        else:
            self.waiting = f"retrying after [{code}] {exc.message}"
        log.warning("%s", self.waiting)
        if self.membership.recover(exc, self._stop.wait):
            return True
        if code == "unknown_peer":
            self.waiting = "waiting for the relay to take this host back"
        return False

    def describe(self) -> str:
        """One line for a panel: what this host holds and has served, and what it waits for."""
        held = sorted(self.runtime.experts)
        since = (
            ""
            if self.last_checkpoint is None
            else f", last checkpoint {time.monotonic() - self.last_checkpoint:.0f} s ago"
        )
        line = (
            f"{len(held)} experts ({', '.join(held[:4])}{', ...' if len(held) > 4 else ''}) on {self.device}, "
            f"{self.tasks_done:,} tasks served in {self.batches_done:,} batches{since}"
        )
        return line if self.waiting is None else f"{line}; {self.waiting}"

    def stop(self) -> None:
        self._stop.set()


def batches(tasks: list[Task]) -> list[list[Task]]:
    """The leased calls grouped by expert and kind, in the order the host runs them: the forward
    batches, then the backward batches, each in the order its first call came (a forward leased
    with a backward of its expert runs at the parameters before that backward's step, as if it
    had been leased just before it)."""
    groups: dict[tuple[str, str], list[Task]] = {}
    for task in tasks:
        groups.setdefault((task[0].uid, task[0].kind), []).append(task)
    return sorted(groups.values(), key=lambda g: g[0][0].kind != "forward")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m toolkit.moe.host", description=__doc__.split("\n\n")[0])
    parser.add_argument("--relay", required=True, help="relay URL, e.g. http://127.0.0.1:8750")
    parser.add_argument("--capacity", type=int, default=8, help="experts this machine hosts (default 8)")
    parser.add_argument("--name", default="expert-host", help="shown on the dashboard")
    parser.add_argument(
        "--token-env",
        default="HF_TOKEN",
        help="variable holding your Hugging Face token (runs that need a login; default HF_TOKEN)",
    )
    parser.add_argument("--max-seconds", type=float, default=None, help="stop after this many seconds")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--device", default=None, help="where experts run (default: cuda if available, else cpu)")
    parser.add_argument("--no-batching", action="store_true", help="run every call alone (a benchmark's baseline)")
    parser.add_argument("--verbose", "-v", action="store_true", help="log each lease and checkpoint")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format=f"%(asctime)s {args.name} %(levelname)s %(name)s: %(message)s",
    )
    torch.set_num_threads(args.threads)
    try:
        host = ExpertHost(
            args.relay,
            capacity=args.capacity,
            token=os.environ.get(args.token_env) or None,
            name=args.name,
            device=args.device,
            batching=not args.no_batching,
        )
    except CollabError as exc:
        print(f"{args.name}: {exc}", flush=True)
        return 1
    signal.signal(signal.SIGTERM, lambda *_: host.stop())
    signal.signal(signal.SIGUSR1, lambda *_: host.stop())
    die_with_parent()  # started by the demo: SIGTERM when it dies, however it dies
    try:
        host.run(args.max_seconds)
    except KeyboardInterrupt:
        pass
    print(f'{{"peer_id": "{host.peer_id}", "tasks": {host.tasks_done}}}', flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
