"""Every loop people write, under gradient accumulation and fp16 loss scaling, contributes exactly
what one process training on the same global batches computes (issue 21).

Real relay, real peer processes (tests/loop_peer.py): each builds the model and the batches as a
user's own loop does (``toolkit.run_model``, ``opt.batches()``, the optimizer taking the run's
pinned precision by itself) and trains through one loop -- plain, HF Trainer, Accelerate,
Lightning -- with its own accumulation. The run is a tiny ALBERT (masked LM, whose ``forward``
takes ``**kwargs``: the Trainer does not divide its loss) or GPT-2 (causal LM, which honours the
Trainer's ``num_items_in_batch``), with a tokenizer trained by ``relay-server tokenizer train``.
The target batch is one accumulation window of every peer, and the peers run in lockstep (a
window waits until the round holding the peer's last one closed): every round holds exactly one
window of each peer, whatever the scheduling, which each step asserts.

After 3 steps the relay's parameters must equal a reference that trains one copy of the model in
this process on exactly the micro-batches each round received (recorded by the peers), with the
relay's optimizer, to 1e-5 relative; and the loss the relay charted for each step must be the
reference's mean loss over that global batch. In fp16 runs every peer's scaler skips one
accumulation window (an overflow injected into one micro-batch's gradient): the reference leaves
that window out, so a skipped micro-batch that counted anything (gradient, samples or loss) fails.

fp32: the reference computes each global batch in one forward, and trains on from its own
parameters through all 3 steps. bf16 and fp16: it computes each micro-batch under the same autocast
with the largest loss scale up to 2**16 that does not overflow (scaling by a power of two is exact
in floating point, so peers and reference round alike) and sums them weighted by samples -- one
process with gradient accumulation over the same global batch -- and each step starts from the
relay's version before it: half precision rounds activations to 2 or 3 digits, so a 1e-7 difference in the
parameters, which fp32 carries along harmlessly, can flip roundings and grow past 1e-5 within
three steps whatever the collaboration did.

The default suite runs every loop with accumulation 2 and fp16 with its skipped step on ALBERT,
and the Trainer with accumulation 2 (beside a plain loop) on GPT-2; ``-m slow`` runs the whole
matrix: each loop with accumulation 1 and 2, in fp32 and fp16, and with 1 and 4 under bf16
autocast, on both models.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from relay_server.harness import zygote
from tests.support.processes import DEMO_TOKENIZER_VOCAB as VOCAB
from tests.support.training import params_of
from toolkit.client import RelayClient
from toolkit.models import build_model
from toolkit.models.flat import flatten, load_flat
from toolkit.wire.protocol import ModelSpec

REPO = Path(__file__).resolve().parent.parent
LOOP_PEER = Path(__file__).resolve().parent / "loop_peer.py"
LOOPS = ("plain", "trainer", "accelerate", "lightning")
SEQ_LEN, BATCH, STEPS = 16, 2, 3
FP16_SCALE = 2.0**16
MODELS = {
    "albert": (
        "AutoModelForMaskedLM",
        "masked-lm",
        {
            "model_type": "albert",
            "embedding_size": 16,
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "intermediate_size": 64,
            "max_position_embeddings": 32,
            "hidden_dropout_prob": 0.0,
            "attention_probs_dropout_prob": 0.0,
            "classifier_dropout_prob": 0.0,
        },
    ),
    "gpt2": (
        "AutoModelForCausalLM",
        "causal-lm",
        {
            "model_type": "gpt2",
            "n_layer": 1,
            "n_embd": 32,
            "n_head": 2,
            "n_positions": 32,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
        },
    ),
}
# SGD: its update is the gradient itself. (Adam's first steps are nearly the gradient's sign: a peer
# sending twice its gradient would hardly show, while fp16's rounding of gradients near Adam's eps,
# which differs with the loss scale each loop backpropagates at, would.)
OPTIMIZER = {"name": "sgd", "lr": 0.5, "weight_decay": 0.01, "clip_grad_norm": 0.0, "schedule": "constant"}


@pytest.fixture
def tokenizer(demo_tokenizer: Path) -> Path:
    """conftest's ``demo_tokenizer`` (trained once per session), where the loop packages are installed."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    pytest.importorskip("lightning")
    return demo_tokenizer


def spec_of(model: str) -> ModelSpec:
    architecture, _, config = MODELS[model]
    return ModelSpec(kind="transformers", architecture=architecture, config={**config, "vocab_size": VOCAB})


def relay_version(data_dir: Path, step: int) -> np.ndarray:
    """The relay's master parameters at version ``step``, from its data dir."""
    from relay_server.observers.pretrained import master_params
    from relay_server.rounds.store import Store

    store = Store(data_dir)
    try:
        return master_params(store.state_path(step)).numpy()
    finally:
        store.close()


