"""The inner optimizer of local SGD with ``optimizer.state_bits = 8`` (issue 26,
:mod:`toolkit.optimizer.inner`): the peer keeps Adam's moments in 8 bits where bitsandbytes runs.

- Beside float32 AdamW on the same batches, the 8-bit inner optimizer holds its large tensors'
  moments as uint8 codes (under a third of float32's bytes) and lands within 1% of float32's
  parameters after 30 steps, with the same loss to 2%.
- Through a real relay: a peer of a ``state_bits = 8`` local SGD run steps with bitsandbytes'
  8-bit AdamW, its outer rounds count, and the relay's own optimizer stays the outer SGD (so
  aggregators may still own slices of it).
- A peer where bitsandbytes cannot run keeps float32 moments and says so in one warning line,
  rather than refusing to join: its pseudo-gradient is the same kind of thing either way.
"""

from __future__ import annotations

import logging
import sys

import numpy as np
import pytest
import torch

from relay_server.backbone.aggregators import Aggregators
from relay_server.core.config import load_config
from tests.support.local_sgd import batches, local_run, relative_difference, train
from tests.support.processes import merged, write_config
from tests.support.training import params_of
from toolkit.models import MLP
from toolkit.models.flat import flatten
from toolkit.optimizer import inner
from toolkit.wire.protocol import PROTOCOL_VERSION, AggregatorRegistration

bitsandbytes = pytest.importorskip("bitsandbytes", reason="the 8-bit inner state needs bitsandbytes")
EIGHT = inner.adamw8bit(torch.device("cpu"))
needs_8bit = pytest.mark.skipif(isinstance(EIGHT, str), reason=str(EIGHT))

ADAMW = {"name": "adamw", "lr": 0.01, "weight_decay": 0.01, "betas": [0.9, 0.99], "eps": 1e-8}
WIDE = {"model": {"factory": "toolkit.models:MLP", "kwargs": {"sizes": [8, 512, 1]}}}  # 8 x 512: 4,096 values


def fitted(state_bits: int, steps: int = 30) -> tuple[np.ndarray, float, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = MLP(sizes=[8, 512, 1])
    optimizer = inner.inner_optimizer(list(model.named_parameters()), {**ADAMW, "state_bits": state_bits})
    data = batches(steps, seed=3)
    for batch in data:
        optimizer.zero_grad()
        model.loss(batch).backward()
        optimizer.step()
    with torch.no_grad():
        loss = float(sum(model.loss(b) for b in data) / len(data))
    return flatten(model), loss, optimizer


def nbytes(state: dict, *names: str) -> int:
    return sum(state[n].numel() * state[n].element_size() for n in names)


@needs_8bit
def test_eight_bit_moments_train_like_float32_in_a_third_of_the_state() -> None:
    p32, loss32, opt32 = fitted(32)
    p8, loss8, opt8 = fitted(8)
    assert isinstance(opt8, bitsandbytes.optim.AdamW8bit)
    (weight8,) = [s for s in opt8.state.values() if s["state1"].numel() >= inner.MIN_8BIT_SIZE]  # the 8 x 512 one
    (weight32,) = [s for s in opt32.state.values() if s["exp_avg"].numel() >= inner.MIN_8BIT_SIZE]
    assert weight8["state1"].dtype == weight8["state2"].dtype == torch.uint8
    assert nbytes(weight8, "state1", "state2", "absmax1", "absmax2") < nbytes(weight32, "exp_avg", "exp_avg_sq") / 3
    assert relative_difference(p8, p32) < 1e-2
    assert abs(loss8 - loss32) <= 0.02 * loss32


@needs_8bit
def test_a_peer_of_an_eight_bit_run_steps_with_eight_bit_moments(serve_relay) -> None:
    relay = serve_relay(
        local_run({**ADAMW, "state_bits": 8}, inner_steps=3, outer_lr=0.7, outer_momentum=0.9, nesterov=True) | WIDE
    )
    init = params_of(relay.url)
    opt = train(relay.url, batches(3), 2)
    assert isinstance(opt.local_sgd.optimizer, bitsandbytes.optim.AdamW8bit)
    assert opt.local_sgd.outer_rounds == 2
    assert relative_difference(params_of(relay.url, 2), init) > 1e-3  # two outer steps were taken


def test_the_relay_keeps_its_outer_sgd_and_admits_aggregators(tmp_path) -> None:
    config = merged(local_run({**ADAMW, "state_bits": 8}, inner_steps=3) | WIDE)
    config["server"]["data_dir"] = str(tmp_path / "data")
    loaded = load_config(write_config(tmp_path / "run.toml", config), env={})
    outer = loaded.master_optimizer()
    assert (outer.name, outer.state_bits) == ("sgd", 32)
    assert loaded.local_sgd.run_info(loaded.optimizer, 10)["inner"]["state_bits"] == 8
    welcome = Aggregators(loaded, planning=None, run_info=None, ticket_key="k").register(
        AggregatorRegistration(name="agg", url="http://127.0.0.1:1", protocol=PROTOCOL_VERSION)
    )
    assert welcome.optimizer["name"] == "sgd"  # a sync run with state_bits = 8 refuses this (409)


def test_a_peer_without_bitsandbytes_keeps_float32_moments_and_says_so(monkeypatch, caplog) -> None:
    inner.adamw8bit.cache_clear()
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # what `import bitsandbytes` meets where it is absent
    try:
        model = MLP(sizes=[8, 512, 1])
        with caplog.at_level(logging.WARNING, logger="toolkit.optimizer"):
            optimizer = inner.inner_optimizer(list(model.named_parameters()), {**ADAMW, "state_bits": 8})
    finally:
        inner.adamw8bit.cache_clear()
    assert type(optimizer) is torch.optim.AdamW
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "state_bits = 8" in warnings[0] and "float32" in warnings[0], warnings
