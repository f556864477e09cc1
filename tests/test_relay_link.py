"""The relay's own link load per step, stated in ``/api/plan`` (``relay_link``), and the recovery
copy's parameter pulls at ``aggregators.params_copy_every`` instead of after every step."""

from __future__ import annotations

import time

import pytest
import requests

from relay_server.api.context import COLLAB
from relay_server.backbone.link_load import ref_bytes
from relay_server.core.config import ConfigError, load_config
from relay_server.planning.policy import RELAY_ID
from tests.support.processes import merged, write_config
from tests.support.training import FAST_AGGREGATORS, train_sliced
from toolkit.wire.compression import get_codec
from toolkit.wire.protocol import PROTOCOL_VERSION, ROUTES


def join(url: str, count: int) -> None:
    for i in range(count):
        answer = requests.post(
            url + ROUTES["join"], json={"peer_name": f"p{i}", "protocol": PROTOCOL_VERSION}, timeout=10
        )
        assert answer.status_code == 200, answer.text


@pytest.mark.parametrize("compression", ["none", "int8", "topk2-64"])
def test_the_plan_states_what_one_relay_sends_and_receives_per_step(serve_relay, compression: str) -> None:
    relay = serve_relay({"run": {"compression": compression}})
    join(relay.url, 3)
    load = requests.get(relay.url + ROUTES["plan"], timeout=10).json()["relay_link"]
    n, codec = requests.get(relay.url + ROUTES["run"], timeout=10).json()["num_params"], get_codec(compression)
    body = 4 * n if compression == "none" else codec.wire_bytes(n)  # in step, an int8 peer gets the delta
    assert load["peers"] == 3 and load["cached"] is False
    assert load["parameters_out"] == load["out_per_step"] == 3 * body
    assert load["gradients_in"] == load["in_per_step"] == 3 * codec.wire_bytes(n)
    assert load["recovery_copy_in"] == load["migration_bytes"] == 0  # no aggregator: nothing remote


def test_with_a_cache_the_relay_sends_one_body_per_step_whatever_the_peers(serve_relay, closed_url: str) -> None:
    relay = serve_relay({"server": {"public_params_url": closed_url}})
    join(relay.url, 5)
    load = requests.get(relay.url + ROUTES["plan"], timeout=10).json()["relay_link"]
    n = requests.get(relay.url + ROUTES["run"], timeout=10).json()["num_params"]
    assert load["cached"] is True and load["out_per_step"] == 4 * n + 5 * ref_bytes(closed_url)
    ref = requests.get(relay.url + ROUTES["params"], params={"ref": 1}, timeout=10)
    assert len(ref.content) <= ref_bytes(closed_url)  # the stated ref size bounds the real one


def test_a_zero_copy_interval_is_one_line_naming_the_field(tmp_path) -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(write_config(tmp_path / "run.toml", merged({"aggregators": {"params_copy_every": 0}})))
    assert "aggregators.params_copy_every" in str(refused.value) and "\n" not in str(refused.value)


def test_the_recovery_copy_pulls_parameters_only_at_its_interval(serve_relay, start_aggregators, launch_peer) -> None:
    """``params_copy_every`` past the run's length: after slicing, the copy keeps the parameters
    the relay handed out at the plan change, and /api/plan says what the copy costs per step."""
    every = 1000
    relay = serve_relay(
        {
            "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.0},
            "aggregators": {**FAST_AGGREGATORS, "params_copy_every": every, "state_copy_every": every},
        }
    )
    aggregators = start_aggregators(relay, "agg0", wait=False)
    peers, _, status = train_sliced(relay, aggregators, launch_peer, 3, seed=3)
    collab = relay.app[COLLAB]

    def copy_and_step() -> tuple[int, dict, int]:
        """The plan change's step (the relay's own slice is never pulled), the copy's entries, the step."""
        own = next(o for o in collab.backbone.owners if o.owner_id == RELAY_ID)
        entries = {rng: step for rng, (step, _) in collab.backbone.copy.params_step.items()}
        return entries[(own.start, own.end)], entries, collab.step

    # Two steps past the copy's last plan change (a re-plan refills it): with params_copy_every = 1
    # the remote slices' entries would have moved on; here they stay at the plan change's step.
    deadline = time.monotonic() + 60
    while (snapshot := relay.call(copy_and_step))[2] < snapshot[0] + 2:
        assert time.monotonic() < deadline, f"the run did not go 2 steps past its last plan change: {snapshot}"
        time.sleep(0.2)
    installed, entries, step = snapshot
    assert set(entries.values()) == {installed}, f"at step {step}, the copy pulled parameters: {entries}"
    status = relay.status()
    load = status["plan"]["relay_link"]
    remote = sum(s["end"] - s["start"] for s in status["plan"]["slices"] if s["aggregator_id"] != RELAY_ID)
    assert remote > 0 and load["migration_bytes"] > 0
    # remote x (state bytes/param) / state_copy_every, and a migration moves that state in and out
    assert load["recovery_copy_in"] == pytest.approx(load["migration_bytes"] / 2 / every, rel=1e-9)
    for peer in peers:
        peer.proc.kill()
