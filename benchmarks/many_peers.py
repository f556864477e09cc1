"""A thousand peers on one relay: rounds per minute, round latency and the relay's resources as
the number of peers grows, with every update checked against the sample-weighted mean.

    python benchmarks/many_peers.py --peers 16,256,1000
    python benchmarks/many_peers.py --peers 16,1000 --auth hf     # signed requests, HF login stand-in

Light peers: no torch. A few processes each drive many peers with asyncio + aiohttp over the wire
protocol (``toolkit.wire``): join (after a Hugging Face login through ``tests/hf_standin.py``
with ``--auth hf``), heartbeat every second, "compute" one micro-batch (``--compute-s``), upload
the gradient sum when a heartbeat shows the round for their version, long-poll the new version,
check it against its published sha256. Like a notebook, each peer holds two connections (its
heartbeats, its transfers), so 1,000 peers need more descriptors than a stock soft limit of
1024: the relay is started with ``--soft-limit`` (default 1024) and must raise it itself.

The model is ``toolkit.models:Vector`` with SGD (lr 0.1): peer ``i`` sends ``samples_i * g_i``
(``g_i`` fixed and distinct per peer, ``samples_i = 1 + i % 7``), so each version must equal the
previous one minus lr times the sample-weighted mean of the gradients whose uploads the relay
accepted for that round (the peers' receipts). ``exact`` is that check over every consecutive
pair of versions the peers downloaded.

Per level: rounds/min over the measured window (after every peer joined), relay round latency
p50/p95 (open to publish, from ``/api/status``), relay CPU (% of one core), peak RSS and
descriptors, errors (any failed request but "round closed", which only means a missed round),
exactness. Last line: ``{"levels", "rounds_per_min_ratio", "errors", "exact"}`` (ratio: the
largest level over 16 peers; with ``--auth both`` also ``rounds_per_min_ratio_hf``).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import io
import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from relay_server.harness.process import start_relay  # noqa: E402

LR = 0.1
HEARTBEAT_S = 1.0


def samples_of(index: int) -> int:
    return 1 + index % 7


def gradient(index: int, numel: int) -> np.ndarray:
    return np.sin(np.arange(numel, dtype=np.float64) * 0.37 + index * 1.3).astype(np.float32)


def relay_config(numel: int, peers: int, hf_endpoint: str | None) -> str:
    target = max(1, int(sum(samples_of(i) for i in range(peers)) * 0.9))  # stragglers join the open round
    auth = f'mode = "hf"\nallow_any_hf_user = true\nhf_endpoint = "{hf_endpoint}"' if hf_endpoint else 'mode = "open"'
    return f"""
[run]
name = "many-peers"
target_batch = {target}
max_staleness = 0
[model]
factory = "toolkit.models:Vector"
kwargs = {{ numel = {numel} }}
[optimizer]
name = "sgd"
lr = {LR}
[rounds]
heartbeat_interval_s = {HEARTBEAT_S}
peer_ttl_s = 10.0
deadline_initial_s = 20.0
deadline_floor_s = 3.0
deadline_ceiling_s = 20.0
[server]
keep_checkpoints = 3
[limits]
enabled = false
[auth]
{auth}
"""


# --- the relay process and what it costs -------------------------------------------------------
class Relay:
    """The relay (:func:`relay_server.harness.process.start_relay`, its descriptors capped at ``soft_limit``) and what
    this benchmark reads of its process: CPU seconds, peak RSS and open descriptors."""

    def __init__(self, tmp: Path, config: str, soft_limit: int) -> None:
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        self.server = start_relay(
            tmp, config, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft_limit, hard))
        )
        self.url, self.proc = self.server.url, self.server.proc
        self.peak_rss_mb, self.peak_fds = 0.0, 0

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def sample(self) -> None:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                self.peak_rss_mb = max(self.peak_rss_mb, int(line.split()[1]) / 1024)
        self.peak_fds = max(self.peak_fds, len(os.listdir(f"/proc/{self.proc.pid}/fd")))

    def status(self) -> dict:
        return self.server.get("/api/status")

    def stop(self) -> None:
        self.server.stop()


# --- light peers -------------------------------------------------------------------------------
class _Prepared:
    """The parts of a ``requests.PreparedRequest`` that ``SignedAuth`` reads and writes: signing
    a light peer's request with the toolkit's own code, without requests' costly ``prepare()``."""

    def __init__(self, method: str, path_url: str, body: object, headers: dict[str, str]) -> None:
        self.method, self.path_url, self.body, self.headers = method, path_url, body, headers


