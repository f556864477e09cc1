"""The relay plugs its features in through one interface (issue 36): the core app names none.

``relay_server/api/app.py`` may name a feature's module only where it lists the features; every
other use -- routes, public routes, body limits, services, status, the takeover of a core route
-- goes through :class:`relay_server.api.feature.FeatureSet`.
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

from relay_server.api.app import FEATURES
from relay_server.api.feature import SLICE_PARAMS, TICKETED_GRADIENT, Feature, FeatureSet
from relay_server.collaboration.opening import RoundsElsewhere
from relay_server.local_sgd.outer_rounds import OuterRoundRule
from tests.support.source import parse_source

APP = Path(__file__).resolve().parents[1] / "relay_server" / "api" / "app.py"
FEATURE_MODULES = {"moe_feature", "pipeline_feature", "local_sgd_feature", "evaluation_feature"}


def test_the_app_names_a_feature_only_in_its_list_of_features() -> None:
    tree = parse_source(APP.read_text())
    listing = next(n for n in tree.body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "FEATURES")
    listed = {id(n) for n in ast.walk(listing)}
    named = sorted(
        f"line {n.lineno}: {ast.unparse(n)}"
        for n in ast.walk(tree)
        if isinstance(n, ast.Name) and n.id in FEATURE_MODULES and id(n) not in listed
    )
    assert not named, "app.py names a feature outside FEATURES:\n" + "\n".join(named)
    assert {f.name for f in FEATURES.features} == {"moe", "pipeline", "local_sgd", "evaluation"}


def test_only_the_pipeline_takes_over_core_routes() -> None:
    taken = {name: f.name for f in FEATURES.features for name in f.takeovers}
    assert taken == {TICKETED_GRADIENT: "pipeline", SLICE_PARAMS: "pipeline"}


async def _handler(request, service):  # pragma: no cover - never called
    raise AssertionError


def test_two_features_may_not_take_over_one_core_route() -> None:
    one = Feature(name="a", section="a", enabled=lambda config: True, takeovers={TICKETED_GRADIENT: _handler})
    two = Feature(name="b", section="b", enabled=lambda config: True, takeovers={TICKETED_GRADIENT: _handler})
    with pytest.raises(ValueError, match="both take over 'ticketed_gradient'"):
        FeatureSet((one, two))
    with pytest.raises(ValueError, match="not one of"):
        FeatureSet((Feature(name="c", section="c", enabled=lambda config: True, takeovers={"params": _handler}),))


def run(mode: str = "sync", pipeline: bool = False) -> SimpleNamespace:
    """What the features' ``enabled`` and ``opening`` read of a config."""
    return SimpleNamespace(
        run=SimpleNamespace(mode=mode, target_batch=32),
        pipeline=SimpleNamespace(enabled=pipeline),
        local_sgd=SimpleNamespace(straggler_wait_s=30.0),
        moe=SimpleNamespace(enabled=False),
        evaluation=SimpleNamespace(enabled=False),
    )


def test_the_run_s_mode_plugs_in_when_rounds_open_and_the_round_cycle_names_no_mode() -> None:
    assert FEATURES.opening(run()) is None  # sync: the round cycle's own target batch
    assert isinstance(FEATURES.opening(run(mode="local_sgd")), OuterRoundRule)
    assert isinstance(FEATURES.opening(run(pipeline=True)), RoundsElsewhere)
    cycle = (APP.parents[1] / "collaboration" / "round_cycle.py").read_text()
    assert "local_sgd" not in cycle and "pipeline.enabled" not in cycle


def test_two_features_may_not_both_decide_when_rounds_open() -> None:
    rule = Feature(name="a", section="a", enabled=lambda config: True, opening=lambda config: RoundsElsewhere())
    other = Feature(name="b", section="b", enabled=lambda config: True, opening=lambda config: RoundsElsewhere())
    with pytest.raises(ValueError, match="each decide when rounds open"):
        FeatureSet((rule, other)).opening(run())


def test_the_pipeline_keeps_its_own_parameters_and_the_collaboration_names_no_mode() -> None:
    """A relay restarted on a pipeline run resumes each stage from its owner's store; the
    collaboration learns that from the feature, not by reading ``[pipeline]``."""
    assert FEATURES.keep_parameters(run(pipeline=True))
    assert not FEATURES.keep_parameters(run()) and not FEATURES.keep_parameters(run(mode="local_sgd"))
    collaboration = (APP.parents[1] / "collaboration" / "machine.py").read_text()
    assert "config.pipeline" not in collaboration
