"""8-bit AdamW state on the relay (relay_server.rounds.optim8bit): trains the test MLP like fp32 AdamW,
through the real MasterState (flat-vector views, two param groups, checkpoint tensors), with a
~4x smaller state; checkpoints round-trip and convert both ways."""

from __future__ import annotations

import builtins
import dataclasses

import pytest
import torch
from safetensors.torch import load, save

from relay_server.core.config import ConfigError, OptimizerSection
from relay_server.rounds import optim8bit
from relay_server.rounds.master import MasterState, layout_of
from tests.peer_worker import make_dataset
from toolkit.models import build_model
from toolkit.models.flat import flatten
from toolkit.wire.protocol import ModelSpec

try:
    optim8bit.bitsandbytes_cpu()
    SKIP = ""
except optim8bit.EightBitUnavailable as exc:
    SKIP = str(exc)
needs_bnb = pytest.mark.skipif(bool(SKIP), reason=SKIP)

SIZES = [8, 64, 64, 1]  # the 64x64 matrix (4096 values) takes the 8-bit path; the rest stays fp32
CFG = OptimizerSection(name="adamw", lr=3e-3, weight_decay=0.05, betas=[0.9, 0.99])


@pytest.fixture(autouse=True)
def one_thread():
    """Small tensors: one thread is fastest, and several fight the other tests for 2 shared cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def master(bits: int, monkeypatch: pytest.MonkeyPatch, seed: int = 0) -> MasterState:
    torch.manual_seed(seed)
    model = build_model(ModelSpec(factory="toolkit.models:MLP", kwargs={"sizes": SIZES}))
    return MasterState(layout_of(model), flatten(model), dataclasses.replace(CFG, state_bits=bits), total_steps=0)


def loss_at(state: MasterState, data: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Full-batch loss and gradient of the MLP whose parameters are ``state.flat``."""
    model = build_model(ModelSpec(factory="toolkit.models:MLP", kwargs={"sizes": SIZES}))
    offset = 0
    for p in model.parameters():
        p.data.copy_(state.flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    loss = model.loss(data)
    loss.backward()
    return loss.item(), torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def train(state: MasterState, data: torch.Tensor, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        loss, grad = loss_at(state, data)
        losses.append(loss)
        state.grad.copy_(grad)
        state.apply_gradient()
    return losses


@needs_bnb
def test_8bit_adamw_trains_like_fp32_adamw_with_a_4x_smaller_state(monkeypatch):
    data = make_dataset(n=1024)
    fp32, eight = master(32, monkeypatch), master(8, monkeypatch)
    assert torch.equal(fp32.flat, eight.flat)
    ref, got = train(fp32, data, 150), train(eight, data, 150)
    assert ref[-1] < 0.05 * ref[0]  # the task is learned (0.79 -> 0.011)...
    assert abs(got[-1] - ref[-1]) < 0.03 * ref[-1], (got[-1], ref[-1])  # ...8-bit ends within 3% of fp32 (0.7%)
    assert max(abs(a - b) / b for a, b in zip(got, ref)) < 0.05  # and tracks it all the way (2.3% at worst)
    # The parameters themselves wander apart more (7.7%): two runs reach equally good points; the
    # loss is the criterion, this only catches a run that went somewhere else entirely.
    drift = torch.linalg.vector_norm(eight.flat - fp32.flat) / torch.linalg.vector_norm(fp32.flat)
    assert drift < 0.15, drift
    # State: 8 B/param for fp32 AdamW; 2 B + 4 B per 256 for the 8-bit tensor.
    big = 64 * 64
    small = eight.numel - big
    steps = 4 * len(fp32.params)  # torch keeps each tensor's step count as a float32 tensor
    assert optim8bit.state_nbytes(fp32.optimizer) == 8 * fp32.numel + steps
    expected = 2 * big + 2 * 4 * (big // 256) + 2 * 256 * 4 + 8 * small  # codes, absmax, the two maps, fp32 rest
    assert optim8bit.state_nbytes(eight.optimizer) == expected
    matrix_only = 8 * big / (2 * big + 2 * 4 * (big // 256))
    assert 3.9 < matrix_only < 4.0


@needs_bnb
def test_a_checkpoint_round_trips_bit_for_bit(monkeypatch):
    data = make_dataset(n=256)
    a = master(8, monkeypatch)
    train(a, data, 5)
    blob = save({"params": a.flat.clone(), **{k: v.contiguous() for k, v in a.optimizer_tensors().items()}})
    b = master(8, monkeypatch, seed=1)
    b.load_state_tensors(load(blob), a.step)
    train(a, data, 3)
    train(b, data, 3)
    assert torch.equal(a.flat, b.flat)


@needs_bnb
def test_an_fp32_checkpoint_is_adopted_and_8bit_state_converts_back(monkeypatch):
    data = make_dataset(n=256)
    fp32 = master(32, monkeypatch)
    train(fp32, data, 20)
    tensors = {"params": fp32.flat.clone(), **{k: v.clone() for k, v in fp32.optimizer_tensors().items()}}
    reference = master(32, monkeypatch, seed=3)  # (deepcopy would clone the parameters off the flat vector)
    reference.load_state_tensors(tensors, fp32.step)
    upgraded = master(8, monkeypatch, seed=1)
    upgraded.load_state_tensors(tensors, fp32.step)  # a run switched to state_bits = 8, resuming
    ref_losses, losses = train(reference, data, 20), train(upgraded, data, 20)
    assert max(abs(a - b) / b for a, b in zip(losses, ref_losses)) < 0.05
    assert "state1" in next(iter(upgraded.optimizer.state.values()))

    back = master(32, monkeypatch, seed=2)  # and switched back to 32
    loaded = {"params": upgraded.flat.clone(), **upgraded.optimizer_tensors()}
    per_param: dict[str, dict] = {}
    for name, t in loaded.items():
        if name.startswith("opt."):
            _, i, key = name.split(".", 2)
            per_param.setdefault(i, {})[key] = t
    converted = {f"opt.{i}.{k}": v for i, values in per_param.items() for k, v in optim8bit.fp32_state(values).items()}
    back.load_state_tensors({"params": loaded["params"], **converted}, upgraded.step)
    again = master(8, monkeypatch, seed=4)
    again.load_state_tensors({k: v.clone() for k, v in loaded.items()}, upgraded.step)
    assert max(abs(a - b) / b for a, b in zip(train(back, data, 10), train(again, data, 10))) < 0.05


def test_unsupported_combinations_name_the_setting():
    with pytest.raises(ConfigError, match="decays weights like AdamW"):
        optim8bit.check_supported("adam", 0.01)
    with pytest.raises(ConfigError, match="state_bits = 32"):
        optim8bit.check_supported("sgd", 0.0)
    optim8bit.check_supported("adam", 0.0)
    optim8bit.check_supported("adamw", 0.1)


def test_a_missing_bitsandbytes_is_an_error_with_the_fix(monkeypatch):
    real_import = builtins.__import__

    def no_bnb(name, *args, **kwargs):
        if name == "bitsandbytes":
            raise ImportError("No module named 'bitsandbytes'")
        return real_import(name, *args, **kwargs)

    optim8bit.bitsandbytes_cpu.cache_clear()
    monkeypatch.setattr(builtins, "__import__", no_bnb)
    try:
        with pytest.raises(optim8bit.EightBitUnavailable, match=r'pip install -U "bitsandbytes>=0.50"'):
            optim8bit.bitsandbytes_cpu()
    finally:
        monkeypatch.undo()
        optim8bit.bitsandbytes_cpu.cache_clear()
