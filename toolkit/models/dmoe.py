"""A trainer model whose hidden blocks are decentralized mixtures of experts (Learning@home).

Only the dense parts -- input projection, per-block LayerNorm, the mixtures' gates, the head --
are parameters of this module, so only they are in the run's flat vector and trained in DeDLOC
rounds; the experts live on expert hosts, which update them from the backward calls (the
paper's s3.3 runtime). The relay builds this model from the run's spec without a caller, for the
parameter layout; a trainer attaches its caller (:meth:`DMoEMLP.attach_caller`) before training.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from toolkit.moe.calls import ExpertCaller
from toolkit.moe.experts import FFNExpert
from toolkit.moe.layer import RemoteMixtureOfExperts

if TYPE_CHECKING:  # typing.Self is Python 3.11's; annotations are not evaluated at run time
    from typing import Self


def expert_layers(
    layers: int,
    hidden: int,
    grid: Sequence[int],
    k: int,
    caller: ExpertCaller | None,
    uid_prefix: str,
    k_min: int,
    timeout_s: float,
    *,
    backward_timeout_s: float | None,
    timeout_after_k_min_s: float | None,
    beam_size: int | None,
) -> list[RemoteMixtureOfExperts]:
    """Block ``l``'s mixture over the grid ``f"{uid_prefix}{l}"``, for each of ``layers`` blocks:
    what every DMoE model puts where a dense block would be, from the arguments one ``[moe]``
    section gives either model (the timeouts, ``k_min`` and ``beam_size`` are
    :class:`RemoteMixtureOfExperts`'s)."""
    return [
        RemoteMixtureOfExperts(
            hidden,
            tuple(grid),
            k,
            caller,
            f"{uid_prefix}{i}",
            k_min,
            timeout_s,
            backward_timeout_s=backward_timeout_s,
            timeout_after_k_min_s=timeout_after_k_min_s,
            beam_size=beam_size,
        )
        for i in range(layers)
    ]


class ExpertModel:
    """What every DMoE trainer model offers besides its forward: a caller to attach (the relay's,
    or a loopback one), its experts' uids, how an expert is built, and its balancing term. A mixin:
    the model sets ``moe`` (its mixture layers), ``hidden``, ``expert_hidden``, ``expert_seed`` and
    ``balancing_coef``."""

    moe: Sequence[RemoteMixtureOfExperts]
    hidden: int
    expert_hidden: int
    expert_seed: int
    balancing_coef: float

    def attach_caller(self, caller: ExpertCaller) -> Self:
        for layer in self.moe:
            layer.caller = caller
        return self

    def balancing_losses(self) -> list[torch.Tensor]:
        """Each mixture's balancing loss from this thread's last forward."""
        losses = []
        for layer in self.moe:
            loss = layer.balancing_loss
            if loss is None:
                raise RuntimeError("the balancing loss is read after a forward, and this thread ran none")
            losses.append(loss)
        return losses

    def balancing(self) -> torch.Tensor:
        """``balancing_coef`` times the mean balancing loss of this thread's last forward (what
        each model adds to its task loss)."""
        return self.balancing_coef * torch.stack(self.balancing_losses()).mean()

    def expert_uids(self) -> list[str]:
        """Every expert uid of every block's full grid (hosts lease a subset)."""
        return [uid for layer in self.moe for uid in layer.grid.all_uids()]

    def make_expert(self, uid: str) -> FFNExpert:
        """Expert ``uid`` as a host or an in-process reference initialises it."""
        return FFNExpert.for_uid(uid, self.hidden, self.expert_hidden, self.expert_seed)


class DMoEMLP(ExpertModel, nn.Module):
    """``forward(x [b, in_features]) -> [b, out_features]``; ``loss(batch [b, in_features + 1])``:
    mean squared error of the last column when ``out_features == 1``, else cross-entropy with the
    last column as the class index; plus ``balancing_coef`` times the mixtures' mean balancing loss.

    Block ``l`` is ``h = h + moe_l(LayerNorm(h))`` over the grid ``f"{uid_prefix}{l}"``, so a row
    that every chosen expert failed keeps ``h``. Expert ``uid`` is ``FFNExpert(hidden,
    expert_hidden)`` seeded from ``(uid, expert_seed)``: :meth:`make_expert`. The timeouts,
    ``k_min`` and ``beam_size`` are :class:`RemoteMixtureOfExperts`'s.
    """

    def __init__(
        self,
        *,
        in_features: int = 16,
        hidden: int = 32,
        out_features: int = 1,
        layers: int = 2,
        grid: Sequence[int] = (4, 4),
        k: int = 4,
        k_min: int = 1,
        expert_hidden: int = 64,
        uid_prefix: str = "ffn",
        timeout_s: float = 30.0,
        backward_timeout_s: float | None = None,
        timeout_after_k_min_s: float | None = None,
        balancing_coef: float = 0.01,
        expert_seed: int = 0,
        beam_size: int | None = None,
        caller: ExpertCaller | None = None,
    ) -> None:
        super().__init__()
        self.hidden, self.expert_hidden, self.expert_seed = hidden, expert_hidden, expert_seed
        self.out_features, self.balancing_coef = out_features, balancing_coef
        self.inp = nn.Linear(in_features, hidden)
        self.norms = nn.ModuleList(nn.LayerNorm(hidden) for _ in range(layers))
        mixtures = expert_layers(
            layers,
            hidden,
            grid,
            k,
            caller,
            uid_prefix,
            k_min,
            timeout_s,
            backward_timeout_s=backward_timeout_s,
            timeout_after_k_min_s=timeout_after_k_min_s,
            beam_size=beam_size,
        )
        # a ModuleList (registered, in the flat vector) of mixtures: torch's ModuleList is not generic
        self.moe = nn.ModuleList(mixtures)  # type: ignore[assignment]
        self.head = nn.Linear(hidden, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for norm, moe in zip(self.norms, self.moe):
            h = h + moe(norm(h))
        return self.head(h)

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        out = self(batch[:, :-1])
        if self.out_features == 1:
            task = F.mse_loss(out.squeeze(-1), batch[:, -1])
        else:
            task = F.cross_entropy(out, batch[:, -1].long())
        return task + self.balancing()
