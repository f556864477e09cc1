"""What the training tests share: reading a run's parameters back (from the relay, or from the
slice files each owner stored), the rounds peers logged, peers training together with or without
extra aggregators, and the JSON-lines shards a relay's dataset reads."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from toolkit.client import RelayClient
from toolkit.wire.tensor_container import read_file_header

MODEL_KWARGS = {"sizes": [8, 16, 1]}


def relay_params(url: str, min_step: int = 0, wait_s: float = 30) -> tuple[int, np.ndarray]:
    """The relay's published version >= ``min_step`` (the parameters peers hold) and its step."""
    client = RelayClient(url)
    try:
        out = np.empty(client.get_run().num_params, dtype=np.float32)
        step = client.params.download_params(out, min_step=min_step, wait_s=wait_s)
    finally:
        client.close()
    assert step is not None
    return step, out


def params_of(url: str, min_step: int = 0) -> np.ndarray:
    """The parameters of the relay's version >= ``min_step`` (waiting up to 60 s: a loaded machine)."""
    return relay_params(url, min_step, wait_s=60)[1]


def rounds_from_events(peers) -> dict[int, list[int]]:
    rounds: dict[int, list[int]] = defaultdict(list)
    for peer in peers:
        for event in peer.events():
            if event["event"] == "round":
                rounds[event["step"]] += event["ids"]
    return rounds


def train_together(relay, launch_peer, *, steps: int, batch_sizes: tuple[int, ...], seed: int):
    """Peers with these micro-batch sizes train until the relay reaches ``steps``; the peers, the
    final parameters and which samples each round received."""
    peers = [
        launch_peer(
            relay.url, f"p{i}", seed=seed + i, batch_size=b, steps=steps, extra=("--wait-peers", str(len(batch_sizes)))
        )
        for i, b in enumerate(batch_sizes)
    ]
    for peer in peers:
        assert peer.wait() == 0, peer.log_path.read_text()[-2000:]
    _, final = relay_params(relay.url, min_step=steps)
    rounds = rounds_from_events(peers)
    assert sorted(rounds) == list(range(steps))
    return peers, final, rounds


FAST_AGGREGATORS = {
    "heartbeat_interval_s": 0.3,
    "ttl_s": 4.0,
    "call_timeout_s": 20.0,
    "replan_interval_s": 2.0,
    "state_copy_every": 3,
}


def sliced_plan(status: dict) -> list[dict]:
    plan = status["plan"]
    return plan["slices"] if plan and len(plan["slices"]) > 1 else []


def train_sliced(relay, aggregators, launch_peer, more_steps: int, *, seed: int, extra: tuple[str, ...] = ()):
    """Three peers (micro-batches 4/6/8) train until the plan slices the vector among the relay and
    ``aggregators`` and ``more_steps`` steps ran sliced; (peers, the step it was sliced at, status)."""
    peers = [
        launch_peer(
            relay.url,
            f"p{i}",
            seed=seed + i,
            batch_size=b,
            steps=10_000,
            extra=(
                "--wait-peers",
                "3",
                "--wait-aggregators",
                str(len(aggregators)),
                "--sleep-per-batch",
                "0.02",
                *extra,
            ),
        )
        for i, b in enumerate((4, 6, 8))
    ]
    for agg in aggregators:
        agg.wait_registered()
    ways = len(aggregators) + 1
    sliced_at = relay.wait_for(
        lambda s: len(sliced_plan(s)) == ways, timeout_s=90, what=f"a plan slicing the vector {ways} ways"
    )["step"]
    status = relay.wait_for(
        lambda s: len(sliced_plan(s)) == ways and s["step"] >= sliced_at + more_steps,
        timeout_s=60,
        what=f"{more_steps} steps sliced {ways} ways",
    )
    return peers, sliced_at, status


def stored_params(step: int, data_dirs: list[Path], num_params: int) -> np.ndarray:
    """Version ``step`` put together from the slice files every owner wrote for it (what peers
    downloaded: each file's ``params`` is the slice as published)."""
    out = np.full(num_params, np.nan, dtype=np.float32)
    for data_dir in data_dirs:
        path = data_dir / "state" / f"step-{step:08d}.safetensors"
        if path.exists():
            meta = read_file_header(path).metadata
            out[int(meta.get("start", 0)) : int(meta.get("end", num_params))] = load_file(str(path))["params"]
    assert not np.isnan(out).any(), f"no owner stored all of step {step}"
    return out


def write_shards(folder: Path, count: int, rows: int) -> list[str]:
    folder.mkdir(exist_ok=True)
    paths = []
    for i in range(count):
        path = folder / f"part-{i:02d}.jsonl"
        path.write_text("".join(json.dumps({"text": f"part-{i:02d} row {j}"}) + "\n" for j in range(rows)))
        paths.append(str(path))
    return paths


def regression_step(opt, model, seed: int) -> None:
    """One micro-batch of 4 samples of the MLP's regression (8 features, target tanh of their
    sum), through ``opt`` as a notebook's loop would: the step the in-process trainers share."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 8, generator=g)
    batch = torch.cat([x, x.sum(1, keepdim=True).tanh()], dim=1)
    opt.zero_grad()
    loss = model.loss(batch)
    loss.backward()
    opt.step(loss=loss.item())
