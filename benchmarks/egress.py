"""The relay's egress per step with and without an HTTP cache in front: parameter bytes the relay
sent itself for N light peers, N = 4, 16, 64.

    python benchmarks/egress.py                          # N = 4,16,64, 3 steps, 1M parameters
    python benchmarks/egress.py --peers 2,4 --steps 1 --numel 20000   # what tests/test_http_cache.py runs

Light peers: ``--processes`` worker processes, each running its share of the N peers as threads;
each peer is a real ``RelayClient`` that only downloads: it long-polls every version in turn
(``client.params.download_params``: the relay's ref, then the body from the cache when the run has one, hashed
and checked against the relay's hash) and reports it. They never join, so they add nothing to the
rounds. One trainer in this process (a joined peer sending one SGD gradient per round) makes each
step, once every light peer holds the version before, so every peer downloads every version.

"Without cache": ``[server] public_params_url`` unset, every body comes from the relay. "With
cache": a real nginx (``examples/nginx_params_cache.conf``, ``relay_server/harness/nginx.py``) in
front, and the relay's public_params_url names it. The relay's figures are its own counters
(``GET /api/admin/params/egress``: bodies it wrote, plus the refs' JSON), over the S+1 versions
(the initial one included). The last line is one JSON object; ``relay_bytes_per_step_ratio`` is
with-cache / without at the largest N.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from relay_server.harness.process import start_relay  # noqa: E402


def relay_config(numel: int, cache_url: str) -> str:
    server = f'public_params_url = "{cache_url}"\n' if cache_url else ""
    return f"""
