"""The DMoE language model (:class:`toolkit.models.DMoEByteLM`, Learning@home s4.3): its math
against a local mixture, a run of it through a real relay and real expert host processes against
one process, the run's [moe]/[model] agreement, and its recipe built offline (tokenizer trained
here, causal-LM objective, no hub)."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from relay_server.harness import zygote
from relay_server.harness.process import wait_until
from tests.dmoe_lm_trainer import lm_batches
from tests.support.moe import LM_KWARGS as KWARGS
from tests.support.moe import LM_LR as LR
from tests.support.moe import directory, lm_run, start_host, stop
from tests.support.processes import REPO, merged, write_config
from tests.support.training import relay_params
from toolkit.models import ByteTransformer, DMoEByteLM, loss_of
from toolkit.models.flat import load_flat
from toolkit.moe import LocalMixtureOfExperts, LoopbackCaller
from toolkit.wire import payloads


def local_reference(model: DMoEByteLM, experts: dict[str, torch.nn.Module]) -> ByteTransformer:
    """The same decoder with each block's mixture a :class:`LocalMixtureOfExperts` over copies of
    ``experts`` (plain autograd), its dense parameters and gates copied from ``model``."""
    cfg = model.cfg
    copies = copy.deepcopy(experts)
    layers = [
        LocalMixtureOfExperts(
            cfg.d_model, layer.grid.size, layer.k, {u: copies[u] for u in layer.grid.all_uids()}, layer.grid.uid_prefix
        )
        for layer in model.moe
    ]
    reference = ByteTransformer(
        feed_forward=layers.__getitem__,
        vocab_size=cfg.vocab_size,
        seq_len=cfg.seq_len,
        d_model=cfg.d_model,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
    )
    missing, unexpected = reference.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all(".experts." in name for name in missing), missing
    for uid, expert in copies.items():  # the decoder's initialisation drew over them: the experts' own values again
        expert.load_state_dict(experts[uid].state_dict())
    return reference


def test_the_dmoe_lm_trains_as_a_local_mixture_of_the_same_experts(demo_tokenizer: Path) -> None:
    """Remote mixtures behind a LoopbackCaller (one SGD step per backward call, as a host) vs the
    decoder whose mixtures hold the experts as submodules, plain SGD over everything: the same
    logits, losses and parameters, step after step, on the objective's dict batches."""
    torch.manual_seed(0)
    model = DMoEByteLM(**KWARGS)
    experts = {uid: model.make_expert(uid) for uid in model.expert_uids()}
    reference = local_reference(model, experts)
    with LoopbackCaller(experts, optimizer_factory=lambda m: torch.optim.SGD(m.parameters(), lr=LR)) as caller:
        model.attach_caller(caller)
        dense = torch.optim.SGD(model.parameters(), lr=LR)
        everything = torch.optim.SGD(reference.parameters(), lr=LR)
        for batch in lm_batches(demo_tokenizer, 5):
            out = model(**batch)
            ref = reference(**batch)
            ref_loss = (
                ref.loss + model.balancing_coef * torch.stack([b.ff.balancing_loss for b in reference.blocks]).mean()
            )
            torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(
                loss_of(model, batch), ref_loss, rtol=1e-5, atol=1e-6
            )  # loss_of: the same forward again
            dense.zero_grad()
            everything.zero_grad()
            out.loss.backward()
            ref_loss.backward()
            dense.step()
            everything.step()
    assert all(layer.stats.failures == 0 and layer.stats.calls > 0 for layer in model.moe)
    named = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, named[name], rtol=1e-5, atol=1e-6, msg=name)
    for layer in reference.blocks:
        for uid in layer.ff.uids:
            for (name, a), b in zip(experts[uid].named_parameters(), layer.ff.expert(uid).parameters()):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{uid}.{name}")


