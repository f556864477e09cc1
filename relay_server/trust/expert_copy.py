"""The relay's own copy of an expert: what a host's answer must be, computed again on the relay.

The relay never serves an expert, but it holds everything needed to compute one at a known
version: the run's expert architecture and seed (a fresh expert, version 0, is the seed's), and
the checkpoints hosts upload (``p.*`` tensors, ``updates`` = the optimizer steps it holds). A host
tags every result with the version of the expert it computed it on; given that version's
parameters, the copy computes the same call with the code hosts run (:mod:`toolkit.moe.experts`:
a forward under ``no_grad``; a backward as the host's runtime does it, ``d(y . g) / dx`` at the
parameters before its step), in float32 on the relay's CPU, off the event loop, one call at a
time (a lock: one torch thread pool).

Every row of an expert is computed independently of the other rows (a linear map, a per-row
LayerNorm, a residual), so a call computed alone equals its rows of the host's batch up to float
rounding: the tolerance of :mod:`relay_server.trust.compare`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from toolkit.moe.experts import build_expert

CACHED_EXPERTS = 8
"""Experts kept built (with their seed's parameters): building one draws every parameter from its
generator, about twice a 64-row forward of a d=1024 expert on a CPU; loading a version is a copy."""


class ExpertCopy:
    def __init__(self, expert: Mapping[str, Any], seed: int) -> None:
        self.expert, self.seed = dict(expert), seed
        self.lock = threading.Lock()
        self.computed = 0
        self.built: OrderedDict[str, tuple[nn.Module, dict[str, torch.Tensor]]] = OrderedDict()

    def compute(
        self, uid: str, kind: str, params: Mapping[str, np.ndarray] | None, x: np.ndarray, g: np.ndarray | None
    ) -> np.ndarray:
        """The answer of a ``kind`` call of expert ``uid`` on rows ``x`` (and ``g``, the gradient of
        its output, for a backward) at ``params`` (checkpoint tensors ``p.<name>``; None: the
        fresh expert of the run's seed)."""
        with self.lock:
            self.computed += 1
            module = self._module(uid, params)
            inputs = torch.from_numpy(np.array(x, dtype=np.float32))
            if kind == "forward":
                with torch.no_grad():
                    return module(inputs).numpy()
            if g is None:
                raise ValueError("a backward call needs the gradient of the expert's output")
            with torch.enable_grad():
                inputs.requires_grad_(True)
                (grad,) = torch.autograd.grad(  # d(y . g)/dx only: the copy's parameters keep no gradient
                    module(inputs), inputs, torch.from_numpy(np.array(g, dtype=np.float32)), allow_unused=True
                )
            return grad.numpy() if grad is not None else np.zeros_like(x)

    def _module(self, uid: str, params: Mapping[str, np.ndarray] | None) -> nn.Module:
        """Expert ``uid`` holding ``params`` (None: its seed's)."""
        if uid in self.built:
            self.built.move_to_end(uid)
            module, fresh = self.built[uid]
        else:
            module = build_expert(self.expert, uid, self.seed)
            fresh = {name: p.detach().clone() for name, p in module.named_parameters()}
            self.built[uid] = (module, fresh)
            while len(self.built) > CACHED_EXPERTS:
                self.built.popitem(last=False)
        with torch.no_grad():
            for name, p in module.named_parameters():
                p.copy_(fresh[name] if params is None else torch.from_numpy(np.asarray(params[f"p.{name}"])))
        return module