def relative_difference(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def reference_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """The relay's parameter groups (decay on tensors with ndim >= 2) and optimizer, in-process."""
    from relay_server.core.config import OptimizerSection
    from relay_server.rounds.master import _make_optimizer

    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": OPTIMIZER["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}]
    return _make_optimizer(groups, OptimizerSection(**OPTIMIZER))


def rounds_of(peers: list[tuple[str, dict, list]]) -> dict[int, list[dict[str, torch.Tensor]]]:
    """Round step -> the micro-batches it received, from each peer's accumulator events: an add
    covers the accumulation window of the forwards just before it; a take sends the adds since the
    last take to round ``step``, where they count if the upload was applied (a round may close
    without a slow peer); a discard drops them."""
    rounds: dict[int, list[dict[str, torch.Tensor]]] = {}
    for name, result, forwards in peers:
        k, pending, sent = result["accumulation"], [], []
        for event in result["events"]:
            assert event[0] != "restore", (name, "a gradient went back into the accumulator: not in this test")
            if event[0] == "add":
                _, samples, seen = event
                assert samples == k * BATCH, (name, event)
                pending += forwards[seen - k : seen]
            elif event[0] == "take":
                sent, pending = pending, []
            elif event[0] == "settle":
                if event[2]:
                    rounds.setdefault(event[1], []).extend(sent)
                sent = []
            else:
                pending = []
    return rounds


def reference_step(model: torch.nn.Module, opt: torch.optim.Optimizer, micro: list[dict], precision: str) -> float:
    """One step of one process on the global batch ``micro``; returns its mean per-sample loss."""
    opt.zero_grad()
    total = sum(len(mb["input_ids"]) for mb in micro)
    if precision == "fp32":
        batch = {key: torch.cat([mb[key] for mb in micro]) for key in micro[0]}
        loss = model(**batch).loss
        loss.backward()
        value = loss.item()
    else:
        value, summed = 0.0, [torch.zeros_like(p) for p in model.parameters()]
        for mb in micro:
            n, scale = len(mb["input_ids"]), FP16_SCALE if precision == "fp16" else 1.0
            while True:  # as a loss scaler backs off: the largest power of two that does not overflow
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.float16 if precision == "fp16" else torch.bfloat16):
                    loss = model(**mb).loss
                (loss * scale).backward()
                grads = [p.grad for p in model.parameters()]
                if all(torch.isfinite(g).all() for g in grads):
                    break
                scale /= 2
            value += loss.item() * n / total
            for acc, g in zip(summed, grads):
                acc.add_(g, alpha=n / (scale * total))
        for p, acc in zip(model.parameters(), summed):
            p.grad = acc
    opt.step()
    return value


