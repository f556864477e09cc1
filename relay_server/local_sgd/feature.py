"""``run.mode = "local_sgd"`` as a feature the relay plugs in: when its outer rounds open, what
joining peers learn of the inner loop, and the outer loop's figures in the relay's report.

Everything else of an outer round is sync mode's own -- the upload, the reduction, the master's
(outer) optimizer step, the after-publish sequence -- so what this mode adds to the relay is its
round-opening rule (:class:`relay_server.local_sgd.outer_rounds.OuterRoundRule`: every peer working on
the version finished its inner budget, or the finished ones hold the target batch, or the
stragglers' wait ran out), which the collaboration's round cycle asks instead of sync's target
batch. Its config section, ``[local_sgd]``, and the compatibility checks it carries load with the
config (:mod:`relay_server.local_sgd.local_sgd_config`); its figures (outer round, inner steps, busy
fraction) amend every status report (:mod:`relay_server.local_sgd.outer_status`), which W&B's step
events carry too; ``RunInfo.local_sgd`` tells a joining peer its inner optimizer and budget.
"""

from __future__ import annotations

from typing import Any

from relay_server.api.feature import Feature
from relay_server.core.config import RelayConfig
from relay_server.local_sgd.outer_rounds import OuterRoundRule
from relay_server.local_sgd.outer_status import OuterLoopFigures


def _outer_rounds(config: RelayConfig) -> OuterRoundRule:
    return OuterRoundRule(config.run.target_batch, config.local_sgd.straggler_wait_s)


def _run_info(config: RelayConfig) -> dict[str, Any]:
    return {"local_sgd": config.local_sgd.run_info(config.optimizer, config.run.total_steps)}


FEATURE = Feature(
    name="local_sgd",
    section="local_sgd",
    enabled=lambda config: config.run.mode == "local_sgd",
    build=OuterLoopFigures.build,
    opening=_outer_rounds,
    amends_report=OuterLoopFigures.amend,
    run_info=_run_info,
)
