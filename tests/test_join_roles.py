"""``join()`` only picks the role and hands it its options: an option the role would not use is
refused in one line naming the option and the role (before anything connects when ``role`` is
given; before this peer joins when the run decides the role), a role the run has no place for is
refused, and ``python -m toolkit.peer`` passes a stage worker none of the trainer's defaults."""

from __future__ import annotations

import pytest

from tests.support.pipeline import pipeline_overrides
from tests.support.pipeline_models import BYTE_SPEC
from toolkit.peer import arguments
from toolkit.peer import options_of as options_of_args
from toolkit.roles.options import ROLES, OptionRefused, RoleRefused, options_of
from toolkit.session import join

NOWHERE = "http://127.0.0.1:9"
"""Nothing listens here: a join that connected before refusing would raise RelayUnreachable instead."""
ALL_OPTIONS = sorted({name for role in ROLES for name in options_of(role)})


@pytest.mark.parametrize("role", sorted(ROLES))
def test_every_option_a_role_does_not_use_is_refused_in_one_line_before_connecting(role: str) -> None:
    unused = [name for name in ALL_OPTIONS if name not in options_of(role)]
    assert unused  # every role lacks some other role's option
    for name in unused:
        with pytest.raises(OptionRefused) as refused:
            join(NOWHERE, role=role, **{name: None})
        line = str(refused.value)
        assert "\n" not in line and f"join(role={role!r}) does not use {name} -- remove it, or join as " in line, line


def test_the_refusals_say_which_role_takes_the_option() -> None:
    with pytest.raises(
        OptionRefused,
        match=r"^\[unused_option\] join\(role='stage_worker'\) does not use "
        r"batch_size -- remove it, or join as a trainer \(role='trainer'\)\.$",
    ):
        join(NOWHERE, role="stage_worker", batch_size=16)
    with pytest.raises(
        OptionRefused,
        match=r"join\(role='trainer'\) does not use capacity -- remove it, or join "
        r"as an expert host \(role='expert_host'\)",
    ):
        join(NOWHERE, role="trainer", capacity=3)
    with pytest.raises(
        OptionRefused,
        match=r"join\(role='expert_host'\) does not use data -- remove it, or join "
        r"as a trainer or a stage worker \(role='trainer'\)",
    ):
        join(NOWHERE, role="expert_host", data=[])


def test_without_a_role_a_typo_or_an_expert_hosts_option_is_refused_before_connecting() -> None:
    with pytest.raises(
        OptionRefused,
        match=r"^\[unknown_option\] join\(\) has no option batchsize -- remove it; "
        r"a trainer or a stage worker takes: accumulate_on_host, batch_size",
    ):
        join(NOWHERE, batchsize=8)
    with pytest.raises(
        OptionRefused,
        match=r"join\(\) does not use capacity -- remove it, or join as an expert "
        r"host \(role='expert_host'\)",
    ):
        join(NOWHERE, capacity=2)
    with pytest.raises(OptionRefused, match="unknown_role"):
        join(NOWHERE, role="host")
    with pytest.raises(ValueError, match="moe_in_flight must be an integer >= 1"):
        join(NOWHERE, moe_in_flight=0)


def test_a_pipeline_runs_peer_is_refused_a_trainers_option_before_it_joins(serve_relay) -> None:
    """The run decides the role (its model is cut into stages): a trainer's option is refused
    after reading the run and before joining; so is an explicit role the run has no place for."""
    relay = serve_relay(pipeline_overrides(BYTE_SPEC, stages=2))
    with pytest.raises(
        OptionRefused,
        match=r"^\[unused_option\] join\(\) on run '[^']+', whose peers are "
        r"stage workers, does not use batch_size -- remove it \(or join another "
        r"run\)\.$",
    ):
        join(relay.url, batch_size=4, panel="none")
    with pytest.raises(RoleRefused, match=r"has no trainers: its peers are stage workers -- Leave role out"):
        join(relay.url, role="trainer", panel="none")
    assert relay.status()["peers"] == []
    plain = serve_relay(name="plain")
    with pytest.raises(RoleRefused, match=r"has no stage workers: its peers are trainers"):
        join(plain.url, role="stage_worker", panel="none")
    assert plain.status()["peers"] == []


def test_the_peer_command_gives_a_stage_worker_only_the_flags_typed(serve_relay) -> None:
    """``python -m toolkit.peer``'s options on a pipeline run: none of its trainer flags' defaults
    (the run's peers are stage workers), and a trainer flag typed on the command line is refused
    in one line; on a plain run, the trainer's flags as they always were (delayed updates off)."""
    pipeline, plain = serve_relay(pipeline_overrides(BYTE_SPEC, stages=2)), serve_relay(name="plain")
    typed = arguments().parse_args(["--relay", pipeline.url, "--name", "w", "--seed", "3", "--max-steps", "2"])
    assert options_of_args(typed) == dict(
        role="stage_worker", token=None, peer_name="w", seed=3, max_steps=2, max_seconds=None
    )
    typed = arguments().parse_args(["--relay", pipeline.url, "--name", "w", "--report-interval", "0"])
    with pytest.raises(OptionRefused) as refused:
        join(pipeline.url, **options_of_args(typed))
    assert str(refused.value) == (
        "[unused_option] join(role='stage_worker') does not use report_interval_s -- "
        "remove it, or join as a trainer (role='trainer')."
    )
    assert pipeline.status()["peers"] == []
    typed = arguments().parse_args(["--relay", plain.url, "--name", "t", "--report-interval", "0"])
    assert options_of_args(typed) == dict(
        role="trainer",
        token=None,
        peer_name="t",
        seed=None,
        max_steps=None,
        max_seconds=None,
        trusted_models=[],
        delayed_updates=False,
        report_interval_s=0.0,
        verbose=False,
    )
