"""Each role's options, and the one-line refusal of an option the role would not use.

``join()`` used to take all 18 options whatever it ran, so ``join(URL, batch_size=64)`` on a
pipeline run trained at the run's micro-batch size and said nothing, and ``capacity`` meant
nothing to a trainer. Now every role states what it takes (:class:`TrainerOptions`,
:class:`ExpertHostOptions`, :class:`StageWorkerOptions`, all starting from :class:`PeerOptions`),
and :func:`options_for` builds them from ``join()``'s keywords or refuses the first keyword the
role does not take, in one line naming the option and the role and saying which role takes it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from toolkit.errors import CollabError
from toolkit.notebook.panel import Panel, PanelKind


class OptionRefused(CollabError, TypeError):
    """``join()`` was given an option its role does not use (or that no role has). A TypeError, as
    Python's own refusal of an unexpected keyword is, raised before this peer joins."""


class RoleRefused(CollabError, ValueError):
    """``join(role=...)`` names a role the run has no place for (a trainer of a run cut into
    pipeline stages, a stage worker of one that is not)."""


@dataclass(frozen=True)
class PeerOptions:
    """What every role takes: ``token`` (a Hugging Face token, for runs that need a login; never
    logged), ``peer_name`` (default: the host name), ``max_seconds`` (leave after this long),
    ``panel`` ("auto", "widgets", "tqdm", "none" or your own :class:`~toolkit.notebook.panel.Panel`)."""

    token: str | None = None
    peer_name: str | None = None
    max_seconds: float | None = None
    panel: PanelKind | Panel = "auto"


@dataclass(frozen=True)
class TrainerOptions(PeerOptions):
    """A trainer's (``join()``'s docstring says what each does)."""

    model: torch.nn.Module | None = None
    data: Iterable[Any] | None = None
    batch_size: int = 8
    seed: int | None = None
    max_steps: int | None = None
    delayed_updates: bool | None = None
    wandb_project: str | None = None
    trusted_models: Sequence[str] = ()
    accumulate_on_host: bool = False
    verbose: bool = False
    moe_in_flight: int | None = None
    report_interval_s: float = 0.5

    def __post_init__(self) -> None:
        if self.moe_in_flight is not None and (not isinstance(self.moe_in_flight, int) or self.moe_in_flight < 1):
            raise ValueError(
                f"moe_in_flight must be an integer >= 1 (or None: sized from measurements), got {self.moe_in_flight!r}"
            )


@dataclass(frozen=True)
class ExpertHostOptions(PeerOptions):
    """An expert host's: ``capacity``, the experts it hosts."""

    capacity: int = 8


@dataclass(frozen=True)
class StageWorkerOptions(PeerOptions):
    """A stage worker's: its own ``data`` (micro-batches of the run's size; the run's shards if
    omitted), the ``seed`` of their order, and ``max_steps``. The micro-batch size, the precision
    and the model are the run's."""

    data: Iterable[Any] | None = None
    seed: int | None = None
    max_steps: int | None = None


ROLES: dict[str, type[PeerOptions]] = {
    "trainer": TrainerOptions,
    "expert_host": ExpertHostOptions,
    "stage_worker": StageWorkerOptions,
}
"""Every role ``join(role=...)`` takes, and its options."""
ROLE_NAMES = {"trainer": "a trainer", "expert_host": "an expert host", "stage_worker": "a stage worker"}
AUTOMATIC = ("trainer", "stage_worker")
"""The roles ``join()`` picks by itself when ``role`` is left out: a stage worker on a run cut into
pipeline stages, a trainer on any other."""


def options_of(role: str) -> tuple[str, ...]:
    return tuple(f.name for f in fields(ROLES[role]))


def options_for(role: str, given: Mapping[str, Any]) -> PeerOptions:
    """``role``'s options from ``join()``'s keywords; :class:`OptionRefused` for the first one
    the role does not use."""
    if role not in ROLES:
        raise OptionRefused(
            "unknown_role",
            f"join(role={role!r}): there is no such role",
            "Use role='trainer', 'expert_host' or 'stage_worker', or leave role out (the run "
            "decides between a trainer and a stage worker).",
        )
    refuse_unused(given, (role,), f"join(role={role!r})")
    return ROLES[role](**given)


def plural(role: str) -> str:
    return role.replace("_", " ") + "s"


def refuse_unused(given: Iterable[str], roles: Sequence[str], who: str, hint: str = "") -> None:
    """Refuse the first of ``given`` that none of ``roles`` uses, saying which role does (or
    ``hint``, when joining as that role is no way out)."""
    for name in given:
        if any(name in options_of(role) for role in roles):
            continue
        users = [role for role in ROLES if name in options_of(role)]
        if users:
            hint = hint or f"remove it, or join as {' or '.join(ROLE_NAMES[r] for r in users)} (role={users[0]!r})."
            raise OptionRefused("unused_option", f"{who} does not use {name}", hint)
        known = sorted({option for role in roles for option in options_of(role)})
        raise OptionRefused(
            "unknown_option",
            f"{who} has no option {name}",
            f"remove it; {' or '.join(ROLE_NAMES[r] for r in roles)} takes: {', '.join(known)}.",
        )
