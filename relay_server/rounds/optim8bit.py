"""8-bit optimizer state on the backbone: AdamW with blockwise-quantized moments.

Per parameter the relay holds the master value (4 B), the averaged gradient (4 B) and AdamW's two
moments (8 B): the moments are half of it. Stored as 8-bit codes of a dynamic (tree) quantization
map with one float32 absmax per block of 256 values (Dettmers et al. 2022, "8-bit Optimizers via
Block-wise Quantization"), they take 2 x (1 + 4/256) = 2.03 B/param -- 3.9x smaller -- and
training follows fp32 AdamW closely (tests/test_optim8bit.py). Each step dequantizes one tensor's
moments to float32, updates them and the parameter in float32, and re-quantizes, so only one
tensor's worth of float32 moments exists at a time.

Backed by ``bitsandbytes``, whose optimizers run on CPU since its CPU kernels landed (bitsandbytes
PR #1901, 2026; verified here: 0.50.2 with torch 2.13 CPU). What works and what does not, measured
on this machine (2 shared cores):

* ``AdamW8bit`` / ``Adam8bit`` on CPU tensors: work; the 8-bit path (C++ quantize/dequantize +
  torch math) is ~3x slower per step than ``torch.optim.AdamW`` (10M params: 1.3 s vs 0.4 s), a
  cost paid once per collaboration step in the relay's worker thread.
* Tensors smaller than ``MIN_8BIT_SIZE`` (biases, norms) keep float32 state: bitsandbytes'
  default; they are a rounding error of P.
* ``Adam8bit`` applies weight decay *decoupled* (like AdamW), unlike ``torch.optim.Adam``'s L2;
  so 8-bit state is offered for ``adamw`` (and ``adam`` without weight decay) only.
* Paged optimizers fall back to non-paged on CPU (with a warning); nothing to gain here.
* Older releases refuse CPU tensors; :func:`bitsandbytes_cpu` probes by running one tiny step,
  not by reading a version number, and names the fix.

Checkpoints: the relay saves ``optimizer.state`` tensor by tensor (``MasterState``), so an 8-bit
run's checkpoint holds the codes (``state1``/``state2`` uint8, ``absmax1/2``, ``qmap1/2``). A run
switched to 8-bit resumes from an fp32 AdamW checkpoint (:meth:`adopt` quantizes ``exp_avg`` /
``exp_avg_sq`` on the first step), and :func:`fp32_state` turns 8-bit state back into
``torch.optim.AdamW``'s, for a run switched back.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import torch

from relay_server.core.config import ConfigError
from toolkit.runtime.eight_bit import MIN_8BIT_SIZE, probe_adamw8bit

log = logging.getLogger(__name__)

BLOCK = 256
"""Values per absmax block: fixed by bitsandbytes' 8-bit blockwise optimizers since 0.44."""
_PIP_HINT = 'pip install -U "bitsandbytes>=0.50" on the relay, or set optimizer.state_bits = 32'


class EightBitUnavailable(ConfigError):
    """``optimizer.state_bits = 8`` cannot run on this relay; the message says why and the fix."""


@functools.cache
def bitsandbytes_cpu() -> ModuleType:
    """``bitsandbytes``, once one 8-bit AdamW step on a CPU tensor has worked (cached)."""
    found = probe_adamw8bit(torch.device("cpu"))
    if isinstance(found, str):
        raise EightBitUnavailable(f"optimizer.state_bits = 8 on the relay: {found}; {_PIP_HINT}")
    import bitsandbytes

    return bitsandbytes


def check_supported(name: str, weight_decay: float) -> None:
    """Fail early, naming the setting, for combinations 8-bit state would silently change."""
    if name == "adam" and weight_decay:
        raise ConfigError(
            "optimizer.state_bits = 8 with optimizer.name = adam: bitsandbytes' 8-bit Adam decays "
            "weights like AdamW (decoupled), not like torch Adam (L2); use optimizer.name = adamw "
            "or weight_decay = 0"
        )
    if name not in ("adam", "adamw"):
        raise ConfigError(f"optimizer.state_bits = 8 is for adam/adamw, not {name!r}; set optimizer.state_bits = 32")