def test_a_dmoe_lm_run_through_a_relay_and_two_hosts_equals_one_process(
    serve_relay, demo_tokenizer: Path, tmp_path: Path
) -> None:
    """relay + 2 expert host processes + a trainer process (``toolkit.join`` on the run's
    DMoEByteLM, causal-LM dict batches of the run's tokenizer), SGD everywhere: every dense
    parameter (the relay's state) and every expert (the relay's checkpoints) equals the same
    model trained in one process with a LoopbackCaller, to 1e-5."""
    steps = 10
    relay = serve_relay(lm_run(steps, demo_tokenizer))
    _, initial = relay_params(relay.url)
    hosts = [start_host(relay.url, f"host{i}", 4, tmp_path / f"host{i}.log") for i in range(2)]
    try:
        wait_until(lambda: len(directory(relay.url)["live"]) == 8, 60, "both hosts to lease 4 experts each")
        done = zygote.run(
            [sys.executable, "tests/dmoe_lm_trainer.py", relay.url, str(steps), str(demo_tokenizer)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        stop(hosts)  # a clean stop uploads each expert's final checkpoint
    assert done.returncode == 0, done.stderr[-3000:]
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcome["final_step"] == steps, outcome
    assert all(
        layer["calls"] > 0 and layer["failures"] == layer["backward_failures"] == 0 for layer in outcome["layers"]
    ), outcome

    torch.manual_seed(0)
    model = DMoEByteLM(**KWARGS)
    load_flat(model, initial)
    experts = {uid: model.make_expert(uid) for uid in model.expert_uids()}
    with LoopbackCaller(experts, optimizer_factory=lambda m: torch.optim.SGD(m.parameters(), lr=LR)) as caller:
        model.attach_caller(caller)
        dense = torch.optim.SGD(model.parameters(), lr=LR)
        for batch in lm_batches(demo_tokenizer, steps):
            dense.zero_grad()
            loss_of(model, batch).backward()
            dense.step()
    _, final = relay_params(relay.url, min_step=steps)
    reference = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    np.testing.assert_allclose(final, reference, rtol=1e-5, atol=1e-6)
    for uid, expert in experts.items():
        stored = latest_checkpoint(relay.data_dir, uid)
        for name, p in expert.named_parameters():
            np.testing.assert_allclose(
                stored[f"p.{name}"], p.detach().numpy(), rtol=1e-5, atol=1e-6, err_msg=f"{uid}.{name}"
            )


def latest_checkpoint(data_dir: Path, uid: str) -> dict[str, np.ndarray]:
    files = sorted((data_dir / "experts" / uid).glob("*.safetensors"))
    return payloads.decode(files[-1].read_bytes(), 1 << 24)[1]


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"moe": {"k": 4}},
            "the model's mixture differs from [moe]: model.kwargs.k = 2 but [moe] says 4: set both to one value",
        ),
        (
            {"moe": {"expert": {"kind": "ffn", "d": 16, "hidden": 16}}},
            "the model's mixture differs from [moe]: model.kwargs.hidden = 8 but [moe] says 16: set both to one value",
        ),
        (
            {"moe": {"enabled": False}},
            "model.factory DMoEByteLM needs [moe] enabled = true (its experts live on hosts)",
        ),
    ],
)
def test_a_dmoe_lm_run_whose_moe_disagrees_is_refused_in_one_line(
    demo_tokenizer: Path, tmp_path: Path, change: dict, message: str
) -> None:
    """``relay-server serve`` on a DMoEByteLM run whose [moe] describes other experts: one line
    naming the setting, exit 2, nothing created."""
    sections = merged(lm_run(0, demo_tokenizer))
    sections["moe"] = {**sections["moe"], **change["moe"]}
    config = write_config(tmp_path / "run.toml", sections)
    done = zygote.run(
        [
            sys.executable,
            "-m",
            "relay_server.cli",
            "serve",
            "--config",
            str(config),
            "--data-dir",
            str(tmp_path / "data"),
            "--port",
            "0",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [f"relay-server: configuration error: {message}"]
    assert not (tmp_path / "data").exists()


@pytest.mark.integration
@pytest.mark.slow
def test_the_moe_lm_benchmark_compares_the_dmoe_lm_with_its_dense_baselines_under_latency_and_failures() -> None:
    """``benchmarks/moe_lm.py`` (Learning@home s4.3) at a tiny size: a DMoE LM whose experts sit on
    2 host processes behind 500 ms, dropping 10% of their tasks, and the small and base dense
    models, the same tokens each; the last line is the comparison. What it measures at its
    defaults is in docs/experts.md (the paper's dmoe_vs_small < 1 is reported there, not asserted: a
    tiny run says little about it)."""
    done = zygote.run(
        [
            sys.executable,
            "benchmarks/moe_lm.py",
            "--steps",
            "4",
            "--d",
            "32",
            "--expert-hidden",
            "32",
            "--vocab",
            "300",
            "--grid",
            "2",
            "4",
            "--k",
            "2",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    print(done.stdout)
    lines = [json.loads(line) for line in done.stdout.strip().splitlines() if line.startswith("{")]
    runs, summary = {r["model"]: r for r in lines[:-1]}, lines[-1]
    assert set(runs) == {"dmoe", "small", "base"}
    assert all(0 < r["val_loss"] < 2 * np.log(300) and r["micro_batches"] == 4 for r in runs.values()), runs
    assert runs["dmoe"]["experts"] == 16 and runs["dmoe"]["failed_calls"] > 0  # the injected failures happened
    assert runs["base"]["d_ff"] == 2 * runs["small"]["d_ff"] == 64  # k experts' FLOPs, one expert's size
    assert summary["dmoe_vs_small"] == round(runs["dmoe"]["val_loss"] / runs["small"]["val_loss"], 4)
    assert summary["dmoe_vs_base"] == round(runs["dmoe"]["val_loss"] / runs["base"]["val_loss"], 4)
