"""``toolkit.join``: the one call a volunteer's notebook makes.

A peer plays one of three roles, each its own program under :mod:`toolkit.roles` with its own
options (:mod:`toolkit.roles.options`): a **trainer** trains the whole model
(:mod:`toolkit.roles.trainer`), a **stage worker** runs one stage of a model cut into pipeline
stages (:mod:`toolkit.roles.stage_worker`), an **expert host** hosts experts of a model with
mixture-of-experts layers (:mod:`toolkit.roles.expert_host`). ``join()`` only picks the role and
hands it its options: the run picks between a trainer and a stage worker unless ``role`` says, and
an option the role does not use is refused in one line before this peer joins (before anything
connects when ``role`` is given). Each role is a member of the run the same way
(:mod:`toolkit.run_membership`).
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from typing import Any

from toolkit.client import RelayClient
from toolkit.errors import AuthError
from toolkit.roles.expert_host import host_experts
from toolkit.roles.options import AUTOMATIC, RoleRefused, options_for, plural, refuse_unused
from toolkit.roles.result import JoinResult
from toolkit.roles.stage_worker import work_a_stage
from toolkit.roles.trainer import train
from toolkit.wire.protocol import RunInfo

__all__ = ["JoinResult", "join", "role_for"]


def join(relay_url: str, *, role: str | None = None, **options: Any) -> JoinResult:
    """Contribute to the run at ``relay_url`` until it finishes (or ``max_steps`` global steps /
    ``max_seconds`` pass, or the cell is interrupted).

    ``accumulate_on_host`` keeps the gradient accumulator in (pinned) host memory: 4 bytes per
    parameter less on the accelerator, for a copy of each micro-batch's gradients.

    ``trusted_models`` names the packages whose own model classes this machine may import (a run
    with ``[model] kind = "module"``); any other run model is built from the toolkit or the
    installed transformers, and a run naming a package not listed is refused before any import.

    ``token`` is the volunteer's Hugging Face token (:func:`toolkit.notebook.hints.hf_token` finds it);
    open runs ignore it, and it is never logged. ``model`` must expose ``loss(batch) -> scalar``
    (the run's model is built if omitted); ``data`` yields batches for it (the run's dataset if
    omitted: its streamed shards, or the demo text the toolkit ships, tokenized with the run's
    tokenizer into its ``[objective]``'s dict batches on a background thread when it names one). ``panel`` is "auto",
    "widgets", "tqdm", "none" or your own :class:`~toolkit.notebook.panel.Panel`. ``wandb_project``
    ("project" or "entity/project") starts this peer's own W&B run (default: the project the run
    names, if any). ``delayed_updates`` (default: on when the run allows one step of staleness)
    keeps computing the next batch while a round is in flight. ``report_interval_s``: the least
    time between two progress reports of a trainer (0: one after every micro-batch, which keeps a
    step within the target plus one micro-batch per peer even when micro-batches take less than
    that: the demo's peers; a report costs the relay a request).

    Every role takes ``token``, ``peer_name``, ``max_seconds`` and ``panel``; a stage worker also
    ``data``, ``seed`` and ``max_steps``; every other option above is a trainer's
    (:class:`~toolkit.roles.options.TrainerOptions`). ``role`` (default: the run decides, a stage
    worker on a run cut into pipeline stages, a trainer on any other) is "trainer",
    "stage_worker" or "expert_host"; an option the role does not use raises
    :class:`~toolkit.roles.options.OptionRefused` naming it, instead of being ignored.

    ``role="expert_host"`` contributes to a run with mixture-of-experts layers by hosting
    ``capacity`` of its experts instead of training (:mod:`toolkit.moe.host`): until ``max_seconds``
    or the cell is interrupted. A trainer of such a run reaches the experts through the relay,
    and keeps several micro-batches in flight so their waits overlap (:mod:`toolkit.moe.inflight`):
    as many as its measured compute and expert waits call for (at most
    :data:`~toolkit.moe.inflight.MAX_IN_FLIGHT`), or exactly ``moe_in_flight`` (1: one micro-batch at
    a time, the plain loop; a number bounds the replicas' memory).
    """
    started = time.monotonic()
    if role is None:  # before connecting: a typo, an expert host's option, a bad value of a trainer's
        refuse_unused(options, AUTOMATIC, "join()")
        options_for("trainer", options)  # (a stage worker takes a subset of a trainer's options)
    else:
        chosen = options_for(role, options)
        if role == "expert_host":
            return host_experts(relay_url, chosen, started)
    with ExitStack() as cleanup:
        client, run = _connect(relay_url, options.get("token"))
        cleanup.callback(client.close)
        plays = role_for(run)
        if role is None:
            refuse_unused(
                options,
                (plays,),
                f"join() on run {run.run_name!r}, whose peers are {plural(plays)},",
                hint="remove it (or join another run).",
            )
            chosen = options_for(plays, options)
        elif role != plays:
            raise RoleRefused(
                "wrong_role",
                f"run {run.run_name!r} has no {plural(role)}: its peers are {plural(plays)}",
                f"Leave role out (the run decides), or pass role={plays!r}.",
            )
        if plays == "stage_worker":
            return work_a_stage(client, run, chosen, started)
        return train(client, run, chosen, started)


def role_for(run: RunInfo) -> str:
    """The role a peer of ``run`` plays: a stage worker when the model is cut into stages (this
    machine runs one of them), a trainer otherwise (an expert host is always asked for)."""
    return "stage_worker" if run.pipeline else "trainer"


def _connect(relay_url: str, token: str | None) -> tuple[RelayClient, RunInfo]:
    """The relay connection, logged in when the run requires it: the relay trades the Hugging
    Face token for an access pass once, and every later request is signed. The token goes into
    no log line, repr or error message."""
    client = RelayClient(relay_url)
    run = client.get_run()
    if run.auth == "hf":
        if not token:
            client.close()
            raise AuthError(
                "token_required",
                f"run {run.run_name!r} needs a Hugging Face login",
                "In a notebook: add your token as the HF_TOKEN secret (or answer the prompt) and run "
                "the cell again. From a shell: export HF_TOKEN=... (python -m toolkit.peer "
                "--token-env NAME reads another variable).",
            )
        client.login(token)
    return client, run