[run]
name = "egress"
target_batch = 1
max_staleness = 0
[model]
factory = "toolkit.models:Vector"
kwargs = {{ numel = {numel} }}
[optimizer]
name = "sgd"
lr = 0.1
[rounds]
heartbeat_interval_s = 1.0
peer_ttl_s = 300.0
deadline_initial_s = 120.0
deadline_floor_s = 60.0
deadline_ceiling_s = 120.0
[server]
keep_checkpoints = 3
{server}[limits]
enabled = false
[auth]
mode = "open"
"""


# --- light peers -------------------------------------------------------------------------------
def light_peers(url: str, count: int, steps: int, reports) -> None:
    """``count`` peers as threads of this process; each reports (step, cache failures) per version."""
    from toolkit.client import RelayClient

    def peer() -> None:
        client = RelayClient(url, read_timeout_s=300)
        out = np.empty(client.get_run().num_params, dtype=np.float32)
        for step in range(steps + 1):
            got = None
            while got is None:
                got = client.params.download_params(out, min_step=step, wait_s=30)
            reports.put((got, client.params.cache_failures))
        client.close()

    threads = [threading.Thread(target=peer) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def start_servers(tmp: Path, numel: int, cached: bool):
    """The relay, and nginx in front of it when ``cached``: nginx cannot bind port 0, so its port
    is picked first (the relay's public_params_url names it), again if another process took it."""
    from relay_server.harness.nginx import PortTaken, cache_http_block, free_port, run_nginx

    for attempt in range(5):
        directory = tmp / f"try-{attempt}"
        directory.mkdir(parents=True)
        port = free_port() if cached else 0
        relay = start_relay(directory, relay_config(numel, f"http://127.0.0.1:{port}" if cached else ""))
        if not cached:
            return relay, None
        try:
            return relay, run_nginx(
                directory / "nginx", lambda p: cache_http_block(p, relay.port, directory / "cache"), port=port
            )
        except PortTaken:
            relay.stop()
    raise SystemExit("nginx found no free port in 5 tries")


def run_level(peers: int, steps: int, numel: int, processes: int, cached: bool, tmp: Path) -> dict:
    from toolkit.client import RelayClient
    from toolkit.wire.compression import get_codec
    from toolkit.wire.protocol import PROTOCOL_VERSION, ROUTES, GradientMeta, Heartbeat, JoinRequest

    relay, nginx = start_servers(tmp, numel, cached)
    ctx = mp.get_context("spawn")
    reports = ctx.Queue()
    shares = [peers // processes + (i < peers % processes) for i in range(processes)]
    workers = [ctx.Process(target=light_peers, args=(relay.url, n, steps, reports)) for n in shares if n]
    for w in workers:
        w.start()
    trainer = RelayClient(relay.url)
    codec = get_codec("none")
    peer_id = trainer.join(JoinRequest(peer_name="trainer", protocol=PROTOCOL_VERSION)).peer_id
    failures, started = 0, time.monotonic()
    try:
        for step in range(steps + 1):
            held = 0
            while held < peers:  # every light peer holds this version
                got, failed = reports.get(timeout=600)
                assert got == step, f"a light peer got step {got} while the run is at {step}"
                held, failures = held + 1, max(failures, failed)
            if step == steps:
                break
            while trainer.heartbeat(peer_id, Heartbeat(version=step, samples=1, samples_per_s=1.0)).round is None:
                time.sleep(0.05)
            grad = np.full(numel, 0.01 * (step + 1), dtype=np.float32)
            trainer.upload_gradient(
                codec.encode(grad),
                GradientMeta(peer_id=peer_id, step=step, version=step, samples=1, loss_sum=1.0),
                "none",
            )
        elapsed = time.monotonic() - started
        sent = relay.get(ROUTES["params_egress"], admin=True)
    finally:
        for w in workers:
            w.join(timeout=60)
            if w.is_alive():
                w.kill()
        trainer.close()
        relay.stop()
        if nginx is not None:
            nginx.stop()
    total = sent["direct"] + sent["immutable"] + sent["ref_bytes"]
    versions = steps + 1
    return {
        "peers": peers,
        "cache": cached,
        "versions": versions,
        "relay_bytes": total,
        "relay_bytes_per_step": total / versions,
        "body_bytes": sent["direct"] + sent["immutable"],
        "immutable_requests": sent["immutable_requests"],
        "refs": sent["refs"],
        "peer_cache_failures_max": failures,
        "seconds": round(elapsed, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", default="4,16,64", help="comma-separated numbers of light peers")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps (versions after the first)")
    parser.add_argument("--numel", type=int, default=1_000_000, help="parameters (float32) of the model")
    parser.add_argument("--processes", type=int, default=4, help="processes the light peers run in")
    args = parser.parse_args()
    if shutil.which("nginx") is None and not Path("/usr/sbin/nginx").exists():
        raise SystemExit("nginx is missing: apt-get install -y nginx (the cache this benchmark puts in front)")
    levels = [int(n) for n in args.peers.split(",")]
    results = {}
    with tempfile.TemporaryDirectory(prefix="egress-") as tmp:
        for n in levels:
            for cached in (False, True):
                row = run_level(
                    n,
                    args.steps,
                    args.numel,
                    min(args.processes, n),
                    cached,
                    Path(tmp) / f"{n}-{'cache' if cached else 'direct'}",
                )
                results[(n, cached)] = row
                print(json.dumps(row), flush=True)
    print(f"{'peers':>6} {'relay MB/step direct':>21} {'with cache':>11} {'ratio':>7}")
    for n in levels:
        direct, cached = results[(n, False)], results[(n, True)]
        print(
            f"{n:>6} {direct['relay_bytes_per_step'] / 1e6:>21.2f} {cached['relay_bytes_per_step'] / 1e6:>11.2f} "
            f"{cached['relay_bytes_per_step'] / direct['relay_bytes_per_step']:>7.3f}"
        )
    top = levels[-1]
    print(
        json.dumps(
            {
                "peers": levels,
                "steps": args.steps,
                "numel": args.numel,
                "relay_bytes_per_step": {
                    str(n): {
                        "direct": results[(n, False)]["relay_bytes_per_step"],
                        "cache": results[(n, True)]["relay_bytes_per_step"],
                    }
                    for n in levels
                },
                "cache_failures": max(r["peer_cache_failures_max"] for r in results.values()),
                "relay_bytes_per_step_ratio": results[(top, True)]["relay_bytes_per_step"]
                / results[(top, False)]["relay_bytes_per_step"],
            }
        )
    )


if __name__ == "__main__":
    main()
