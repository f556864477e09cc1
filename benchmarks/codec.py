"""Codec benchmark: size, quality and speed of the wire codecs on random-normal float32.

    python benchmarks/codec.py                  # 64M values (268 MB of float32), ~40 s
    python benchmarks/codec.py --n 16M --reps 5

Human lines first, then one JSON line:
``{"int8_bytes_ratio", "cosine", "encode_MBps", "decode_MBps", "topk2_64"}`` for the int8 codec, and
under ``"topk2_64"`` the sparse codec's ``{"bits_per_param", "encode_MBps", "decode_MBps",
"feedback_MBps"}`` (its cosine to one vector is low by design: error feedback sends the rest later). MB/s are
1e6 bytes of float32 *input* per second (4 bytes per value, whatever the codec sends), single
thread, best of ``--reps`` runs because the machine is shared. The JSON speeds are the steady
state of a training loop (encode into the previous step's buffers, decode into a preallocated
vector); the human lines also show fresh-buffer speeds, which pay the kernel's page faults. The
bytes ratio counts everything on the wire for one vector: the safetensors header, the per-block
scales and the payload.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, uninstalled

from toolkit.wire.compression import ErrorFeedback, get_codec  # noqa: E402
from toolkit.wire.tensor_container import encoded_size  # noqa: E402

RELAY_CHUNK = 1 << 20  # relay_server.rounds.membership.CHUNK_ELEMS, inlined: the benchmark needs no relay
SLICE = 1 << 22  # float64 working slice for the quality metrics, to keep memory flat


def best_seconds(fn: Callable[[], object], reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def cosine_and_max_error(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Cosine similarity and max |x - y|, accumulated in float64 slice by slice."""
    dot = xx = yy = 0.0
    worst = 0.0
    for lo in range(0, x.size, SLICE):
        a, b = x[lo : lo + SLICE].astype(np.float64), y[lo : lo + SLICE].astype(np.float64)
        dot, xx, yy = dot + float(a @ b), xx + float(a @ a), yy + float(b @ b)
        worst = max(worst, float(np.abs(a - b).max()))
    return dot / np.sqrt(xx * yy), worst


def parse_count(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=parse_count, default=64 << 20, help="values per vector (e.g. 64M)")
    parser.add_argument("--reps", type=int, default=3, help="runs per measurement; the best counts")
    args = parser.parse_args()
    n, mb = args.n, args.n * 4 / 1e6
    x = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    out = np.empty(n, dtype=np.float32)
    print(
        f"codec benchmark: {n:,} random-normal float32 values ({mb:.0f} MB), best of {args.reps}, "
        f"numpy {np.__version__}"
    )
    print(
        "  steady state: encode into the previous step's buffers, decode into a preallocated vector "
        "(fresh: new buffers every call, paying the page faults)"
    )
    results: dict[str, dict[str, float]] = {}
    for name in ("none", "float16", "int8", "topk2-64"):
        codec = get_codec(name)
        tensors = codec.encode(x)
        fresh_encode_s = best_seconds(lambda: codec.encode(x), args.reps)
        encode_s = best_seconds(lambda: codec.encode(x, out=tensors), args.reps)
        fresh_decode_s = best_seconds(lambda: codec.decode(tensors, n=n), args.reps)
        decode_s = best_seconds(lambda: codec.decode(tensors, out=out), args.reps)
        cosine, max_error = cosine_and_max_error(x, out)
        ratio = encoded_size(tensors, {"codec": name}) / (4 * n)
        results[name] = {"ratio": ratio, "cosine": cosine, "encode": mb / encode_s, "decode": mb / decode_s}
        print(
            f"  {name:8s} {ratio:6.4f} x float32 ({ratio * 32:.3f} bits/value) on the wire, cosine {cosine:.7f}, max |err| {max_error:.3g}; "
            f"encode {mb / encode_s:5.0f} MB/s (fresh {mb / fresh_encode_s:5.0f}), "
            f"decode {mb / decode_s:5.0f} MB/s (fresh {mb / fresh_decode_s:5.0f})"
        )

    # The relay's path: decode each arriving 1M-value chunk into a scratch and add it to the sum.
    codec = get_codec("int8")
    tensors = dict(codec.encode(x))
    payload = tensors.pop("payload")
    scratch = np.empty(RELAY_CHUNK, dtype=np.float32)

    def reduce_stream() -> None:
        for lo in range(0, n, RELAY_CHUNK):
            piece = payload[lo : lo + RELAY_CHUNK]
            decoded = codec.decode_range(tensors, piece, lo, out=scratch[: piece.size])
            np.add(out[lo : lo + piece.size], decoded, out=out[lo : lo + piece.size])

    validate_s = best_seconds(lambda: codec.validate(tensors, payload.dtype, n), args.reps)
    reduce_s = best_seconds(reduce_stream, args.reps)
    print(
        f"  int8 relay path: validate side tensors {validate_s * 1e3:.1f} ms, "
        f"streamed decode + add in {RELAY_CHUNK:,}-value chunks {mb / reduce_s:.0f} MB/s"
    )
    feedback = ErrorFeedback(codec, n)
    previous = feedback.compress(x)
    feedback_s = best_seconds(lambda: feedback.compress(x, out=previous), args.reps)
    print(f"  int8 peer path: ErrorFeedback.compress (encode + decode the residual) {mb / feedback_s:.0f} MB/s")

    del previous, feedback
    sparse = get_codec("topk2-64")
    feedback = ErrorFeedback(sparse, n)
    previous = feedback.compress(x)
    sparse_feedback_s = best_seconds(lambda: feedback.compress(x, out=previous), args.reps)
    print(f"  topk2-64 peer path: ErrorFeedback.compress {mb / sparse_feedback_s:.0f} MB/s")

    int8, topk2 = results["int8"], results["topk2-64"]
    print(
        json.dumps(
            {
                "int8_bytes_ratio": round(int8["ratio"], 5),
                "cosine": round(int8["cosine"], 7),
                "encode_MBps": round(int8["encode"]),
                "decode_MBps": round(int8["decode"]),
                "topk2_64": {
                    "bits_per_param": round(topk2["ratio"] * 32, 4),
                    "encode_MBps": round(topk2["encode"]),
                    "decode_MBps": round(topk2["decode"]),
                    "feedback_MBps": round(mb / sparse_feedback_s),
                },
            }
        )
    )


if __name__ == "__main__":
    main()
