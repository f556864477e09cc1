"""Precision policy: recorded device descriptions into the policy (every branch), and the fp16
loss scaler / bf16 autocast with real tensors on CPU."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from toolkit.errors import PrecisionUnsupported
from toolkit.runtime.environment import DeviceInfo
from toolkit.runtime.precision import LossScaler, PrecisionPolicy, choose_precision, local_choice


def _gpu(name: str, cc: tuple[int, int], gib: float, platform: str | None = None) -> DeviceInfo:
    return DeviceInfo(
        kind="cuda",
        name=name,
        memory_bytes=int(gib * 2**30),
        compute_capability=cc,
        device_count=1,
        torch_version="2.5.1+cu121",
        platform=platform,
    )


def _tpu(name: str, count: int) -> DeviceInfo:
    return DeviceInfo(
        kind="tpu",
        name=name,
        memory_bytes=16 * 2**30,
        device_count=count,
        torch_version="2.5.1",
        torch_xla_version="2.5.1+libtpu",
        platform="colab",
    )


# What detect() reports on the hardware volunteers bring (names and memory as torch reports them).
RECORDED = {
    "T4": _gpu("Tesla T4", (7, 5), 14.7, "colab"),
    "P100": _gpu("Tesla P100-PCIE-16GB", (6, 0), 15.9, "kaggle"),
    "V100": _gpu("Tesla V100-SXM2-16GB", (7, 0), 15.8),
    "A100": _gpu("NVIDIA A100-SXM4-40GB", (8, 0), 39.4, "colab"),
    "L4": _gpu("NVIDIA L4", (8, 9), 22.2, "colab"),
    "H100": _gpu("NVIDIA H100 80GB HBM3", (9, 0), 79.1),
    "P4": _gpu("Tesla P4", (6, 1), 7.4),
    "K80": _gpu("Tesla K80", (3, 7), 11.2),
    "TPU v2": _tpu("TPU v2-8", 8),
    "TPU v3": _tpu("TPU v3-8", 8),
    "TPU v5e": _tpu("TPU v5litepod-8", 8),
    "MPS": DeviceInfo(kind="mps", name="Apple MPS", memory_bytes=12 * 2**30, torch_version="2.5.1"),
    "CPU": DeviceInfo(
        kind="cpu",
        name="Intel(R) Xeon(R) CPU @ 2.20GHz",
        memory_bytes=13 * 2**30,
        device_count=2,
        torch_version="2.5.1",
        platform="colab",
    ),
}

LOCAL = {
    "T4": "fp16",
    "P100": "fp16",
    "V100": "fp16",
    "A100": "bf16",
    "L4": "bf16",
    "H100": "bf16",
    "P4": "fp32",
    "K80": "fp32",
    "TPU v2": "bf16",
    "TPU v3": "bf16",
    "TPU v5e": "bf16",
    "MPS": "fp32",
    "CPU": "fp32",
}

# pin -> (devices that refuse it, devices that accept it but warn "slow")
PINS = {
    "bf16": ({"T4", "P100", "V100", "P4", "K80", "MPS"}, {"CPU"}),
    "fp16": ({"TPU v2", "TPU v3", "TPU v5e", "MPS"}, {"P4", "K80", "CPU"}),
    "fp32": (set(), set()),
}


@pytest.mark.parametrize("device", sorted(RECORDED))
def test_local_choice_on_recorded_devices(device):
    policy = choose_precision(RECORDED[device], None)
    assert policy.name == LOCAL[device] == local_choice(RECORDED[device])[0]
    assert not policy.pinned and policy.reason
    assert (policy.scaler is not None) == (policy.name == "fp16")
    assert policy.device_type == {"cuda": "cuda", "tpu": "xla", "mps": "mps", "cpu": "cpu"}[RECORDED[device].kind]


@pytest.mark.parametrize("pin", sorted(PINS))
@pytest.mark.parametrize("device", sorted(RECORDED))
def test_a_pinned_policy_overrides_or_refuses(device, pin, caplog):
    refused, slow = PINS[pin]
    info = RECORDED[device]
    if device in refused:
        with pytest.raises(PrecisionUnsupported) as err:
            choose_precision(info, pin)
        assert err.value.code == "precision_unsupported" and pin in err.value.message
        assert "pin fp32" in err.value.hint
        if info.platform == "colab":
            assert "Change runtime type" in err.value.hint
        return
    with caplog.at_level(logging.WARNING, logger="toolkit.runtime.precision"):
        policy = choose_precision(info, pin)
    assert policy.name == pin and policy.pinned
    assert ("slowly" in caplog.text) == (device in slow)


def test_an_unknown_pin_is_a_typed_error():
    with pytest.raises(PrecisionUnsupported, match="unknown precision 'fp8'"):
        choose_precision(RECORDED["H100"], "fp8")
    assert choose_precision(RECORDED["T4"], "").name == "fp16"  # empty = unpinned, as in the relay config


def test_to_json_shows_the_choice_to_the_collaboration():
    fp16 = json.loads(json.dumps(choose_precision(RECORDED["T4"], None).to_json()))
    assert fp16 == {
        "name": "fp16",
        "device_type": "cuda",
        "pinned": False,
        "loss_scaling": True,
        "reason": fp16["reason"],
        "scale": 65536.0,
        "overflows": 0,
    }
    bf16 = choose_precision(RECORDED["TPU v3"], "bf16").to_json()
    assert bf16["name"] == "bf16" and bf16["pinned"] and not bf16["loss_scaling"] and "scale" not in bf16


# --- real tensors on CPU ----------------------------------------------------------------------
def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def _fp16_policy(**scaler_kwargs) -> PrecisionPolicy:
    return choose_precision(RECORDED["CPU"], "fp16", scaler=LossScaler(**scaler_kwargs))


def test_scaled_gradients_come_back_unscaled():
    x, y = torch.randn(32, 8, generator=torch.Generator().manual_seed(1)), torch.randn(32, 1)
    model = _model()
    torch.nn.functional.mse_loss(model(x), y).backward()
    reference = _grads(model)

    model.zero_grad()
    policy = _fp16_policy(init_scale=2.0**10)
    scaled = policy.scale_loss(torch.nn.functional.mse_loss(model(x), y))
    scaled.backward()
    assert _grads(model)[0].abs().max() > 100 * reference[0].abs().max()  # really scaled
    assert policy.unscale_and_check(model.parameters()) is True
    for got, want in zip(_grads(model), reference):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert policy.scaler.scale == 2.0**10


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_an_overflow_skips_the_micro_batch_backs_off_and_leaves_clean_grads(bad):
    model = _model()
    policy = _fp16_policy(init_scale=2.0**16)
    policy.scale_loss(model(torch.randn(4, 8)).sum()).backward()
    next(model.parameters()).grad[0, 0] = bad  # one poisoned element
    assert policy.unscale_and_check(model.parameters()) is False
    assert policy.scaler.scale == 2.0**15 and policy.scaler.overflows == 1
    for g in _grads(model):  # nothing non-finite can reach the collaborative accumulator
        assert torch.isfinite(g).all() and not g.any()
    assert policy.to_json()["overflows"] == 1

    model.zero_grad()  # the next micro-batch trains normally at the lower scale
    policy.scale_loss(model(torch.randn(4, 8)).sum()).backward()
    assert policy.unscale_and_check(model.parameters()) is True


def test_the_scale_grows_after_clean_steps_and_has_a_floor():
    scaler = LossScaler(init_scale=4.0, growth_interval=3, min_scale=1.0)
    p = torch.nn.Parameter(torch.ones(3))
    for expected in (4.0, 4.0, 8.0):
        p.grad = torch.ones(3)
        assert scaler.unscale_and_check([p])
        assert scaler.scale == expected
    for expected in (4.0, 2.0, 1.0, 1.0):
        p.grad = torch.full((3,), float("inf"))
        assert not scaler.unscale_and_check([p])
        assert scaler.scale == expected
    assert scaler.unscale_and_check([torch.nn.Parameter(torch.ones(1))])  # no grads: nothing to check


def test_fp16_grads_do_not_false_alarm_on_a_large_norm():
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))
    p.grad = torch.full((4,), 60000.0, dtype=torch.float16)  # finite, but its fp16 norm would overflow
    assert LossScaler(init_scale=2.0**10).unscale_and_check([p])


def test_bf16_autocast_runs_on_cpu():
    policy = choose_precision(RECORDED["CPU"], "bf16")
    model, x = _model(), torch.randn(4, 8)
    with policy.autocast():
        out = model(x)
    assert out.dtype == torch.bfloat16
    assert policy.scale_loss(out.float().sum()) is not None
    out.float().sum().backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())  # master params stay fp32
    assert policy.unscale_and_check(model.parameters()) is True
    assert model(x).dtype == torch.float32  # only inside the context


def test_fp32_autocast_is_a_no_op():
    policy = choose_precision(RECORDED["CPU"], None)
    loss = torch.ones(())
    with policy.autocast():
        assert torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype == torch.float32
    assert policy.scale_loss(loss) is loss


def test_fp16_loop_on_cpu_drops_only_the_bad_micro_batch():
    """The loop the lead wires into toolkit.join, with a counting stand-in for the optimizer."""
    policy = _fp16_policy(init_scale=2.0**8)
    model, steps = _model(), []
    data = torch.Generator().manual_seed(2)
    for i in range(4):
        x, y = torch.randn(16, 8, generator=data), torch.randn(16, 1, generator=data)
        model.zero_grad()
        with policy.autocast():
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        policy.scale_loss(loss).backward()
        if i == 2:
            model[0].weight.grad[0, 0] = float("inf")
        if policy.unscale_and_check(model.parameters()):
            steps.append(i)
            assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert steps == [0, 1, 3]
