"""Stages of decoders with tied input/output embeddings compute what the whole model computes.

GPT-2 (tied by default) and a tied Llama: the flat vector holds the tied matrix once, in stage
0's range; the last stage's head reads a copy of that range (``Stage.load_tied``) and gives its
gradient apart (``Stage.tied_grad``). Chained, the stages give the whole model's loss exactly,
and stage 0's embedding gradient plus the head's is the whole model's gradient of the tied
matrix exactly (0.0 difference in fp32: one process also adds exactly those two terms, and a
float sum of two terms does not depend on their order). With GPT-2's default dropout, the
stage worker's tasks (:mod:`toolkit.pipeline.compute`) give it to 1e-5 as for untied models.
Relay runs still refuse tied models (their rounds do not sum the head's gradient yet).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.support.pipeline_models import GPT2_DROPOUT_SPEC, GPT2_SPEC, LLAMA_SPEC, batch_for, run_pipeline
from toolkit.errors import ModelMismatch
from toolkit.models import build_model, loss_of
from toolkit.models.flat import flatten
from toolkit.pipeline import build_stage, compute, cut_stages, pipeline_units, units_of
from toolkit.pipeline.compute import pipeline_masks
from toolkit.pipeline.stage import Stage
from toolkit.wire.protocol import ModelSpec


def tied(spec: ModelSpec) -> ModelSpec:
    return dataclasses.replace(spec, config={**spec.config, "tie_word_embeddings": True})


TIED = {"gpt2": tied(GPT2_SPEC), "llama": tied(LLAMA_SPEC)}
DEFAULT_GPT2 = tied(GPT2_DROPOUT_SPEC)
"""GPT-2 with its default config: tied embeddings, dropout 0.1."""


def stages_of(spec: ModelSpec, layers: list[int]) -> tuple[torch.nn.Module, list[Stage]]:
    """The whole model and its stages, each loaded from its slice of the flat vector (the last
    one's tied copy from stage 0's range of it)."""
    torch.manual_seed(0)
    model = build_model(spec)
    flat = torch.from_numpy(flatten(model))
    stages = [build_stage(spec, cut) for cut in cut_stages(pipeline_units(model, tied=True), layers)]
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
    units = pipeline_units(model, tied=True)
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


def test_relay_runs_still_refuse_tied_embeddings_in_one_line() -> None:
    with pytest.raises(ModelMismatch) as info:
        units_of(DEFAULT_GPT2)
    text = str(info.value)
    assert info.value.code == "tied_embeddings" and "\n" not in text
    assert "tie_word_embeddings = false" in text


def test_a_tied_copy_of_the_wrong_size_is_refused() -> None:
    _, stages = stages_of(TIED["gpt2"], [2, 2])
    with pytest.raises(ValueError, match="stage 0's flat slice"):
        stages[-1].load_tied(torch.zeros(7))
    with pytest.raises(ValueError, match="reads no tied embedding"):
        stages[0].tied_weight()