@functools.cache
def _optimizer_class() -> Any:
    """A subclass of bitsandbytes' ``AdamW8bit`` (typed Any: bitsandbytes ships no types)."""
    bnb = bitsandbytes_cpu()
    base: Any = bnb.optim.AdamW8bit

    class AdamW8bitState(base):
        """``bitsandbytes.optim.AdamW8bit`` that adopts state loaded from a checkpoint."""

        @torch.no_grad()
        def step(self, closure: Any = None) -> Any:
            self.adopt()
            return super().step(closure)

        def adopt(self) -> None:
            """Normalize loaded state: ``step`` back to an int (checkpoints store tensors), and
            fp32 AdamW moments (``exp_avg``/``exp_avg_sq``) quantized into this optimizer's form."""
            for p, state in self.state.items():
                if "exp_avg" in state:
                    self.state[p] = self._quantized(p, state)
                elif torch.is_tensor(state.get("step")):
                    state["step"] = int(state["step"].item())

        def _quantized(self, p: torch.Tensor, state: Mapping[str, torch.Tensor]) -> dict[str, Any]:
            step = int(state["step"].item()) if torch.is_tensor(state["step"]) else int(state["step"])
            m, v = state["exp_avg"].float().reshape(p.shape), state["exp_avg_sq"].float().reshape(p.shape)
            if p.numel() < MIN_8BIT_SIZE:
                return {"step": step, "state1": m.clone(), "state2": v.clone()}
            if "dynamic" not in self.name2qmap:
                self.fill_qmap()
            out: dict[str, Any] = {"step": step}
            for i, (moment, qmap) in enumerate(((m, "dynamic"), (v, "udynamic")), start=1):
                code = self.name2qmap[qmap].to(p.device)
                q, quant = bnb.functional.quantize_blockwise(moment.contiguous(), code=code, blocksize=BLOCK)
                out[f"state{i}"], out[f"absmax{i}"], out[f"qmap{i}"] = q, quant.absmax.float(), code
            log.info("quantized fp32 AdamW state of a %d-element tensor to 8 bits", p.numel())
            return out

    return AdamW8bitState


def make_adamw8bit(groups: list[dict[str, Any]], cfg: Any) -> torch.optim.Optimizer:
    """The relay's optimizer for ``optimizer.state_bits = 8`` (``cfg``: the OptimizerSection).

    Param groups as ``MasterState`` builds them (per-group ``weight_decay``); parameters may be
    views into the master's flat vector: the update writes through them.
    """
    check_supported(cfg.name, cfg.weight_decay)
    betas = (float(cfg.betas[0]), float(cfg.betas[1]))
    return _optimizer_class()(
        groups, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=0.0, min_8bit_size=MIN_8BIT_SIZE
    )


def fp32_state(values: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One parameter's loaded state in ``torch.optim.AdamW``'s form (``step``, ``exp_avg``,
    ``exp_avg_sq``): 8-bit codes are dequantized, fp32 ``state1/2`` renamed; anything else
    (already torch's form) is returned as is."""
    if "state1" not in values:
        return dict(values)
    step = torch.tensor(float(values["step"]))
    moments = []
    for i in (1, 2):
        s = values[f"state{i}"]
        if s.dtype == torch.uint8:
            bnb = bitsandbytes_cpu()
            s = bnb.functional.dequantize_blockwise(
                s, absmax=values[f"absmax{i}"].float(), code=values[f"qmap{i}"].float(), blocksize=BLOCK
            )
        moments.append(s.float().clone())
    return {"step": step, "exp_avg": moments[0], "exp_avg_sq": moments[1]}


def state_nbytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state tensors (shared quantization maps counted once)."""
    seen: set[int] = set()
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value) and value.data_ptr() not in seen:
                seen.add(value.data_ptr())
                total += value.numel() * value.element_size()
    return total
