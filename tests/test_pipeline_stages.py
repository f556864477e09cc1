"""Stages cut from real models compute what the whole model computes, and hold only their part.

For the toolkit's ByteTransformer and transformers' GPT-2, Llama, Mistral (sliding window),
Qwen2 (full and sliding layers), Qwen3 and GPT-NeoX, cut into 2 and 3 stages with uneven layer
allocations: the stages loaded from slices of the flat vector, chained forward to the loss and
backward through detached boundaries, give the whole model's ``loss_of`` and every parameter
gradient exactly (0.0 difference in fp32: each stage runs the very operations the whole model's
forward runs, in the same order); a backward recomputed from a stored input gives the same gradients; a K = 2
stage holds at most 0.55 of the parameters and building it allocates no more than that; and
what cannot be cut is refused in one line that says what to do.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from relay_server.rounds.master import layout_of
from tests.support.pipeline_models import (
    DROPOUT_SPECS,
    GPT2_DROPOUT_SPEC,
    LLAMA_SPEC,
    SPECS,
    batch_for,
    run_pipeline,
    run_tasks,
    worst_relative,
)
from toolkit.errors import ModelMismatch
from toolkit.models import build_model, loss_of
from toolkit.models.flat import flatten
from toolkit.pipeline import build_stage, compute, cut_stages, pipeline_units, units_of
from toolkit.pipeline.compute import pipeline_masks
from toolkit.runtime.precision import LossScaler
from toolkit.wire.protocol import ModelSpec

ALLOCATIONS = [[1, 3], [3, 1], [1, 2, 1], [2, 1, 1]]
TOLERANCE = 1e-5


def full_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(SPECS[name])


def loaded_stages(name: str, model: torch.nn.Module, layers: list[int]) -> list:
    """The stages of ``layers``, each loaded from its slice of ``model``'s flat vector."""
    flat = flatten(model)
    stages = [build_stage(SPECS[name], cut) for cut in cut_stages(pipeline_units(model), layers)]
    for stage in stages:
        stage.load_flat(flat[stage.cut.start : stage.cut.end])
    return stages


