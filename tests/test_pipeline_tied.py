"""Stages of decoders with tied input/output embeddings compute what the whole model computes.

GPT-2 (tied by default) and a tied Llama: the flat vector holds the tied matrix once, in stage
0's range; the last stage's head reads a copy of that range (``Stage.load_tied``) and gives its
gradient apart (``Stage.tied_grad``). Chained, the stages give the whole model's loss exactly,
and stage 0's embedding gradient plus the head's is the whole model's gradient of the tied
matrix exactly (0.0 difference in fp32: one process also adds exactly those two terms, and a
float sum of two terms does not depend on their order). With GPT-2's default dropout, the
stage worker's tasks (:mod:`toolkit.pipeline.compute`) give it to 1e-5 as for untied models.
What a worker of the last stage holds counts the copy (its memory, the planner's stage sizes);
relay runs on real processes: tests/test_pipeline_tied_run.py.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from relay_server.backbone.slice_owner import SliceOwner
from relay_server.core.config import OptimizerSection
from relay_server.pipeline.plan import model_shape
from relay_server.pipeline.tied import TiedEmbedding
from relay_server.rounds.publisher import sha256_of
from relay_server.rounds.store import Store
from tests.support.pipeline_models import (
    DEFAULT_GPT2_SPEC,
    GPT2_DROPOUT_SPEC,
    GPT2_SPEC,
    LLAMA_SPEC,
    batch_for,
    run_pipeline,
    tied,
)
from toolkit.models import build_model, loss_of
from toolkit.models.flat import flatten
from toolkit.pipeline import build_stage, compute, cut_stages, pipeline_units, units_of
from toolkit.pipeline.compute import pipeline_masks
from toolkit.pipeline.stage import Stage
from toolkit.pipeline.worker_memory import memory_model
from toolkit.wire.compression import run_codecs
from toolkit.wire.protocol import ModelSpec, ParamSpec

TIED = {"gpt2": tied(GPT2_SPEC), "llama": tied(LLAMA_SPEC)}
DEFAULT_GPT2 = DEFAULT_GPT2_SPEC


def stages_of(spec: ModelSpec, layers: list[int]) -> tuple[torch.nn.Module, list[Stage]]:
    """The whole model and its stages, each loaded from its slice of the flat vector (the last
    one's tied copy from stage 0's range of it)."""
    torch.manual_seed(0)
    model = build_model(spec)
    flat = torch.from_numpy(flatten(model))
    stages = [build_stage(spec, cut) for cut in cut_stages(pipeline_units(model), layers)]
    for stage in stages:
        stage.load_flat(flat[stage.cut.start : stage.cut.end])
        if stage.tied is not None:
            stage.load_tied(flat[stage.tied[0] : stage.tied[1]])
    return model, stages


def whole_grad(stages: list[Stage], grads: list[torch.Tensor], head: torch.Tensor | None) -> torch.Tensor:
    """The stages' gradients as one flat vector, the head's tied gradient added to stage 0's
    embedding gradient (what the relay would sum before stage 0 steps)."""
    flat = torch.cat(grads)
    last = stages[-1]
    if last.tied is not None:
        assert head is not None
        flat[last.tied[0] : last.tied[1]] += head
    return flat


@pytest.mark.parametrize("layers", [[1, 3], [3, 1], [1, 2, 1], [4]], ids=lambda layers: "-".join(map(str, layers)))
@pytest.mark.parametrize("name", sorted(TIED))
def test_tied_stages_chain_to_the_whole_models_loss_and_gradient(name: str, layers: list[int]) -> None:
    model, stages = stages_of(TIED[name], layers)
    embed = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight is embed  # really tied
    units = pipeline_units(model)
    assert units.tied == (0, embed.numel()) and units.total == flatten(model).size
    if len(layers) > 1:  # the last stage holds only its range; the copy is apart
        last = stages[-1]
        assert last.tied == units.tied and sum(p.numel() for p in last.parameters()) == last.cut.numel
        assert last.tied_weight().shape == embed.shape
        assert torch.equal(last.tied_weight(), embed.detach())
    batch = batch_for(name, torch.Generator().manual_seed(1))
    model.zero_grad()
    want_loss = loss_of(model, batch)
    want_loss.backward()
    want = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    loss, _ = run_pipeline(stages, batch)
    head = stages[-1].tied_grad() if stages[-1].tied is not None else None
    got = whole_grad(stages, [stage.flat_grad() for stage in stages], head)
    assert torch.equal(loss.detach(), want_loss.detach())
    assert got.shape == want.shape
    assert float((got - want).abs().max()) == 0.0
    if head is not None:  # the head's part is real: without it the embedding's gradient is wrong
        assert float(head.abs().max()) > 0.0
        stages[-1].zero_grad()
        assert float(stages[-1].tied_grad().abs().max()) == 0.0


@pytest.mark.parametrize("layers", [[2, 2], [1, 2, 1]], ids=lambda layers: "-".join(map(str, layers)))
def test_default_gpt2_tasks_replay_dropout_and_give_the_tied_gradient(layers: list[int]) -> None:
    """GPT-2's default config (tied, dropout 0.1) as the stage worker's tasks compute it:
    forwards without a graph, backwards recomputed from stored inputs, the last stage's giving
    the head's tied gradient too; equal to the whole model with the pipeline's masks to 1e-5."""
    model, stages = stages_of(DEFAULT_GPT2, layers)
    assert model.config.tie_word_embeddings and model.config.embd_pdrop == 0.1
    batch = batch_for("gpt2", torch.Generator().manual_seed(6))
    microbatch, samples = 5, 2
    model.zero_grad()
    with pipeline_masks(model, layers, microbatch):
        want_loss = loss_of(model, batch)
    (want_loss * samples).backward()
    want = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    torch.manual_seed(99)  # the worker's own generators: nothing of them may matter
    inputs = [stages[0].inputs(batch)]
    for stage in stages[:-1]:
        inputs.append(compute.forward(stage, inputs[-1], microbatch))
    last = compute.backward(stages[-1], inputs[-1], microbatch, batch=batch, samples=samples)
    grads, g = [torch.cat([p.reshape(-1) for p in last.params])], last.input
    for k in reversed(range(len(stages) - 1)):
        result = compute.backward(stages[k], inputs[k], microbatch, grad_output=g)
        grads.insert(0, torch.cat([p.reshape(-1) for p in result.params]))
        g = result.input
    assert last.tied is not None and last.loss is not None
    got = whole_grad(stages, grads, last.tied.reshape(-1))
    assert abs(last.loss - float(want_loss)) <= 1e-5 * abs(float(want_loss))
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-5
    untied_only = whole_grad(stages, grads, torch.zeros_like(last.tied.reshape(-1)))
    assert float((untied_only - want).abs().max() / want.abs().max()) > 1e-2  # the head's term matters


def test_a_relay_cuts_a_tied_model_and_counts_the_copy_on_the_last_stage() -> None:
    """GPT-2's default config loads as a pipeline run (no refusal): the relay's cut knows the tied
    range, and every estimate of the last stage's worker -- its memory, so ``stages = "auto"``
    and the stage a volunteer is given, and the planner's time per batch -- counts the copy."""
    units = units_of(DEFAULT_GPT2)
    vocab, width = DEFAULT_GPT2.config["vocab_size"], DEFAULT_GPT2.config["n_embd"]
    assert units.tied == (0, vocab * width)
    untied = units_of(GPT2_DROPOUT_SPEC)
    assert untied.tied is None and untied.total == units.total + vocab * width  # the head held once
    memory = memory_model(DEFAULT_GPT2, units, 2, 16)
    plain = memory_model(GPT2_DROPOUT_SPEC, untied, 2, 16)
    assert memory.tied_params == vocab * width and plain.tied_params == 0
    # the tied last stage holds its copy as the untied one holds its own head: the same in every term
    assert [memory.worker(k, 2, 2) for k in range(2)] == [plain.worker(k, 2, 2) for k in range(2)]
    assert memory.worker(1, 2, 2).parameters > memory.worker(1, 2, 2).parameters - 8 * vocab * width > 0
    assert memory.stage_params(0, 1, 4) == units.total  # one stage: the model's own tie, no copy
    assert model_shape(units, "none", width, 16).last_params == model_shape(untied, "none", width, 16).last_params