# Local SGD with one inner SGD step and the outer SGD at lr 1 without momentum is sync SGD: the mean
# pseudo-gradient is lr * (mean gradient + weight_decay * params), which the outer step subtracts.
LOCAL_SGD_H1 = {
    "run": {"mode": "local_sgd", "max_staleness": 0},
    "local_sgd": {"inner_steps": 1, "outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False},
}


def train_and_compare(
    serve_relay,
    tmp_path: Path,
    tokenizer: Path,
    model_name: str,
    precision: str,
    peers: list[tuple[str, int]],
    mode: dict | None = None,
) -> float:
    """Train ``peers`` through a real relay and replay the rounds in one process; the worst
    relative difference between a relay version and the reference (each step asserted here too).
    ``mode``: sections merged into the run (``LOCAL_SGD_H1``)."""
    architecture, objective, _ = MODELS[model_name]
    spec = spec_of(model_name)
    per_round = sum(k * BATCH for _, k in peers)
    run = {"target_batch": per_round, "total_steps": STEPS, "precision": precision, **(mode or {}).get("run", {})}
    relay = serve_relay(
        {
            **(mode or {}),
            "run": run,
            "model": {"kind": "transformers", "architecture": architecture, "config": spec.config},
            "tokenizer": {"file": str(tokenizer)},
            "objective": {"name": objective, "seq_len": SEQ_LEN},
            "dataset": {"kind": "demo_corpus"},
            "optimizer": OPTIMIZER,
            # a loaded machine: no round closes for a deadline while a peer computes
            "rounds": {"deadline_floor_s": 60.0, "deadline_initial_s": 120.0},
        }
    )
    initial = params_of(relay.url)
    assert bool(RelayClient(relay.url).get_run().local_sgd) == bool(mode)  # the mode the test asked for
    fp16 = precision == "fp16"
    procs = {}
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    for loop, k in peers:
        name = f"{loop}-k{k}"
        work = tmp_path / name
        work.mkdir()
        skip = ["--skip-micro-batch", str(k - 1)] if fp16 else []  # the first window overflows
        procs[name] = zygote.Popen(
            [
                sys.executable,
                str(LOOP_PEER),
                "--relay",
                relay.url,
                "--name",
                name,
                "--loop",
                loop,
                "--batch-size",
                str(BATCH),
                "--accumulation",
                str(k),
                "--barrier",
                str(barrier),
                "--peers",
                str(len(peers)),
                "--lockstep",
                "--workdir",
                str(work),
                "--result",
                str(work / "result.json"),
                *skip,
            ],
            stdout=open(work / "log", "w"),
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
    try:
        for name, proc in procs.items():
            assert proc.wait(timeout=600) == 0, (tmp_path / name / "log").read_text()[-3000:]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    results = []
    for name in procs:
        result = json.loads((tmp_path / name / "result.json").read_text())
        log = (tmp_path / name / "log").read_text()[-3000:]
        assert result["finished"] and result["precision"] == precision, (name, result, log)  # ended by itself
        assert any(e[0] == "settle" and e[2] for e in result["events"]), (name, "no gradient of it counted", log)
        assert OPTIMIZER["lr"] in result["lrs"], (name, result["lrs"])  # the relay's lr in its param groups
        results.append((name, result, torch.load(str(tmp_path / name / "result.json") + ".batches.pt")))
    rounds = rounds_of(results)
    assert sorted(rounds) == list(range(STEPS)), sorted(rounds)
    final = params_of(relay.url, min_step=STEPS)

    model = build_model(spec)
    model.train()
    load_flat(model, initial)
    opt = reference_optimizer(model)
    charted = {r["step"]: r for r in relay.status()["recent_rounds"]}
    worst = 0.0
    for step in range(STEPS):
        micro = rounds[step]
        if precision != "fp32":  # from the relay's own version (module docstring)
            load_flat(model, relay_version(relay.data_dir, step))
        loss = reference_step(model, opt, micro, precision)
        record = charted[step + 1]
        assert record["samples"] == sum(len(mb["input_ids"]) for mb in micro), (step, record)
        assert record["samples"] == per_round, (step, record)  # lockstep: one window of every peer
        assert record["loss"] == pytest.approx(loss, rel=1e-5), (step, record, loss)
        relative = relative_difference(relay_version(relay.data_dir, step + 1), flatten(model))
        assert relative <= 1e-5, (step + 1, relative)
        worst = max(worst, relative)
    reference = flatten(model)
    assert relative_difference(final, reference) <= 1e-5
    assert np.linalg.norm(final - initial) / np.linalg.norm(initial) > 1e-4  # it did train
    if fp16:  # every peer's scaler skipped its first window (and perhaps more): they counted nothing
        for name, result, forwards in results:
            k = result["accumulation"]
            first_add = next(e for e in result["events"] if e[0] == "add")
            assert first_add[2] > k, (name, result["events"])  # the first window never reached the accumulator
    return max(worst, relative_difference(final, reference))


def test_every_loop_with_accumulation_and_a_skipped_fp16_step_equals_one_process(serve_relay, tmp_path, tokenizer):
    """ALBERT: the Trainer would not divide its loss (``**kwargs``) and sent twice its gradient."""
    worst = train_and_compare(serve_relay, tmp_path, tokenizer, "albert", "fp16", [(loop, 2) for loop in LOOPS])
    assert worst <= 1e-5, worst


def test_trainer_on_a_model_taking_num_items_in_batch_equals_one_process(serve_relay, tmp_path, tokenizer):
    """GPT-2: the Trainer leaves the division to the model's ``num_items_in_batch``, and the charted
    loss was halved; beside it a plain loop without accumulation."""
    worst = train_and_compare(serve_relay, tmp_path, tokenizer, "gpt2", "fp32", [("trainer", 2), ("plain", 1)])
    assert worst <= 1e-5, worst


def test_every_loop_in_local_sgd_mode_equals_one_process(serve_relay, tmp_path, tokenizer):
    """``run.mode = "local_sgd"`` through every loop, with accumulation 2 and a skipped fp16 window:
    the inner step takes what the loop's step() hands over, exactly (H = 1, outer lr 1: sync SGD)."""
    worst = train_and_compare(
        serve_relay, tmp_path, tokenizer, "albert", "fp16", [(loop, 2) for loop in LOOPS], mode=LOCAL_SGD_H1
    )
    assert worst <= 1e-5, worst


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["albert", "gpt2"])
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_loop_matrix_equals_one_process(serve_relay, tmp_path, tokenizer, model_name, precision):
    worst = train_and_compare(
        serve_relay, tmp_path, tokenizer, model_name, precision, [(loop, k) for loop in LOOPS for k in (1, 2)]
    )
    assert worst <= 1e-5, worst


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["albert", "gpt2"])
def test_bf16_loops_with_accumulation_4_equal_one_process(serve_relay, tmp_path, tokenizer, model_name):
    worst = train_and_compare(
        serve_relay, tmp_path, tokenizer, model_name, "bf16", [(loop, k) for loop in LOOPS for k in (1, 4)]
    )
    assert worst <= 1e-5, worst