def reference(model: torch.nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole model's loss and flat gradient for ``batch``."""
    model.zero_grad()
    loss = loss_of(model, batch)
    loss.backward()
    return loss.detach(), torch.cat([p.grad.reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("layers", ALLOCATIONS, ids=lambda layers: "-".join(map(str, layers)))
@pytest.mark.parametrize("name", sorted(SPECS))
def test_stages_chain_to_the_whole_models_loss_and_gradient(name: str, layers: list[int]) -> None:
    model = full_model(name)
    batch = batch_for(name, torch.Generator().manual_seed(1))
    stages = loaded_stages(name, model, layers)
    held = [p.detach().reshape(-1) for stage in stages for p in stage.parameters()]
    assert torch.equal(torch.cat(held), torch.from_numpy(flatten(model)))
    want_loss, want_grad = reference(model, batch)
    loss, _ = run_pipeline(stages, batch)
    got_grad = torch.cat([stage.flat_grad() for stage in stages])
    assert torch.equal(loss.detach(), want_loss)
    assert got_grad.shape == want_grad.shape
    assert torch.equal(got_grad, want_grad), worst_relative(got_grad, want_grad)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_a_stage_holds_its_range_under_the_run_layouts_names(name: str) -> None:
    model = full_model(name)
    layout = layout_of(model)
    for stage in loaded_stages(name, model, [1, 2, 1]):
        inside = [spec.name for spec in layout if stage.cut.start <= spec.offset < stage.cut.end]
        assert stage.param_names() == inside
        assert stage.numel == stage.cut.numel


@pytest.mark.parametrize("name", sorted(SPECS))
def test_a_backward_recomputed_from_the_stored_input_gives_the_same_gradients(name: str) -> None:
    model = full_model(name)
    batch = batch_for(name, torch.Generator().manual_seed(2))
    stages = loaded_stages(name, model, [1, 2, 1])
    _, inputs = run_pipeline(stages, batch)
    for k, stage in enumerate(stages):
        first_grads = stage.flat_grad()
        stage.zero_grad()
        stored = inputs[k] if k == 0 else inputs[k].detach().requires_grad_()
        if stage.last:
            stage.loss(stored, batch).backward()
        else:
            stage(stored).backward(inputs[k + 1].grad)
        assert worst_relative(stage.flat_grad(), first_grads) <= TOLERANCE
        if k > 0:
            assert worst_relative(stored.grad, inputs[k].grad) <= TOLERANCE


def test_a_gpt2_stage_honours_the_causal_lm_objectives_end_padding() -> None:
    model = full_model("gpt2")
    batch = batch_for("gpt2", torch.Generator().manual_seed(3))
    batch["attention_mask"][-1, 5:] = 0  # the stream's last block: padded at its end, no labels there
    batch["labels"][-1, 5:] = -100
    want_loss, want_grad = reference(model, batch)
    stages = loaded_stages("gpt2", model, [2, 2])
    loss, _ = run_pipeline(stages, batch)
    assert worst_relative(loss.detach(), want_loss) <= TOLERANCE
    assert worst_relative(torch.cat([s.flat_grad() for s in stages]), want_grad) <= TOLERANCE

    left = dict(batch, attention_mask=batch["attention_mask"].flip(1))
    with pytest.raises(ModelMismatch, match="ones then zeros at the end of a row") as info:
        stages[0].inputs(left)
    assert "\n" not in str(info.value)


class Allocations(TorchDispatchMode):
    """Bytes of every tensor allocated off the meta device while active (temporaries too: an
    upper bound of the peak), counted as each op returns a tensor that shares no input's storage."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor) and t.device.type != "meta"
        }
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.untyped_storage().data_ptr() not in given:
                self.bytes += t.untyped_storage().nbytes()
        return out


@pytest.mark.parametrize("name", sorted(SPECS))
def test_a_k2_stage_holds_and_allocates_at_most_055_of_the_model(name: str) -> None:
    spec = SPECS[name]
    with Allocations() as whole:
        total = sum(p.numel() for p in build_model(spec).parameters())
    assert whole.bytes >= 4 * total  # the counter sees a whole model being built
    units = units_of(spec)
    assert units.total == total
    for cut in cut_stages(units, [2, 2]):
        with Allocations() as built:
            stage = build_stage(spec, cut)
        assert stage.numel == cut.numel <= 0.55 * total
        assert built.bytes <= 4 * 0.55 * total
        assert all(p.device.type == "cpu" and bool(p.isfinite().all()) for p in stage.parameters())
        assert len(stage.blocks) == cut.num_layers


def test_build_stage_casts_to_the_asked_dtype() -> None:
    stage = build_stage(SPECS["byte"], cut_stages(units_of(SPECS["byte"]), [2, 2])[1], dtype=torch.bfloat16)
    assert {p.dtype for p in stage.parameters()} == {torch.bfloat16}


# --- refusals: one line, saying what to do -----------------------------------------------------------
def one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


def test_a_tie_the_stages_cannot_hold_apart_is_refused() -> None:
    """The ByteTransformer's tied head (its stages read no copy of stage 0's matrix); a decoder's
    tie is cut (tests/test_pipeline_tied.py)."""
    spec = ModelSpec(factory="toolkit.models:ByteTransformer", kwargs={"d_model": 16, "n_layer": 2, "d_ff": 32})
    with pytest.raises(ModelMismatch) as info:
        units_of(spec)
    assert info.value.code == "tied_embeddings" and "tie_embeddings = false" in one_line(info)


@pytest.mark.parametrize(
    "spec",
    [
        ModelSpec(factory="toolkit.models:MLP", kwargs={"sizes": [4, 8, 1]}),
        ModelSpec(kind="module", factory="someones.models:Big"),
        dataclasses.replace(LLAMA_SPEC, config={**LLAMA_SPEC.config, "model_type": "gemma", "head_dim": 8}),
    ],
)
def test_an_unsupported_architecture_is_refused_naming_the_supported_ones(spec: ModelSpec) -> None:
    with pytest.raises(ModelMismatch) as info:
        units_of(spec)
    text = one_line(info)
    assert info.value.code == "not_cuttable" and "ByteTransformer" in text
    assert all(f'"{t}"' in text for t in ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gpt_neox"))
    assert "without [pipeline]" in text


def test_parameters_out_of_layer_order_are_refused() -> None:
    model = full_model("byte")
    tok = model.tok
    del model.tok
    model.tok = tok  # registered again: now after the head
    with pytest.raises(ModelMismatch) as info:
        pipeline_units(model)
    assert info.value.code == "not_layer_ordered" and "tok.weight comes after head.weight" in one_line(info)


def test_shared_parameters_are_refused() -> None:
    model = full_model("byte")
    model.blocks[1].proj.weight = model.blocks[0].proj.weight
    with pytest.raises(ModelMismatch) as info:
        pipeline_units(model)
    assert info.value.code == "shared_parameters" and "blocks.1.proj.weight" in one_line(info)


@pytest.mark.parametrize(
    ("layers", "words"),
    [
        ([2, 0, 2], "stage 1 has 0 layers"),
        ([1, 1], "deals 2 layers and the model has 4: make them sum to 4"),
        ([], "layers_per_stage is empty"),
        ([2.5, 1.5], "stage 0 has 2.5 layers"),
    ],
)
def test_a_bad_allocation_is_refused(layers: list, words: str) -> None:
    with pytest.raises(ValueError) as info:
        cut_stages(units_of(SPECS["byte"]), layers)
    assert words in one_line(info)


def test_a_cut_of_another_model_is_refused() -> None:
    cut = cut_stages(units_of(SPECS["gpt2"]), [2, 2])[0]
    with pytest.raises(ModelMismatch) as info:
        build_stage(SPECS["byte"], cut)
    assert info.value.code == "stage_mismatch" and "cut_stages(units_of(spec)" in one_line(info)


def test_only_the_first_stage_reads_batches_and_only_the_last_has_a_loss() -> None:
    first, last = (build_stage(SPECS["byte"], cut) for cut in cut_stages(units_of(SPECS["byte"]), [2, 2]))
    batch = batch_for("byte", torch.Generator().manual_seed(4))
    with pytest.raises(ValueError, match="only stage 0 reads batches"):
        last.inputs(batch)
    with pytest.raises(ValueError, match="the last stage computes it"):
        first.loss(first.inputs(batch), batch)
    assert np.isfinite(last.loss(first(first.inputs(batch)), batch).item())


@pytest.mark.parametrize("name", ["mistral", "qwen2"])
def test_the_sliding_window_masks_are_what_the_stages_reproduce(name: str) -> None:
    """The Mistral and Qwen2 test models attend within 4 of the batches' 8 tokens (Qwen2 in
    layers 2-3 only): without the window the loss is another, so the exactness above covers the
    stages building each block's own mask kind."""
    batch = batch_for(name, torch.Generator().manual_seed(1))
    windowed = loss_of(full_model(name), batch).item()
    config = {**SPECS[name].config, "sliding_window": None, "use_sliding_window": False}
    torch.manual_seed(0)
    unwindowed = loss_of(build_model(dataclasses.replace(SPECS[name], config=config)), batch).item()
    assert abs(windowed - unwindowed) > 1e-4


def test_a_decoder_whose_parts_moved_is_refused() -> None:
    """A model whose modules are not where its family's row says (another transformers version
    renamed them) is refused, not run as something else."""
    model = full_model("llama")
    del model.model.rotary_emb
    with pytest.raises(ModelMismatch) as info:
        pipeline_units(model)
    assert info.value.code == "not_cuttable" and "model.embed_tokens, model.layers" in one_line(info)


def test_a_gpt2_decoder_with_cross_attention_is_refused() -> None:
    spec = ModelSpec(
        kind="transformers",
        architecture="AutoModelForCausalLM",
        config=dict(SPECS["gpt2"].config, add_cross_attention=True),
    )
    with pytest.raises(ModelMismatch) as info:
        units_of(spec)
    assert info.value.code == "not_cuttable" and "add_cross_attention = false" in one_line(info)


@pytest.mark.parametrize(
    ("name", "change", "words"),
    [
        ("byte", lambda batch: {"input_ids": batch}, "takes LongTensor batches [b, t+1]"),
        ("gpt2", lambda batch: dict(batch, token_type_ids=batch["input_ids"]), "cannot pass ['token_type_ids']"),
        ("gpt2", lambda batch: {"input_ids": batch["input_ids"]}, "a batch without labels"),
    ],
)
def test_a_batch_the_stages_cannot_honour_is_refused(name: str, change, words: str) -> None:
    """Stage 0 checks the batch it reads; the last stage checks the one it scores."""
    first, last = (build_stage(SPECS[name], cut) for cut in cut_stages(units_of(SPECS[name]), [2, 2]))
    good = batch_for(name, torch.Generator().manual_seed(5))
    bad = change(good)
    with pytest.raises(ModelMismatch) as info:
        first.inputs(bad)
        last.loss(first(first.inputs(good)), bad)
    assert words in one_line(info)


# --- dropout and precision: what the stage worker's tasks compute ------------------------------------
def dropout_stages(layers: list[int], spec: ModelSpec = GPT2_DROPOUT_SPEC) -> tuple[torch.nn.Module, list]:
    """A decoder with dropout (in training mode; GPT-2's default) and its stages, loaded from its vector."""
    torch.manual_seed(0)
    model = build_model(spec)
    flat = flatten(model)
    stages = [build_stage(spec, cut) for cut in cut_stages(pipeline_units(model), layers)]
    for stage in stages:
        stage.load_flat(flat[stage.cut.start : stage.cut.end])
    return model, stages


def masked_reference(
    model: torch.nn.Module, layers: list[int], batch, microbatch: int, policy=compute.FP32, *, samples: int = 1
) -> tuple[float, torch.Tensor]:
    """The whole model's loss and flat gradient (of ``samples`` x the loss) with the masks the
    pipeline's tasks draw for ``microbatch`` (:func:`toolkit.pipeline.compute.pipeline_masks`)."""
    model.zero_grad()
    with pipeline_masks(model, layers, microbatch), policy.autocast():
        loss = loss_of(model, batch)
    scale = policy.scaler.scale if policy.scaler is not None else 1.0  # fp16: loss-scaled as the stages are
    (loss * samples * scale).backward()
    return float(loss.detach()), torch.cat([p.grad.reshape(-1) / scale for p in model.parameters()])


@pytest.mark.parametrize("layers", [[2, 2], [1, 2, 1]], ids=lambda layers: "-".join(map(str, layers)))
def test_dropout_masks_are_replayed_by_the_recomputed_backward(layers: list[int]) -> None:
    """GPT-2 with dropout 0.1: forwards as tasks (no graph), backwards recomputed from the stored
    inputs, whatever the worker's generators held before each task, give the whole model's loss
    and gradients with the pipeline's masks to 1e-5; those masks are real dropout (another
    micro-batch's masks give other gradients, far from it)."""
    model, stages = dropout_stages(layers)
    assert model.config.attn_pdrop == model.config.resid_pdrop == model.config.embd_pdrop == 0.1
    batch = batch_for("gpt2", torch.Generator().manual_seed(6))
    for microbatch in (0, 7):
        want_loss, want = masked_reference(model, layers, batch, microbatch, samples=2)
        torch.manual_seed(1234 + microbatch)  # the worker's own generators: nothing of them may matter
        loss, grads = run_tasks(stages, batch, microbatch, samples=2)
        assert abs(loss - want_loss) <= TOLERANCE * abs(want_loss)
        assert worst_relative(torch.cat(grads), want) <= TOLERANCE
    _, other = masked_reference(model, layers, batch, 8, samples=2)
    cosine = torch.nn.functional.cosine_similarity(other, want, dim=0)
    assert worst_relative(other, want) > 0.05 and cosine < 0.99, (worst_relative(other, want), cosine)


@pytest.mark.parametrize("name", ["llama", "gpt_neox"])
def test_dropout_masks_are_replayed_on_every_family(name: str) -> None:
    """Llama's attention dropout, GPT-NeoX's attention, residual and embedding dropout: the
    stages' tasks draw the pipeline's masks as GPT-2's do, equal to the whole model's to 1e-5."""
    layers = [1, 2, 1]
    model, stages = dropout_stages(layers, DROPOUT_SPECS[name])
    batch = batch_for(name, torch.Generator().manual_seed(6))
    want_loss, want = masked_reference(model, layers, batch, 3, samples=2)
    torch.manual_seed(4321)
    loss, grads = run_tasks(stages, batch, 3, samples=2)
    assert abs(loss - want_loss) <= TOLERANCE * abs(want_loss)
    assert worst_relative(torch.cat(grads), want) <= TOLERANCE
    _, other = masked_reference(model, layers, batch, 8, samples=2)
    assert worst_relative(other, want) > 0.01  # the masks are real dropout


def test_the_task_seed_is_one_per_stage_and_micro_batch_and_the_same_everywhere() -> None:
    seeds = {compute.stage_seed(m, k) for m in range(64) for k in range(8)}
    assert len(seeds) == 64 * 8 and all(0 <= s < 2**63 for s in seeds)
    # pinned: a hash of the ids (never Python's per-process salted hash()), and a change of it
    # would make workers of two toolkit versions draw different masks for one task
    assert compute.stage_seed(3, 1) == 1684389169619866894


def test_a_task_leaves_the_workers_generators_as_they_were() -> None:
    _, stages = dropout_stages([2, 2])
    batch = batch_for("gpt2", torch.Generator().manual_seed(7))
    torch.manual_seed(99)
    before = torch.get_rng_state()
    run_tasks(stages, batch, 5)
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_stage_tasks_compute_in_the_runs_precision_with_the_same_masks(name: str) -> None:
    """A pinned bf16 or fp16 run: the stages' forwards and their recomputations run under the
    policy's autocast, the fp16 backward loss-scaled by the worker's scaler and unscaled before
    leaving it; equal to the whole model under the same autocast with the same masks, and
    measurably not fp32."""
    layers = [2, 2]
    model, stages = dropout_stages(layers)
    batch = batch_for("gpt2", torch.Generator().manual_seed(8))
    policy = compute.stage_precision(name, "cpu")
    assert policy.name == name and (policy.scaler is not None) == (name == "fp16")
    _, grads = run_tasks(stages, batch, 3, policy)
    _, want = masked_reference(model, layers, batch, 3, policy)  # fp16: at the scale the stages ended at
    _, fp32 = masked_reference(model, layers, batch, 3)
    got = torch.cat(grads)
    assert worst_relative(got, want) <= TOLERANCE
    assert worst_relative(got, fp32) > 1e-4  # fp16 and bf16 round at 2^-11 and 2^-8: autocast ran


def test_an_fp16_overflow_recomputes_the_backward_at_a_lower_scale() -> None:
    """An fp16 backward that overflows is not dropped (the relay counts every micro-batch): the
    scale halves and the same backward, same masks, is recomputed until it is finite."""
    _, stages = dropout_stages([2, 2])
    batch = batch_for("gpt2", torch.Generator().manual_seed(9))
    calm = compute.stage_precision("fp16", "cpu")
    _, want = run_tasks(stages, batch, 4, calm)
    hot = dataclasses.replace(calm, scaler=LossScaler(init_scale=2.0**40))
    _, got = run_tasks(stages, batch, 4, hot)
    assert hot.scaler.overflows >= 1 and hot.scaler.scale < 2.0**40
    assert worst_relative(torch.cat(got), torch.cat(want)) <= TOLERANCE
