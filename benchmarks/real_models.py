"""Real models: relay step time and bytes/param, peer device bytes/param, the tiny recipe's samples/s.

    python benchmarks/real_models.py                     # the reported run (ALBERT-large + GPT-2 125M)
    python benchmarks/real_models.py --models albert-large --steps 2 --skip-demo   # a quick look

Models are built from configs (:func:`toolkit.models.build_model`, no download):
``albert-large`` is the [model] of relay_server/defaults/sahajbert.toml (24 layers sharing one set
of weights, ~18M parameters), ``gpt2-125m`` is GPT-2 small (768 wide, 12 layers, 12 heads, 50257
tokens, 1024 positions; the LM head is tied to the embedding, so P = 124.4M); ``albert-tiny`` (the
demo recipe's model) is there for the smoke test.

**Relay.** For each model and optimizer case -- AdamW 32-bit, LAMB 32-bit (sahajBERT's), AdamW with
8-bit state (bitsandbytes on CPU; skipped with the reason when it fails) -- a real
:class:`relay_server.rounds.master.MasterState` over the model's flat vector gets a random gradient
in ``grad`` and :meth:`apply_gradient` is timed: one warmup step (it allocates the state), then the
median of ``--steps`` steps. Bytes/param = (master 4 + averaged-gradient buffer 4 + every tensor in
``optimizer.state``, shared tensors counted once) / P: 16 for AdamW and LAMB, ~10 with 8-bit moments.
Ratios are against AdamW 32-bit of the same model (step time, bytes). One thread per relay step is
not forced: torch uses the machine's cores as the relay would. On a shared machine step times
are noisy (the JSON keeps every timed step and the 1-minute load average); bytes are exact.

**Peer device.** What a peer keeps on its training device per parameter: parameters, gradients,
and the gradient accumulator when it is on the device (``accumulate_on_host=False``, the default on
an accelerator) -- none of the optimizer state, which lives on the relay. Activations scale with
batch x seq_len, not with P, and are left out of the accounting. With CUDA the script *measures*
``torch.cuda.max_memory_allocated`` over a few micro-batches (batch 1, ``--seq-len`` tokens; this
peak includes activations) and reports ``"measured": "cuda_max_allocated"``. Without CUDA (this
machine) it reports ``"measured": "accounted"``: bytes of the real parameter and gradient tensors
after a backward on a tiny batch, plus a real :class:`toolkit.accumulator.Accumulator`'s
``nbytes_on_device`` (built over meta-device copies of the parameters, i.e. as on an accelerator:
on a CPU the device *is* the host, so the sum is host memory either way). Mixed precision
(autocast bf16/fp16) keeps fp32 parameters and produces fp32 gradients, so its accounted bytes are
those of fp32 (the backward is run under autocast to check the gradient dtype, not assumed):
8 B/param with the accumulator on the host, 12 with it on the device. What mixed precision saves is
activation memory, which only the CUDA measurement sees.

**Tiny recipe.** ``relay-server demo --recipe albert-tiny --peers 2 --steps 10 --target-batch 32
--batch-size 8`` as a subprocess; ``samples_per_s`` is the collaboration's rate from its last JSON
line (``--skip-demo`` leaves it out).

Output: a table, then one JSON line ``{"relay": [...], "peer": [...], "demo": {...}, "loadavg_1m", "wall_s"}``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout, uninstalled

import torch  # noqa: E402

from toolkit.wire.protocol import ModelSpec  # noqa: E402

ALBERT_LARGE = {
    "model_type": "albert",
    "vocab_size": 32000,
    "embedding_size": 128,
    "hidden_size": 1024,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "intermediate_size": 4096,
    "max_position_embeddings": 512,
    "hidden_act": "gelu_new",
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
}
MODELS: dict[str, ModelSpec] = {
    "albert-large": ModelSpec(kind="transformers", architecture="AutoModelForMaskedLM", config=ALBERT_LARGE),
    "gpt2-125m": ModelSpec(
        kind="transformers",
        architecture="AutoModelForCausalLM",
        config={
            "model_type": "gpt2",
            "n_embd": 768,
            "n_layer": 12,
            "n_head": 12,
            "vocab_size": 50257,
            "n_positions": 1024,
        },
    ),
    "albert-tiny": ModelSpec(
        kind="transformers",
        architecture="AutoModelForMaskedLM",
        config={
            "model_type": "albert",
            "vocab_size": 2000,
            "embedding_size": 64,
            "hidden_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "intermediate_size": 512,
            "max_position_embeddings": 64,
        },
    ),
}
OPTIMIZERS = [("adamw", 32), ("lamb", 32), ("adamw", 8)]  # (name, state_bits); the first is the baseline


def build(name: str) -> torch.nn.Module:
    from toolkit.models import build_model

    torch.manual_seed(0)
    return build_model(MODELS[name])


def vocab_of(name: str) -> int:
    return int(MODELS[name].config["vocab_size"])


def state_nbytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer's state; a tensor shared between parameters (a
    quantization map) counts once."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value):
                key = (value.untyped_storage().data_ptr(), value.nbytes)
                if key not in seen:
                    seen.add(key)
                    total += value.nbytes
    return total


# --- relay ----------------------------------------------------------------------------------------
def relay_case(model_name: str, flat: Any, layout: list, opt: str, bits: int, steps: int) -> dict[str, Any]:
    from relay_server.core.config import OptimizerSection
    from relay_server.rounds.master import MasterState

    cfg = OptimizerSection(name=opt, state_bits=bits, lr=1e-4, weight_decay=0.01, eps=1e-6)
    row: dict[str, Any] = {"model": model_name, "optimizer": opt, "state_bits": bits, "params": int(flat.size)}
    try:
        master = MasterState(layout, flat, cfg, total_steps=1000)
    except Exception as exc:  # bitsandbytes missing / refusing CPU tensors: say why, go on
        row["skipped"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        return row
    gen = torch.Generator().manual_seed(1)
    master.grad.copy_(torch.randn(master.grad.shape, generator=gen).mul_(1e-3))
    times = []
    try:
        for i in range(steps + 1):
            start = time.perf_counter()
            master.apply_gradient()
            if i:  # the first step allocates the state: warmup
                times.append(time.perf_counter() - start)
    except Exception as exc:
        row["skipped"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        return row
    p = master.numel
    opt_bytes = state_nbytes(master.optimizer)
    total = master.flat.nbytes + master.grad.nbytes + opt_bytes
    row.update(
        step_s=round(statistics.median(times), 4),
        step_s_all=[round(t, 4) for t in times],
        master_B_per_param=master.flat.nbytes / p,
        grad_B_per_param=master.grad.nbytes / p,
        optimizer_B_per_param=round(opt_bytes / p, 4),
        B_per_param=round(total / p, 4),
    )
    del master
    gc.collect()
    return row


def relay_rows(model_name: str, steps: int) -> list[dict[str, Any]]:
    from relay_server.rounds.master import layout_of
    from toolkit.models.flat import flatten

    model = build(model_name)
    layout, flat = layout_of(model), flatten(model)
    del model
    gc.collect()
    rows = [relay_case(model_name, flat, layout, opt, bits, steps) for opt, bits in OPTIMIZERS]
    base = rows[0]
    for row in rows:
        if "step_s" in row and "step_s" in base:
            row["step_ratio_vs_adamw"] = round(row["step_s"] / base["step_s"], 2)
            row["bytes_ratio_vs_adamw"] = round(row["B_per_param"] / base["B_per_param"], 3)
    return rows


# --- peer device ----------------------------------------------------------------------------------
def _batch(model_name: str, seq_len: int, device: torch.device) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, vocab_of(model_name), (1, seq_len), generator=gen).to(device)
    return {"input_ids": ids, "labels": ids}


def _autocast(precision: str, device: torch.device):
    if precision == "fp32":
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def _mixed(device: torch.device) -> str:
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return "fp16"
    return "bf16"


def peer_rows(model_name: str, seq_len: int, micro_batches: int) -> list[dict[str, Any]]:
    from relay_server.rounds.master import layout_of
    from toolkit.accumulator import Accumulator
    from toolkit.wire.compression import get_codec

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    model = build(model_name).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    layout = layout_of(model)
    total = sum(p.numel() for p in params)
    seq_len = seq_len if cuda else min(seq_len, 16)  # CPU: a backward only to get real gradients
    rows = []
    for precision in ("fp32", _mixed(device)):
        for on_host in (False, True):
            model.zero_grad(set_to_none=True)
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                acc = Accumulator(params, layout, total, get_codec("none"), on_host=on_host)
            else:  # meta copies: the accumulator as an accelerator peer builds it, without the memory
                acc = Accumulator(
                    [torch.empty_like(p, device="meta") for p in params],
                    layout,
                    total,
                    get_codec("none"),
                    on_host=on_host,
                )
            for _ in range(micro_batches if cuda else 1):
                with _autocast(precision, device):
                    loss = model(**_batch(model_name, seq_len, device)).loss
                loss.backward()
                grads = [p.grad for p in params]
                if cuda:
                    acc.add(grads, 1, float(loss), 0)
            grad_dtypes = sorted({str(g.dtype).replace("torch.", "") for g in grads})
            param_bytes = sum(p.nbytes for p in params)
            grad_bytes = sum(g.nbytes for g in grads)
            row = {
                "model": model_name,
                "precision": precision,
                "accumulator": "host" if on_host else "device",
                "params": total,
                "grad_dtype": ",".join(grad_dtypes),
                "params_B_per_param": param_bytes / total,
                "grads_B_per_param": grad_bytes / total,
                "accumulator_B_per_param": acc.nbytes_on_device / total,
            }
            accounted = param_bytes + grad_bytes + acc.nbytes_on_device
            row["accounted_B_per_param"] = round(accounted / total, 3)
            if cuda:
                peak = torch.cuda.max_memory_allocated()
                row.update(
                    measured="cuda_max_allocated",
                    peak_bytes=peak,
                    seq_len=seq_len,
                    micro_batches=micro_batches,
                    B_per_param=round(peak / total, 3),
                    beyond_accounted_B_per_param=round((peak - accounted) / total, 3),
                    before_step_B_per_param=round(base / total, 3),
                )
            else:
                row.update(measured="accounted", B_per_param=row["accounted_B_per_param"])
            rows.append(row)
            del acc, grads
    del model, params
    gc.collect()
    return rows


# --- tiny recipe ----------------------------------------------------------------------------------
def demo_rate(timeout_s: float) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "relay_server.cli",
        "demo",
        "--recipe",
        "albert-tiny",
        "--peers",
        "2",
        "--steps",
        "10",
        "--target-batch",
        "32",
        "--batch-size",
        "8",
    ]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"skipped": f"demo did not finish in {timeout_s:.0f} s"}
    wall = round(time.perf_counter() - start, 1)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            out = json.loads(line)
            return {
                "command": " ".join(["relay-server"] + cmd[3:]),
                "returncode": proc.returncode,
                "samples_per_s": out.get("samples_per_s"),
                "steps": out.get("steps"),
                "first_loss": out.get("first_loss"),
                "last_loss": out.get("last_loss"),
                "wall_s": wall,
            }
    return {"skipped": f"no JSON line from the demo (exit {proc.returncode}): {proc.stderr.strip()[-300:]}"}


# --- report ---------------------------------------------------------------------------------------
def print_tables(relay: list[dict], peer: list[dict], demo: dict | None) -> None:
    print("\nRelay: one optimizer step on the master vector (median), bytes per parameter")
    print(
        f"{'model':<13} {'optimizer':<10} {'P':>12} {'step s':>8} {'x adamw':>8} {'B/param':>8} "
        f"{'opt B/p':>8} {'x adamw':>8}"
    )
    for r in relay:
        label = f"{r['optimizer']}{'-8bit' if r['state_bits'] == 8 else ''}"
        if "skipped" in r:
            print(f"{r['model']:<13} {label:<10} {r['params']:>12,}  skipped: {r['skipped']}")
            continue
        print(
            f"{r['model']:<13} {label:<10} {r['params']:>12,} {r['step_s']:>8.3f} "
            f"{r.get('step_ratio_vs_adamw', 1):>8.2f} {r['B_per_param']:>8.2f} {r['optimizer_B_per_param']:>8.2f} "
            f"{r.get('bytes_ratio_vs_adamw', 1):>8.3f}"
        )
    if peer:
        print(f"\nPeer training device, bytes per parameter ({peer[0]['measured']})")
        print(
            f"{'model':<13} {'precision':<9} {'accum':<7} {'grad':<8} {'params':>7} {'grads':>7} {'accum':>7} "
            f"{'total':>7}"
        )
        for r in peer:
            print(
                f"{r['model']:<13} {r['precision']:<9} {r['accumulator']:<7} {r['grad_dtype']:<8} "
                f"{r['params_B_per_param']:>7.2f} {r['grads_B_per_param']:>7.2f} "
                f"{r['accumulator_B_per_param']:>7.2f} {r['B_per_param']:>7.2f}"
            )
    if demo is not None:
        print(
            "\nTiny recipe: "
            + (
                f"{demo['samples_per_s']} samples/s ({demo['command']}, {demo['wall_s']} s)"
                if "samples_per_s" in demo
                else f"skipped: {demo['skipped']}"
            )
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--models",
        default="albert-large,gpt2-125m",
        help=f"comma-separated, of {', '.join(MODELS)} (default albert-large,gpt2-125m)",
    )
    parser.add_argument(
        "--steps", type=int, default=5, help="timed relay steps per case, after one warmup (default 5)"
    )
    parser.add_argument(
        "--seq-len", type=int, default=128, help="peer micro-batch length, CUDA measurement (default 128)"
    )
    parser.add_argument(
        "--micro-batches", type=int, default=3, help="peer micro-batches, CUDA measurement (default 3)"
    )
    parser.add_argument("--skip-demo", action="store_true", help="leave out the tiny recipe's samples/s")
    parser.add_argument("--demo-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {list(MODELS)}")
    start = time.perf_counter()
    relay, peer = [], []
    for name in names:
        print(f"[{name}] relay ...", file=sys.stderr, flush=True)
        relay += relay_rows(name, args.steps)
        print(f"[{name}] peer ...", file=sys.stderr, flush=True)
        peer += peer_rows(name, min(args.seq_len, 64 if name == "albert-tiny" else args.seq_len), args.micro_batches)
    demo = None
    if not args.skip_demo:
        print("[demo] albert-tiny, 2 peers ...", file=sys.stderr, flush=True)
        demo = demo_rate(args.demo_timeout)
    print_tables(relay, peer, demo)
    print(
        json.dumps(
            {
                "relay": relay,
                "peer": peer,
                "demo": demo,
                "torch_threads": torch.get_num_threads(),
                "loadavg_1m": round(os.getloadavg()[0], 2),
                "wall_s": round(time.perf_counter() - start, 1),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