class Signer:
    """Signs requests exactly as a notebook peer does (the toolkit's ``SignedAuth``, after a real
    login through the relay); a no-op in open runs."""

    def __init__(self, url: str, token: str | None) -> None:
        self.auth = None
        if token:
            from toolkit.client import RelayClient

            client = RelayClient(url)
            client.login(token)
            self.auth = client.session.auth
            self.auth.verify_responses = False  # the peers check parameter digests themselves

    def headers(self, method: str, path_url: str, body: bytes | None, headers: dict[str, str]) -> dict[str, str]:
        if self.auth is None:
            return headers
        streamed = "X-Collab-Body-Sha256" in headers  # containers: hashed by header + chunk digests
        return self.auth(_Prepared(method, path_url, iter(()) if streamed else body, headers)).headers


class LightPeer:
    def __init__(self, index: int, url: str, numel: int, token: str | None, compute_s: float) -> None:
        self.index, self.url, self.numel, self.compute_s = index, url, numel, compute_s
        self.token, self.signer = token, None
        self.errors: dict[str, int] = {}
        self.receipts: list[tuple[int, int]] = []  # (step, accepted samples)
        self.versions: dict[int, list[float]] = {}  # recorded by the first peer of each process
        self.missed = 0

    def _error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1

    async def call(
        self,
        session,
        method: str,
        path: str,
        *,
        body: bytes | None = None,
        params: str = "",
        headers: dict[str, str] | None = None,
        timeout_s: float = 60,
    ):
        import aiohttp
        from yarl import URL

        path_url = path + (("?" + params) if params else "")
        signed = self.signer.headers(method, path_url, body, dict(headers or {}))
        async with session.request(
            method,
            URL(self.url + path_url, encoded=True),
            data=body,
            headers=signed,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as response:
            return response.status, dict(response.headers), await response.read()

    async def run(self, until: float, record: bool) -> None:
        import aiohttp

        from toolkit.wire.protocol import PROTOCOL_VERSION, ROUTES, Heartbeat, JoinRequest, JoinResponse

        self.signer = await asyncio.to_thread(Signer, self.url, self.token)
        beats = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1, force_close=False))
        transfers = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1, force_close=False))
        try:
            status, _, body = await self.call(
                beats,
                "POST",
                ROUTES["join"],
                body=JoinRequest(
                    peer_name=f"light-{self.index}", protocol=PROTOCOL_VERSION, device={"kind": "cpu"}
                ).dumps(),
                headers={"Content-Type": "application/json"},
            )
            if status != 200:
                self._error(f"join {status}")
                return
            peer_id = JoinResponse.loads(body).peer_id
            version = await self.download(transfers, peer_id, 0, record)
            samples, computed_at = 0, time.monotonic() + self.compute_s
            while time.monotonic() < until and version is not None:
                if not samples and time.monotonic() >= computed_at:
                    samples = samples_of(self.index)
                status, _, body = await self.call(
                    beats,
                    "POST",
                    ROUTES["heartbeat"].format(peer_id=peer_id),
                    body=Heartbeat(version=version, samples=samples, samples_per_s=10.0).dumps(),
                    headers={"Content-Type": "application/json"},
                )
                if status != 200:
                    self._error(f"heartbeat {status}")
                    await asyncio.sleep(HEARTBEAT_S)
                    continue
                state = json.loads(body)  # a CollabState; only two fields matter here
                open_step = state["round"]["step"] if state.get("round") else None
                if samples and open_step == version:
                    await self.upload(transfers, peer_id, version, samples)
                    version = await self.download(transfers, peer_id, version + 1, record)
                    samples, computed_at = 0, time.monotonic() + self.compute_s
                elif state["step"] > version:  # a round went by without this peer: its samples are stale
                    version = await self.download(transfers, peer_id, state["step"], record)
                    samples, computed_at = 0, time.monotonic() + self.compute_s
                else:
                    await asyncio.sleep(HEARTBEAT_S if samples else min(HEARTBEAT_S, computed_at - time.monotonic()))
            await self.call(beats, "POST", ROUTES["leave"].format(peer_id=peer_id), timeout_s=10)
        except (asyncio.TimeoutError, OSError, aiohttp.ClientError) as exc:
            self._error(type(exc).__name__)
        finally:
            await beats.close()
            await transfers.close()

    async def upload(self, session, peer_id: str, step: int, samples: int) -> None:
        from toolkit.wire.auth import BODY_SHA256_HEADER, container_body_sha256, digest_metadata
        from toolkit.wire.protocol import ROUTES, GradientMeta, UploadReceipt
        from toolkit.wire.tensor_container import iter_encoded

        meta = GradientMeta(peer_id=peer_id, step=step, version=step, samples=samples, loss_sum=float(samples))
        tensors = [("payload", gradient(self.index, self.numel) * np.float32(samples))]
        metadata = {"collab": meta.dumps().decode(), "codec": "none"}
        headers = {"Content-Type": "application/octet-stream"}
        if self.signer.auth is not None:
            metadata.update(digest_metadata(tensors))
            headers[BODY_SHA256_HEADER] = container_body_sha256(tensors, metadata)
        body = b"".join(bytes(piece) for piece in iter_encoded(tensors, metadata))
        status, _, answer = await self.call(
            session,
            "PUT",
            ROUTES["gradient"].format(step=step),
            body=body,
            params=f"peer_id={peer_id}",
            headers=headers,
        )
        if status == 200:
            self.receipts.append((step, UploadReceipt.loads(answer).accepted_samples))
        elif status == 409 and b"round_closed" in answer:
            self.missed += 1
        else:
            self._error(f"upload {status}")

    async def download(self, session, peer_id: str, min_step: int, record: bool) -> int | None:
        from toolkit.wire.protocol import ROUTES
        from toolkit.wire.tensor_container import read_container

        for _ in range(3):
            status, headers, body = await self.call(
                session, "GET", ROUTES["params"], timeout_s=90, params=f"min_step={min_step}&wait=60&peer_id={peer_id}"
            )
            if status == 204:
                continue
            if status != 200:
                self._error(f"download {status}")
                return None
            params = np.empty(self.numel, dtype=np.float32)
            header, _ = read_container(io.BytesIO(body), params.nbytes, out={"params": params})
            if hashlib.sha256(params.tobytes()).hexdigest() != headers.get("X-Collab-Sha256"):
                self._error("digest")
                return None
            step = int(header.metadata["step"])
            if record:
                self.versions[step] = params.tolist()
            return step
        self._error("download_timeout")
        return None