def test_a_tied_copy_of_the_wrong_size_is_refused() -> None:
    _, stages = stages_of(TIED["gpt2"], [2, 2])
    with pytest.raises(ValueError, match="stage 0's flat slice"):
        stages[-1].load_tied(torch.zeros(7))
    with pytest.raises(ValueError, match="reads no tied embedding"):
        stages[0].tied_weight()


def test_the_relay_adds_the_heads_mean_into_stage_0s_once_before_the_norm(tmp_path) -> None:
    """The relay's side (:mod:`relay_server.pipeline.tied`) on two real stage owners: stage 0's
    slice [0, 12) holds the tied matrix [0, 8); the last stage's [12, 16) carries the head's
    gradient of it in every upload. Folded, stage 0's mean of the matrix is its own plus the
    carried one -- what the global norm sees and the step applies -- added once however often a
    finalize is retried; the last stage steps its own range only. The copy the last stage's
    workers download is exactly stage 0's range of the matrix, under a hash of its own."""
    layout = [
        ParamSpec(name="embed", shape=[4, 2], offset=0),
        ParamSpec(name="pos", shape=[4], offset=8),
        ParamSpec(name="norm", shape=[4], offset=12),
    ]
    sgd = OptimizerSection(name="sgd", lr=1.0, weight_decay=0.0, momentum=0.0)
    params = np.arange(1, 17, dtype=np.float32)
    tie = TiedEmbedding(0, 8, num_stages=2)
    owners = [
        SliceOwner(
            layout,
            {"params": params[start:end].copy()},
            start=start,
            end=end,
            step=0,
            optimizer=sgd,
            total_steps=0,
            codecs=run_codecs("none"),
            store=Store(tmp_path / str(k)),
            carry=tie.carry(k),
        )
        for k, (start, end) in enumerate([(0, 12), (12, 16)])
    ]
    first, last = owners
    assert (first.upload_numel, last.upload_numel) == (12, 4 + 8)
    initial = [owner.write_initial() for owner in owners]
    for owner, version in zip(owners, initial):
        owner.publisher.publish(version)
    rng, samples = np.random.default_rng(0), 4
    own, carried = rng.normal(size=12).astype(np.float32), rng.normal(size=12).astype(np.float32)
    for owner, mean in ((first, own), (last, carried)):  # what the round's uploads summed
        owner.reducer.sum[:] = mean * samples
        owner.reducer.weights[:] = samples

    async def close() -> tuple[float, float]:
        await tie.fold(owners, 0, "round-1")
        await tie.fold(owners, 0, "round-1")  # a retried finalize: nothing added twice
        norms = (await first.grad_sq_norm(0, "round-1"), await last.grad_sq_norm(0, "round-1"))
        for owner in owners:
            await owner.finalize(0, "round-1")
        await tie.fold(owners, 0, "round-1")  # after the step: nothing either
        return norms

    try:
        norms = asyncio.run(close())
        want = own.copy()
        want[:8] += carried[4:]  # the embedding's mean plus the head's
        np.testing.assert_allclose(norms, [float(want @ want), float(carried[:4] @ carried[:4])], rtol=1e-6)
        np.testing.assert_allclose(first.master.flat.numpy(), params[:12] - want, rtol=1e-6)
        np.testing.assert_allclose(last.master.flat.numpy(), params[12:] - carried[:4], rtol=1e-6)
        copy = asyncio.run(tie.copy_of(initial[0], 0))
        with open(copy.path, "rb") as fh:
            fh.seek(copy.offset)
            values = np.frombuffer(fh.read(copy.nbytes), dtype=np.float32)
        np.testing.assert_array_equal(values, params[:8])
        assert copy.sha256 == sha256_of(params[:8]) != initial[0].sha256 and copy.numel == 8
    finally:
        for owner in owners:
            owner.close()
