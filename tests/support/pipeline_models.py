"""The models the pipeline tests cut into stages, their batches, and a pipeline run by hand.

Both are sized so that K = 2 stages of 2 blocks each hold about half the parameters (the
embeddings and the head weigh about a block each), and dropout is 0 so that a forward computed
twice is the same forward; :data:`GPT2_DROPOUT_SPEC` keeps GPT-2's default dropout, and
:func:`run_tasks` computes as the stage worker does (masks replayed from the task's seed).
"""

from __future__ import annotations

from typing import Any

import torch

from toolkit.pipeline import Stage, compute
from toolkit.runtime.precision import PrecisionPolicy
from toolkit.wire.protocol import ModelSpec

BYTE_SPEC = ModelSpec(
    factory="toolkit.models:ByteTransformer",
    kwargs={"d_model": 32, "n_layer": 4, "n_head": 2, "d_ff": 64, "seq_len": 8, "tie_embeddings": False},
)
GPT2_VOCAB = 100
GPT2_SPEC = ModelSpec(
    kind="transformers",
    architecture="AutoModelForCausalLM",
    config={
        "model_type": "gpt2",
        "vocab_size": GPT2_VOCAB,
        "n_embd": 32,
        "n_layer": 4,
        "n_head": 2,
        "n_positions": 16,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "resid_pdrop": 0.0,
    },
)


def decoder_spec(model_type: str, **config: Any) -> ModelSpec:
    """A small transformers decoder of ``model_type`` (4 layers, 32 wide, the GPT-2 spec's
    vocabulary), untied, without dropout."""
    base = {
        "model_type": model_type,
        "vocab_size": GPT2_VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "max_position_embeddings": 16,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 0,
    }
    return ModelSpec(kind="transformers", architecture="AutoModelForCausalLM", config={**base, **config})


LLAMA_SPEC = decoder_spec("llama", num_key_value_heads=2)
MISTRAL_SPEC = decoder_spec("mistral", num_key_value_heads=2, sliding_window=4)
"""Mistral attending within a window of 4 (shorter than the tests' 8 tokens): every layer's mask
is the sliding one."""
QWEN2_SPEC = decoder_spec(
    "qwen2", num_key_value_heads=2, use_sliding_window=True, sliding_window=4, max_window_layers=2
)
"""Qwen2 with full attention in layers 0-1 and a window of 4 in layers 2-3: a stage's blocks
take the mask of their own index in the whole model."""
QWEN3_SPEC = decoder_spec("qwen3", num_key_value_heads=2, head_dim=8)
NEOX_SPEC = decoder_spec("gpt_neox")
SPECS = {
    "byte": BYTE_SPEC,
    "gpt2": GPT2_SPEC,
    "llama": LLAMA_SPEC,
    "mistral": MISTRAL_SPEC,
    "qwen2": QWEN2_SPEC,
    "qwen3": QWEN3_SPEC,
    "gpt_neox": NEOX_SPEC,
}
GPT2_DROPOUT_SPEC = ModelSpec(
    kind="transformers",
    architecture="AutoModelForCausalLM",
    config={k: v for k, v in GPT2_SPEC.config.items() if not k.endswith("_pdrop")},
)
"""GPT-2 with its default dropout (0.1 on embeddings, attention and residuals): exact only when
a recomputed backward replays its forward's masks (:mod:`toolkit.pipeline.compute`)."""


def tied(spec: ModelSpec) -> ModelSpec:
    """``spec`` with its input and output embeddings tied (one matrix)."""
    return ModelSpec(
        kind=spec.kind, architecture=spec.architecture, config={**spec.config, "tie_word_embeddings": True}
    )


DEFAULT_GPT2_SPEC = tied(GPT2_DROPOUT_SPEC)
"""GPT-2 with its default config, small: tied embeddings, dropout 0.1."""
DROPOUT_SPECS = {
    "gpt2": GPT2_DROPOUT_SPEC,
    "llama": decoder_spec("llama", num_key_value_heads=2, attention_dropout=0.1),
    "gpt_neox": decoder_spec("gpt_neox", attention_dropout=0.1, hidden_dropout=0.1),
}
"""Decoders with dropout (Llama's on attention probabilities; GPT-NeoX's on attention, residuals
and embeddings too)."""