def worker(
    url: str, indices: list[int], numel: int, until: float, tokens: dict[int, str], compute_s: float, out: mp.Queue
) -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    async def staggered(k: int, peer: LightPeer) -> None:
        await asyncio.sleep(k * 0.01)  # 100 joins a second per process
        await peer.run(until, record=(k == 0))

    async def run_all() -> list[LightPeer]:
        peers = [LightPeer(i, url, numel, tokens.get(i), compute_s) for i in indices]
        await asyncio.gather(*(staggered(k, p) for k, p in enumerate(peers)))
        return peers

    peers = asyncio.run(run_all())
    out.put([(p.index, p.errors, p.receipts, p.versions, p.missed) for p in peers])


# --- one level ---------------------------------------------------------------------------------
def run_level(peers: int, args: argparse.Namespace, hf: bool) -> dict:
    standin, tokens = None, {}
    if hf:
        from relay_server.harness.hf_standin import HfStandin

        standin = HfStandin().start()
        for i in range(peers):
            tokens[i] = f"hf_token_{i:05d}"
            standin.add_user(tokens[i], f"volunteer{i % 50}")
    with tempfile.TemporaryDirectory() as tmp:
        relay = Relay(Path(tmp), relay_config(args.numel, peers, standin.url if standin else None), args.soft_limit)
        try:
            join_s = peers / (100 * min(args.procs, peers)) + (peers / 100 if hf else 0) + 5
            until = time.monotonic() + join_s + args.duration + 5
            out: mp.Queue = mp.Queue()
            groups = [list(range(peers))[k :: min(args.procs, peers)] for k in range(min(args.procs, peers))]
            procs = [
                mp.Process(target=worker, args=(relay.url, g, args.numel, until, tokens, args.compute_s, out))
                for g in groups
            ]
            for p in procs:
                p.start()
            deadline = time.monotonic() + join_s + 60
            while relay.status()["num_peers"] < peers * 0.98 and time.monotonic() < deadline:
                relay.sample()
                time.sleep(0.5)
            start, cpu0, step0 = time.monotonic(), relay.cpu_s(), relay.status()["step"]
            while time.monotonic() < start + args.duration:
                relay.sample()
                time.sleep(0.5)
            status = relay.status()
            wall, cpu, steps = time.monotonic() - start, relay.cpu_s() - cpu0, status["step"] - step0
            results = [row for _ in procs for row in out.get(timeout=300)]
            for p in procs:
                p.join(timeout=60)
            durations = [r["duration_s"] for r in status["recent_rounds"] if r["step"] > step0]
        finally:
            relay.stop()
            if standin:
                standin.stop()
    errors: dict[str, int] = {}
    for _, errs, *_ in results:
        for k, v in errs.items():
            errors[k] = errors.get(k, 0) + v
    exact, checked = check_exact(results, args.numel)
    q = statistics.quantiles(durations, n=20) if len(durations) >= 2 else [float("nan")] * 19
    return {
        "peers": peers,
        "auth": "hf" if hf else "open",
        "rounds_per_min": round(steps * 60 / wall, 2),
        "round_p50_s": round(statistics.median(durations), 3) if durations else None,
        "round_p95_s": round(q[18], 3),
        "relay_cpu_pct": round(100 * cpu / wall, 1),
        "relay_rss_mb": round(relay.peak_rss_mb, 1),
        "relay_fds": relay.peak_fds,
        "errors": sum(errors.values()),
        "error_kinds": errors,
        "missed_rounds": sum(r[4] for r in results),
        "exact": exact,
        "steps_checked": checked,
    }


