"""Input pipeline vs. training throughput for the demo model on CPU.

    python benchmarks/input_pipeline.py                 # ~30 s on an idle core
    python benchmarks/input_pipeline.py --seconds 10

The pipeline is the one a volunteer runs (toolkit.data.stream_batches): generated text shards
(Parquet for a "wikipedia", JSON lines for an "oscar"), mixed 0.23 / 0.77, shuffle buffer 10,000,
byte tokenization, packing into [8, 65] batches. Training is the demo peer's work on the same
batches: ByteTransformer with demo.toml's kwargs, forward + backward + adding the gradients into a
flat accumulator the way CollaborativeOptimizer does, on one thread (``torch.set_num_threads(1)``
like ``python -m toolkit.peer``). A sample is one packed row of seq_len + 1 tokens.

The pipeline must be >= 5x faster than training so it never starves a peer; the exit status is 1
if it is not. Human lines first, then one JSON line:
``{"pipeline_samples_per_s": ..., "train_samples_per_s": ...}``. Rates are best-of-``--reps``
windows because the machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import tomllib
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # before anything imports datasets: local files only

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout, uninstalled

from toolkit.corpus import demo_corpus  # noqa: E402
from toolkit.data import DatasetSpec, StreamConfig, stream_batches  # noqa: E402
from toolkit.models import ByteTransformer  # noqa: E402

BATCH, SEQ_LEN = 8, 64


def write_shards(folder: Path, shards: int = 4, rows: int = 2500, seed: int = 0) -> tuple[list[str], list[str]]:
    """Parquet and JSON-lines shards of documents cut from the demo corpus (100..1500 chars)."""
    text = bytes(demo_corpus().numpy()).decode("ascii")
    rng = random.Random(seed)

    def docs() -> list[str]:
        out = []
        for _ in range(rows):
            start, length = rng.randrange(len(text) - 1500), rng.randrange(100, 1500)
            out.append(text[start : start + length])
        return out

    wiki, oscar = [], []
    for i in range(shards):
        path = folder / f"wiki-{i:02d}.parquet"
        pq.write_table(pa.table({"text": docs()}), path, row_group_size=500)
        wiki.append(str(path))
        path = folder / f"oscar-{i:02d}.jsonl"
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs()))
        oscar.append(str(path))
    return wiki, oscar


def best_rate(step, samples_per_call: int, seconds: float, reps: int) -> float:
    """Best samples/s over ``reps`` windows of about ``seconds / reps`` each."""
    best = 0.0
    for _ in range(reps):
        calls, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds / reps:
            step()
            calls += 1
        best = max(best, calls * samples_per_call / elapsed)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="measuring time per side (default 10)")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    kwargs = tomllib.loads((REPO / "relay_server/defaults/demo.toml").read_text())["model"]["kwargs"]
    assert kwargs["seq_len"] == SEQ_LEN, kwargs

    with tempfile.TemporaryDirectory() as tmp:
        wiki, oscar = write_shards(Path(tmp))
        config = StreamConfig(
            datasets=(
                DatasetSpec(name="wikipedia", data_files=tuple(wiki), probability=0.23),
                DatasetSpec(name="oscar", data_files=tuple(oscar), probability=0.77),
            ),
            cache_dir=str(Path(tmp) / "cache"),
        )
        started = time.perf_counter()
        batches = stream_batches(config, batch_size=BATCH, seq_len=SEQ_LEN, seed="bench")
        first = next(batches)
        first_s = time.perf_counter() - started  # includes filling both 10,000-row shuffle buffers
        pipeline = best_rate(lambda: next(batches), BATCH, args.seconds, args.reps)
        kept = [next(batches) for _ in range(16)]
        batches.close()

    model = ByteTransformer(**kwargs)
    params = [p for p in model.parameters()]
    accum = torch.zeros(sum(p.numel() for p in params))
    views = list(torch.split(accum, [p.numel() for p in params]))
    views = [v.view_as(p) for v, p in zip(views, params)]
    it = iter(range(1 << 62))

    def train_step() -> None:
        batch = kept[next(it) % len(kept)]
        model.zero_grad(set_to_none=True)
        model.loss(batch).backward()
        torch._foreach_add_(views, [p.grad for p in params], alpha=float(BATCH))

    train_step()  # warm-up (allocator, autograd graph caches)
    train = best_rate(train_step, BATCH, args.seconds, args.reps)

    ratio = pipeline / train
    print(
        f"demo model: {sum(p.numel() for p in params) / 1e6:.2f}M params, batch {BATCH} x {SEQ_LEN + 1} tokens, "
        f"{torch.get_num_threads()} thread"
    )
    print(
        f"first batch after {first_s:.2f} s (shuffle buffers of {config.shuffle_buffer} rows filled); "
        f"batch shape {tuple(first.shape)}"
    )
    print(f"input pipeline: {pipeline:9.1f} samples/s")
    print(f"training:       {train:9.1f} samples/s (forward + backward + accumulate)")
    print(f"pipeline / training = {ratio:.1f}x ({'OK' if ratio >= 5 else 'TOO SLOW'}: needs >= 5x)")
    print(json.dumps({"pipeline_samples_per_s": round(pipeline, 1), "train_samples_per_s": round(train, 1)}))
    return 0 if ratio >= 5 else 1


if __name__ == "__main__":
    sys.exit(main())
