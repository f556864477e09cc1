"""Stages cut from real models compute what the whole model computes, and hold only their part.

For the toolkit's ByteTransformer and a transformers GPT-2, cut into 2 and 3 stages with uneven
layer allocations: the stages loaded from slices of the flat vector, chained forward to the loss
and backward through detached boundaries, give the whole model's ``loss_of`` and every parameter
gradient to 1e-5; a backward recomputed from a stored input gives the same gradients; a K = 2
stage holds at most 0.55 of the parameters and building it allocates no more than that; and
what cannot be cut is refused in one line that says what to do.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from relay_server.rounds.master import layout_of
from tests.support.pipeline_models import SPECS, batch_for, run_pipeline, worst_relative
from toolkit.errors import ModelMismatch
from toolkit.models import build_model, loss_of
from toolkit.models.flat import flatten
from toolkit.pipeline import build_stage, cut_stages, pipeline_units, units_of
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
    assert worst_relative(loss.detach(), want_loss) <= TOLERANCE
    assert got_grad.shape == want_grad.shape
    assert worst_relative(got_grad, want_grad) <= TOLERANCE


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


@pytest.mark.parametrize(
    ("spec", "fix"),
    [
        (
            ModelSpec(factory="toolkit.models:ByteTransformer", kwargs={"d_model": 16, "n_layer": 2, "d_ff": 32}),
            "tie_embeddings = false",
        ),
        (
            ModelSpec(
                kind="transformers",
                architecture="AutoModelForCausalLM",
                config={
                    "model_type": "gpt2",
                    "vocab_size": 50,
                    "n_embd": 16,
                    "n_layer": 2,
                    "n_head": 2,
                    "n_positions": 8,
                    "bos_token_id": 0,
                    "eos_token_id": 0,
                },
            ),
            "tie_word_embeddings = false",
        ),
    ],
)
def test_tied_embeddings_are_refused(spec: ModelSpec, fix: str) -> None:
    with pytest.raises(ModelMismatch) as info:
        units_of(spec)
    assert info.value.code == "tied_embeddings" and fix in one_line(info)


@pytest.mark.parametrize(
    "spec",
    [
        ModelSpec(factory="toolkit.models:MLP", kwargs={"sizes": [4, 8, 1]}),
        ModelSpec(kind="module", factory="someones.models:Big"),
    ],
)
def test_an_unsupported_architecture_is_refused_naming_the_supported_ones(spec: ModelSpec) -> None:
    with pytest.raises(ModelMismatch) as info:
        units_of(spec)
    text = one_line(info)
    assert info.value.code == "not_cuttable" and "ByteTransformer" in text and "gpt2" in text
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