def check_exact(results: list, numel: int) -> tuple[bool, int]:
    """Every recorded version = the previous one - lr * (sample-weighted mean of accepted uploads)."""
    versions: dict[int, np.ndarray] = {}
    sums: dict[int, np.ndarray] = {}
    counts: dict[int, int] = {}
    for index, _, receipts, recorded, _ in results:
        for step, params in recorded.items():
            versions[step] = np.asarray(params, dtype=np.float64)
        for step, accepted in receipts:
            sums[step] = sums.get(step, 0) + accepted * gradient(index, numel).astype(np.float64)
            counts[step] = counts.get(step, 0) + accepted
    checked = 0
    for step in sorted(versions):
        if step + 1 in versions and step in counts:
            expected = versions[step] - LR * sums[step] / counts[step]
            if not np.allclose(versions[step + 1], expected, rtol=1e-5, atol=1e-5):
                return False, checked
            checked += 1
    return checked > 0, checked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", default="16,256,1000", help="comma-separated levels")
    parser.add_argument("--auth", choices=("open", "hf", "both"), default="open")
    parser.add_argument("--duration", type=float, default=40.0, help="measured seconds per level")
    parser.add_argument(
        "--procs",
        type=int,
        default=min(4, os.cpu_count() or 2),
        help="peer processes per level (one per core: more only fight the relay for CPU)",
    )
    parser.add_argument("--numel", type=int, default=256, help="parameters of the Vector model")
    parser.add_argument("--compute-s", type=float, default=1.0, help="seconds a peer spends per micro-batch")
    parser.add_argument("--soft-limit", type=int, default=1024, help="the relay's soft RLIMIT_NOFILE at start")
    args = parser.parse_args()
    levels = [int(x) for x in args.peers.split(",")]
    modes = {"open": [False], "hf": [True], "both": [False, True]}[args.auth]
    rows = []
    for hf in modes:
        for peers in levels:
            row = run_level(peers, args, hf)
            rows.append(row)
            print(
                f"{row['auth']:>4} {peers:>5} peers: {row['rounds_per_min']:6.1f} rounds/min, round p50 "
                f"{row['round_p50_s']} s p95 {row['round_p95_s']} s, relay CPU {row['relay_cpu_pct']}%, RSS "
                f"{row['relay_rss_mb']} MB, {row['relay_fds']} fds, errors {row['errors']} {row['error_kinds']}, "
                f"missed {row['missed_rounds']}, exact {row['exact']} ({row['steps_checked']} steps)",
                flush=True,
            )
    summary: dict = {"levels": rows, "errors": sum(r["errors"] for r in rows), "exact": all(r["exact"] for r in rows)}
    for hf in modes:
        mine = [r for r in rows if r["auth"] == ("hf" if hf else "open")]
        base = next((r for r in mine if r["peers"] == 16), mine[0])
        ratio = round(mine[-1]["rounds_per_min"] / base["rounds_per_min"], 3) if base["rounds_per_min"] else 0.0
        summary["rounds_per_min_ratio_hf" if hf and len(modes) > 1 else "rounds_per_min_ratio"] = ratio
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