def batch_for(name: str, generator: torch.Generator, rows: int = 3, seq_len: int = 8) -> Any:
    """A micro-batch as the run's data gives it: bytes [b, t+1], or a causal-lm dict batch."""
    if name == "byte":
        return torch.randint(0, 256, (rows, seq_len + 1), generator=generator)
    ids = torch.randint(0, GPT2_VOCAB, (rows, seq_len), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def run_pipeline(stages: list[Stage], batch: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Forward then backward through ``stages`` as a pipeline does: each stage's input is the
    previous output detached (what crosses the relay), the last stage's loss is backpropagated,
    then each earlier output with the gradient of the next stage's input. Returns the loss and
    every stage's input (stage k+1's ``.grad`` is stage k's output gradient)."""
    inputs, outputs = [stages[0].inputs(batch)], []
    for stage in stages[:-1]:
        outputs.append(stage(inputs[-1]))
        inputs.append(outputs[-1].detach().requires_grad_())
    loss = stages[-1].loss(inputs[-1], batch)
    loss.backward()
    for k in reversed(range(len(stages) - 1)):
        outputs[k].backward(inputs[k + 1].grad)
    return loss, inputs


def worst_relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest |a - b| relative to the largest |b|: 0 when equal."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def run_tasks(
    stages: list[Stage], batch: Any, microbatch: int, policy: PrecisionPolicy = compute.FP32, *, samples: int = 1
) -> tuple[float, list[torch.Tensor]]:
    """One micro-batch through ``stages`` as the stage worker's tasks compute it
    (:mod:`toolkit.pipeline.compute`): forward tasks without a graph, then the last stage's
    forward-loss-backward, then each earlier stage's backward recomputed from its stored input.
    Returns the loss and every stage's flat parameter gradient (of ``samples`` x the loss)."""
    inputs = [stages[0].inputs(batch)]
    for stage in stages[:-1]:
        inputs.append(compute.forward(stage, inputs[-1], microbatch, policy).float())
    grads: list[torch.Tensor] = [torch.empty(0)] * len(stages)
    last = compute.backward(stages[-1], inputs[-1], microbatch, policy, batch=batch, samples=samples)
    grads[-1], g = _flat(last.params), last.input
    for k in reversed(range(len(stages) - 1)):
        result = compute.backward(stages[k], inputs[k], microbatch, policy, grad_output=g)
        grads[k], g = _flat(result.params), result.input
    assert last.loss is not None
    return last.loss, grads


def _flat(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.detach().reshape(-1).float() for g in grads])


def referee_and_stages(version: int = 5) -> tuple[Any, list[Stage]]:
    """The relay's copy of :data:`BYTE_SPEC` cut ``[2, 2]`` holding ``version`` (a
    :class:`~relay_server.trust.referee.Referee`, micro-batches of 2), and a worker's two stages
    on the same random parameters: what the referee's tests compare."""
    from relay_server.trust.referee import Referee
    from toolkit.pipeline.cuts import cut_stages
    from toolkit.pipeline.stages import build_stage, units_of
    from toolkit.wire.compression import get_codec

    cuts = cut_stages(units_of(BYTE_SPEC), [2, 2])
    torch.manual_seed(0)
    flats = [torch.randn(c.end - c.start) * 0.02 for c in cuts]
    width = BYTE_SPEC.kwargs["d_model"]
    referee = Referee(
        BYTE_SPEC,
        [2, 2],
        lambda k: (version, flats[k].numpy()),
        width=width,
        microbatch_size=2,
        codec=get_codec("none"),
    )
    stages = []
    for k, cut in enumerate(cuts):
        stage = build_stage(BYTE_SPEC, cut, "cpu")
        with torch.no_grad():
            stage.load_flat(flats[k])
        stages.append(stage)
    return referee, stages
