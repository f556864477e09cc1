"""What crosses the relay's own link per step under a plan, stated in ``/api/plan``
(:class:`~toolkit.wire.protocol.RelayLinkLoad`): the figure an organizer sizes the relay's VM by.

Predicted from what the relay knows, not measured: the peers online, the codec (a lossy run's
peers download int8 deltas), the run's HTTP cache (``[server] public_params_url``: with the
relay alone owning the vector, one body per version leaves the relay whatever the number of
peers), the slice the relay owns, and the recovery copy's intervals (``[aggregators]
params_copy_every``, ``state_copy_every``). The optimizer state's bytes per parameter come from
the relay's newest state file (what a migration or a state pull moves per parameter).
"""

from __future__ import annotations

import math

from relay_server.backbone.recovery import RecoveryCopy
from relay_server.backbone.slice_owner import SliceOwner
from relay_server.backbone.slicing import Owner
from relay_server.core.config import RelayConfig
from relay_server.planning.policy import RELAY_ID
from toolkit.wire.compression import RunCodecs
from toolkit.wire.protocol import ROUTES, ParamsRef, RelayLinkLoad


def relay_link_load(
    config: RelayConfig,
    codecs: RunCodecs,
    owners: list[Owner],
    num_params: int,
    peers: int,
    state_bytes_per_param: float,
) -> RelayLinkLoad:
    mine = sum(o.end - o.start for o in owners if o.owner_id == RELAY_ID)
    remote = num_params - mine
    body = 4 * mine if codecs.down.lossless else codecs.down.wire_bytes(mine)  # a peer in step gets the delta
    cached = bool(config.server.public_params_url) and remote == 0  # sliced versions come from each owner
    parameters_out = body + peers * ref_bytes(config.server.public_params_url) if cached else peers * body
    gradients_in = peers * codecs.up.wire_bytes(mine)
    a = config.aggregators
    params_only = 1 / a.params_copy_every - 1 / math.lcm(a.params_copy_every, a.state_copy_every)
    recovery_in = remote * (4 * params_only + state_bytes_per_param / a.state_copy_every)
    return RelayLinkLoad(
        peers=peers,
        out_per_step=parameters_out,
        in_per_step=gradients_in + recovery_in,
        parameters_out=parameters_out,
        gradients_in=gradients_in,
        recovery_copy_in=recovery_in,
        migration_bytes=2 * remote * state_bytes_per_param,
        cached=cached,
    )


def ref_bytes(base_url: str) -> int:
    """The size of one :class:`ParamsRef` (what each peer still gets from the relay per version)."""
    path = ROUTES["params_blob"].format(step=10**9, tag="0" * 64, kind="delta")
    return len(
        ParamsRef(step=10**9, sha256="0" * 64, kind="delta", base=10**9 - 1, url=base_url.rstrip("/") + path).dumps()
    )


def state_bytes_per_param(local: SliceOwner | None, copy: RecoveryCopy | None, num_params: int) -> float:
    """Bytes of parameters and optimizer state per parameter: from the relay's newest state file,
    else from the recovery copy (0 while neither exists)."""
    if local is not None and local.publisher.latest is not None and local.end > local.start:
        try:
            return local.publisher.latest.path.stat().st_size / (local.end - local.start)
        except OSError:  # pruned in between
            pass
    if copy is not None:
        return sum(a.nbytes for name, a in copy.state.items() if not name.startswith("opt_scalar.")) / num_params
    return 0.0
