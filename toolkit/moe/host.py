"""A volunteer that hosts experts: ``python -m toolkit.moe.host --relay URL --capacity N``.

The host is an ordinary peer of the run (it joins and heartbeats, so the relay's TTL tells when it
is gone) that cannot be reached: everything is outbound. It leases experts from the relay
(orphans first: a dead host's experts resume here from their last checkpoint), long-polls the
tasks of the experts it holds, computes them, and sends results back; every
``checkpoint_every_s`` (and when it stops) it uploads each expert's parameters and optimizer state.

The computation is :class:`~toolkit.moe.calls.LoopbackCaller`'s, on one runtime thread in task
order: forward under ``no_grad``, backward by recomputing the forward (Appendix D) then one
optimizer step per backward call. The in-process reference the tests compare against runs the
very same code. Experts are built from the run's ``[moe] expert`` among the toolkit's own
architectures: nothing the network sends is imported or executed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from toolkit.client import RelayClient
from toolkit.errors import CollabError, RelayRejected, RelayUnreachable
from toolkit.moe import payloads
from toolkit.moe.calls import ExpertFailed, LoopbackCaller
from toolkit.moe.experts import FFNExpert
from toolkit.transfer import SizedBody
from toolkit.wire.compression import get_codec
from toolkit.wire.auth import BODY_SHA256_HEADER, container_body_sha256, digest_metadata
from toolkit.wire.protocol import PROTOCOL_VERSION, ROUTES, CollabState, Heartbeat, JoinRequest

log = logging.getLogger(__name__)
RESULT_UPLOADERS = 4
"""Threads that send results back, so the runtime computes the next task meanwhile: sent from the
runtime thread, each result cost the host a round trip to the relay (at 200 ms, 9 tasks/s instead
of 100; benchmarks/moe_latency.py --hosts-through-proxy)."""
LEASE_EVERY_S = 1.0  # how often a host asks for more experts (orphans of a host that died)


def build_expert(spec: Mapping[str, Any], uid: str) -> nn.Module:
    """Expert ``uid`` as every process of the run initializes it (the run's seed and the uid)."""
    expert = spec["expert"]
    if expert.get("kind") != "ffn":
        raise CollabError("unknown_expert_kind", f"this toolkit cannot build expert kind {expert.get('kind')!r}",
                          "Upgrade collabtrain on this machine to the relay's version.")
    return FFNExpert.for_uid(uid, int(expert["d"]), int(expert["hidden"]), int(spec.get("seed", 0)))


def expert_shapes(spec: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of every expert of the run (they share one architecture)."""
    return {name: tuple(p.shape) for name, p in build_expert(spec, "shape.0").named_parameters()}


def make_optimizer(spec: Mapping[str, Any], module: nn.Module) -> torch.optim.Optimizer | None:
    """The run's expert optimizer (``[moe] optimizer``), one per expert; None for ``none``
    (frozen experts: the host only computes)."""
    opt = spec["optimizer"]
    if opt["name"] == "none":
        return None
    if opt["name"] == "sgd":
        return torch.optim.SGD(module.parameters(), lr=opt["lr"], momentum=opt.get("momentum", 0.0))
    if opt["name"] == "adam":
        return torch.optim.Adam(module.parameters(), lr=opt["lr"], betas=tuple(opt.get("betas", (0.9, 0.999))))
    raise CollabError("unknown_optimizer", f"this toolkit has no expert optimizer {opt['name']!r}",
                      "Upgrade collabtrain on this machine to the relay's version.")


def checkpoint_of(module: nn.Module, optimizer: torch.optim.Optimizer | None, updates: int) -> bytes:
    return payloads.encode(dict(checkpoint_state(module, optimizer)), {"updates": str(updates)})


def checkpoint_state(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[tuple[str, np.ndarray]]:
    """The tensors of an expert's checkpoint: ``p.<param>``, ``opt.<param>.<state>``."""
    names = {id(p): name for name, p in module.named_parameters()}
    params = {name: p.detach().cpu().numpy().astype(np.float32) for name, p in module.named_parameters()}
    state = {}
    if optimizer is not None:
        for param, values in optimizer.state.items():
            for key, value in values.items():
                state[f"{names[id(param)]}.{key}"] = torch.as_tensor(value, dtype=torch.float32).cpu().numpy()
    return payloads.checkpoint_tensors(params, state)


def restore(module: nn.Module, optimizer: torch.optim.Optimizer | None, body: bytes,
            shapes: Mapping[str, tuple[int, ...]]) -> int:
    """Load a checkpoint the relay kept into ``module`` and ``optimizer``; returns its updates."""
    updates, tensors = payloads.read_checkpoint(body, shapes)
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(torch.from_numpy(tensors[f"p.{name}"]))
    for key, array in tensors.items():
        if key.startswith("opt.") and optimizer is not None:
            name, state_key = key[4:].rsplit(".", 1)
            value = torch.from_numpy(array.copy())
            optimizer.state[params[name]][state_key] = value.reshape(()) if state_key == "step" \
                else value.to(params[name].device)
    return updates


class ExpertHost:
    """One host process: ``run()`` until ``stop()`` (or SIGTERM via the CLI)."""

    def __init__(self, relay_url: str, *, capacity: int, token: str | None = None, name: str = "expert-host",
                 max_rows: int = 4096, poll_s: int = 2, device: str | None = None) -> None:
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.client = RelayClient(relay_url)
        run = self.client.get_run()
        if run.auth == "hf":
            if not token:
                raise CollabError("token_required", f"run {run.run_name!r} needs a Hugging Face login",
                                  "export HF_TOKEN=... (python -m toolkit.moe.host --token-env NAME reads another)")
            self.client.login(token)
        joined = self.client.join(JoinRequest(peer_name=name, protocol=PROTOCOL_VERSION, precision=run.precision or None,
                                              device={"role": "expert_host"}))
        self.peer_id, self.interval_s = joined.peer_id, run.heartbeat_interval_s
        self._stop, self._left = threading.Event(), threading.Event()
        threading.Thread(target=self._heartbeat, name="collab-host-heartbeat", daemon=True).start()
        self.capacity, self.max_rows, self.poll_s = capacity, max_rows, poll_s
        self.spec: dict[str, Any] = self.client._request("GET", ROUTES["moe_spec"]).json()
        self.shapes = expert_shapes(self.spec)
        self.codec = get_codec(self.spec.get("codec", "none"))
        self.runtime = LoopbackCaller({}, optimizer_factory=lambda m: make_optimizer(self.spec, m))
        self.updates: dict[str, int] = {}
        self._uploads = concurrent.futures.ThreadPoolExecutor(RESULT_UPLOADERS, thread_name_prefix="collab-host-result")
        self.tasks_done = 0
        self.last_checkpoint: float | None = None
        self.collab_state: CollabState | None = None
        """The relay's last answer to this host's heartbeat (for a panel)."""

    # --- experts --------------------------------------------------------------------------------
    def lease(self) -> list[str]:
        path = ROUTES["moe_lease"].format(peer_id=self.peer_id)
        uids = self.client._request("POST", path, params={"capacity": self.capacity}).json()["uids"]
        new = [uid for uid in uids if uid not in self.runtime.experts]
        for uid in new:
            self._adopt(uid)
        if new:
            log.info("hosting %d experts: %s", len(uids), " ".join(uids))
        return uids

    def _adopt(self, uid: str) -> None:
        module = build_expert(self.spec, uid).to(self.device)
        optimizer = make_optimizer(self.spec, module)
        path = ROUTES["moe_checkpoint"].format(peer_id=self.peer_id, uid=uid)
        try:
            body = self.client._request("GET", path).content
            self.updates[uid] = restore(module, optimizer, body, self.shapes)
            log.info("expert %s resumed from its checkpoint (%d updates)", uid, self.updates[uid])
        except RelayRejected as exc:
            if exc.code != "no_checkpoint":
                raise
            self.updates[uid] = 0  # a fresh expert: the run's seed and the uid give its weights
        self.runtime.experts[uid] = module
        self.runtime.optimizers[uid] = optimizer

    def checkpoint(self) -> None:
        for uid, module in list(self.runtime.experts.items()):
            tensors = checkpoint_state(module, self.runtime.optimizers.get(uid))
            metadata = {"updates": str(self.updates.get(uid, 0))}
            headers = {"Content-Type": "application/octet-stream"}
            if self.client.signed:  # streamed like a gradient: the relay checks each chunk's digest
                metadata.update(digest_metadata(tensors))
                headers[BODY_SHA256_HEADER] = container_body_sha256(tensors, metadata)
            path = ROUTES["moe_checkpoint"].format(peer_id=self.peer_id, uid=uid)
            try:
                self.client._request("PUT", path, data=SizedBody(tensors, metadata), headers=headers)
            except RelayRejected as exc:
                if exc.code != "not_your_expert":
                    raise
                log.warning("expert %s is no longer leased here; dropping it", uid)
                self.runtime.experts.pop(uid, None)

    # --- tasks ----------------------------------------------------------------------------------
    def serve_once(self) -> int:
        path = ROUTES["moe_tasks"].format(peer_id=self.peer_id)
        response = self.client._request("GET", path, params={"max_rows": self.max_rows, "wait": self.poll_s})
        if response.status_code == 204:
            return 0
        width = int(self.spec["expert"]["d"])
        batch = payloads.read_task_batch(response.content, 2 * self.max_rows * width * 4 * 64, width, self.codec)
        for head, arrays in batch:
            x = torch.from_numpy(arrays["x"].copy()).to(self.device)
            try:
                if head["kind"] == "forward":
                    out, name = self.runtime.forward(head["uid"], x).result(), "y"
                else:
                    grad_y = torch.from_numpy(arrays["g"].copy()).to(self.device)
                    out = self.runtime.backward(head["uid"], x, grad_y).result()
                    name = "g"
                    self.updates[head["uid"]] = self.updates.get(head["uid"], 0) + 1
            except ExpertFailed as exc:  # not ours any more (a lease moved)
                log.warning("task %s for %s: %s", head["task_id"], head["uid"], exc.message)
                continue
            result_path = ROUTES["moe_result"].format(peer_id=self.peer_id, task_id=head["task_id"])
            try:
                body = payloads.encode(payloads.encode_rows(name, out.float().cpu().numpy(), self.codec))
            except ValueError as exc:  # not representable in the run's codec (NaN, out of range): let it time out
                log.warning("result of %s for %s not sent: %s", head["kind"], head["uid"], exc)
                continue
            self._uploads.submit(self._send_result, head, result_path, body)
            self.tasks_done += 1
        return len(batch)

    def _send_result(self, head: dict, path: str, body: bytes) -> None:
        try:
            self.client._request("PUT", path, data=body, headers={"Content-Type": "application/octet-stream"})
        except RelayRejected as exc:  # the call timed out meanwhile: nothing to do
            log.info("result for %s refused: [%s] %s", head["uid"], exc.code, exc.message)
        except CollabError as exc:  # the relay is unreachable: the call will time out there
            log.warning("result for %s not delivered: %s", head["uid"], exc.message)

    def run(self, max_seconds: float | None = None, on_progress: Callable[[ExpertHost], None] | None = None) -> None:
        """Serve until stopped; ``on_progress(self)`` after every poll (a panel's update)."""
        started = last_lease = last_checkpoint = time.monotonic()
        self.lease()
        every = float(self.spec["checkpoint_every_s"])
        try:
            while not self._stop.is_set() and (max_seconds is None or time.monotonic() - started < max_seconds):
                try:
                    self.serve_once()
                    if on_progress is not None:
                        on_progress(self)
                    now = time.monotonic()
                    if now - last_lease >= LEASE_EVERY_S:
                        self.lease()
                        last_lease = now
                    if now - last_checkpoint >= every:
                        self.checkpoint()
                        last_checkpoint = self.last_checkpoint = now
                except RelayUnreachable as exc:
                    log.warning("relay unreachable (%s); retrying", exc.message)
                    time.sleep(1.0)
        finally:
            self._stop.set()
            self._uploads.shutdown(wait=True)  # results in flight reach the relay before the host leaves
            try:
                self.checkpoint()  # what the next host resumes from
                self.client.leave(self.peer_id)
            except CollabError as exc:
                log.warning("could not hand the experts back cleanly: %s", exc)
            finally:
                self._left.set()  # heartbeats went on until here: the final checkpoint must find us registered
            self.runtime.close()
            self.client.close()

    def describe(self) -> str:
        """One line for a panel: what this host holds and has served."""
        held = sorted(self.runtime.experts)
        since = "" if self.last_checkpoint is None else \
            f", last checkpoint {time.monotonic() - self.last_checkpoint:.0f} s ago"
        return (f"{len(held)} experts ({', '.join(held[:4])}{', ...' if len(held) > 4 else ''}) on {self.device}, "
                f"{self.tasks_done:,} tasks served{since}")

    def stop(self) -> None:
        self._stop.set()

    def _heartbeat(self) -> None:
        """Liveness from the moment the host joined (building experts can take longer than the TTL)."""
        while True:
            try:
                self.collab_state = self.client.heartbeat(self.peer_id, Heartbeat(version=0, samples=0,
                                                                                   samples_per_s=0.0))
            except CollabError as exc:
                log.warning("heartbeat failed: %s", exc.message)
            if self._left.wait(self.interval_s):
                return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m toolkit.moe.host", description=__doc__.split("\n\n")[0])
    parser.add_argument("--relay", required=True, help="relay URL, e.g. http://127.0.0.1:8750")
    parser.add_argument("--capacity", type=int, default=8, help="experts this machine hosts (default 8)")
    parser.add_argument("--name", default="expert-host", help="shown on the dashboard")
    parser.add_argument("--token-env", default="HF_TOKEN", help="variable holding your Hugging Face token "
                        "(runs that need a login; default HF_TOKEN)")
    parser.add_argument("--max-seconds", type=float, default=None, help="stop after this many seconds")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--device", default=None, help="where experts run (default: cuda if available, else cpu)")
    parser.add_argument("--verbose", "-v", action="store_true", help="log each lease and checkpoint")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format=f"%(asctime)s {args.name} %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    try:
        host = ExpertHost(args.relay, capacity=args.capacity, token=os.environ.get(args.token_env) or None,
                          name=args.name, device=args.device)
    except CollabError as exc:
        print(f"{args.name}: {exc}", flush=True)
        return 1
    signal.signal(signal.SIGTERM, lambda *_: host.stop())
    signal.signal(signal.SIGUSR1, lambda *_: host.stop())
    try:
        host.run(args.max_seconds)
    except KeyboardInterrupt:
        pass
    print(f'{{"peer_id": "{host.peer_id}", "tasks": {host.tasks_done}}}', flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
