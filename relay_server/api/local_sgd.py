"""``run.mode = "local_sgd"`` as a feature the relay plugs in: when its outer rounds open.

Everything else of an outer round is sync mode's own -- the upload, the reduction, the master's
(outer) optimizer step, the after-publish sequence -- so what this mode adds to the relay is its
round-opening rule (:class:`relay_server.rounds.local_sgd.OuterRoundRule`: every peer working on
the version finished its inner budget, or the finished ones hold the target batch, or the
stragglers' wait ran out), which the collaboration's round cycle asks instead of sync's target
batch. Its config section, ``[local_sgd]``, and the compatibility checks it carries load with the
config (:mod:`relay_server.core.local_sgd_config`); its figures (outer round, inner steps, busy
fraction) are part of every status report, which W&B's step events carry too.
"""

from __future__ import annotations

from relay_server.api.feature import Feature
from relay_server.core.config import RelayConfig
from relay_server.rounds.local_sgd import OuterRoundRule


def _outer_rounds(config: RelayConfig) -> OuterRoundRule:
    return OuterRoundRule(config.run.target_batch, config.local_sgd.straggler_wait_s)


FEATURE = Feature(
    name="local_sgd", section="local_sgd", enabled=lambda config: config.run.mode == "local_sgd", opening=_outer_rounds
)
