"""Models named as data: transformers architectures from a config, an organizer's own module
only when the volunteer opted in, and refusals that happen before anything is imported."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from toolkit.errors import ModelMismatch
from toolkit.models import build_model, check_trusted, loss_of
from toolkit.wire.protocol import ModelSpec

ALBERT = {
    "model_type": "albert",
    "vocab_size": 64,
    "embedding_size": 16,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 32,
}
GPT2 = {"model_type": "gpt2", "vocab_size": 64, "n_embd": 32, "n_layer": 1, "n_head": 2, "n_positions": 32}


def spec(architecture: str, config: dict) -> ModelSpec:
    return ModelSpec(kind="transformers", architecture=architecture, config=config)


@pytest.mark.parametrize(
    "architecture, config",
    [
        ("AutoModelForMaskedLM", ALBERT),
        ("AutoModelForCausalLM", GPT2),
        ("AutoModelForSequenceClassification", {**ALBERT, "num_labels": 3}),
    ],
)
def test_transformers_architecture_built_from_config_has_one_layout(architecture: str, config: dict) -> None:
    a, b = build_model(spec(architecture, config)), build_model(spec(architecture, config))
    assert [(n, p.shape) for n, p in a.named_parameters()] == [(n, p.shape) for n, p in b.named_parameters()]
    assert type(a).__module__.startswith("transformers.models.")


def test_shared_and_tied_weights_appear_once_in_the_layout() -> None:
    """ALBERT shares its layers and ties the MLM decoder to the embeddings: the flat vector must
    hold each shared tensor once, or peers would send its gradient twice."""
    model = build_model(spec("AutoModelForMaskedLM", ALBERT))
    names = [n for n, _ in model.named_parameters()]
    assert len(names) == len(set(id(p) for p in model.parameters()))
    assert not any("layer.1" in n for n in names)  # 2 layers, one set of weights (shared)


def test_dict_batches_train_with_the_architectures_own_loss() -> None:
    model = build_model(spec("AutoModelForMaskedLM", ALBERT))
    ids = torch.randint(5, 64, (4, 16))
    labels = torch.full_like(ids, -100)
    labels[:, 3] = ids[:, 3]
    loss = loss_of(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    loss.backward()
    assert loss.item() > 0 and all(p.grad is not None for p in model.parameters() if p.requires_grad)
    with pytest.raises(ModelMismatch, match="no loss"):
        loss_of(model, {"input_ids": ids})


@pytest.mark.parametrize(
    "config, code",
    [
        ({**GPT2, "auto_map": {"AutoModel": "evil.Model"}}, "remote_code_refused"),
        ({**GPT2, "trust_remote_code": True}, "remote_code_refused"),
        ({"vocab_size": 10}, "bad_model_config"),
        ({**GPT2, "model_type": "no-such-model"}, "unknown_model_type"),
    ],
)
def test_configs_that_would_run_network_code_or_cannot_build_are_refused(config: dict, code: str) -> None:
    with pytest.raises(ModelMismatch) as info:
        build_model(spec("AutoModelForCausalLM", config))
    assert info.value.code == code and info.value.hint


@pytest.mark.parametrize("architecture", ["AutoTokenizer", "os.system", "AutoModelForCausalLM.from_pretrained", ""])
def test_only_automodel_classes_are_architectures(architecture: str) -> None:
    with pytest.raises(ModelMismatch, match="not an AutoModel class"):
        build_model(spec(architecture, GPT2))


@pytest.mark.integration
def test_own_module_needs_the_volunteers_opt_in_and_is_not_imported_before(tmp_path: Path) -> None:
    """A run naming an organizer's package the volunteer did not opt into is refused before the
    package is imported (its import side effect never happens); with the opt-in it builds."""
    pkg = tmp_path / "organizer_models"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        textwrap.dedent(f"""
        import pathlib, torch
        pathlib.Path({str(tmp_path / "imported")!r}).write_text("yes")
        class Tiny(torch.nn.Module):
            def __init__(self, width=3):
                super().__init__()
                self.w = torch.nn.Linear(width, 1)
    """)
    )
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        from toolkit.errors import ModelMismatch
        from toolkit.models import build_model
        from toolkit.wire.protocol import ModelSpec
        spec = ModelSpec(kind="module", factory="organizer_models:Tiny", kwargs={{"width": 5}})
        try:
            build_model(spec)
        except ModelMismatch as exc:
            print("refused", exc.code, "|", exc.hint)
        assert "organizer_models" not in sys.modules
        model = build_model(spec, trusted_models=["organizer_models"])
        print("built", model.w.in_features)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert (
        "refused untrusted_model | If you trust the organizer" in out.stdout
        and "trusted_models=['organizer_models']" in out.stdout
    )
    assert "built 5" in out.stdout


def test_check_trusted_passes_the_toolkits_and_transformers_models() -> None:
    check_trusted(ModelSpec(factory="toolkit.models:MLP"))
    check_trusted(spec("AutoModelForCausalLM", GPT2))
    with pytest.raises(ModelMismatch, match="not 'package.module:Name'"):
        check_trusted(ModelSpec(kind="module", factory="nocolon"), ["nocolon"])
