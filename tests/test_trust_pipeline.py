"""Dishonest stage workers against the pipeline's spot checks: a real relay and real worker
processes on 127.0.0.1 (``tests/stage_worker.py --corrupt``), one worker sending finite, well
shaped, wrong results, three honest ones, two stages.

* ``scale`` (stage 0) multiplies every activation it sends by 1.3;
* ``noise`` (stage 0) adds noise of 10% of each activation matrix's norm;
* ``flip`` (stage 1) flips the sign of every tenth stage gradient it sends, the first included.
* ``stale`` (stage 0) computes every batch on the first version's parameters (batch 0 is honest).

Every result is checked here (``check_share = 1.0``: which ones are checked at a smaller share is
the secret's business, tested in ``tests/test_trust.py``), so each liar is banned at its first
corrupted result, in the batch of that lie: the first batch it serves a task of its kind in, the
stale one's first after its first that it serves a first-stage task in (a batch it never served in
costs nothing). The ban restarts the batch, and rolls back the batches counted with unchecked
results of the liar (a stage-0 liar's backwards, which no check reaches), so the run equals one
process replaying the batches that were counted, to 1e-5, and no honest worker is ever banned.
"""

from __future__ import annotations

import pytest
import requests

from relay_server.harness.process import wait_until
from tests.support.peers import TOKENS, hf_relay, standin
from tests.support.pipeline import accepted_batches, checked_pipeline, pipeline_overrides, relative_difference, replay
from tests.support.pipeline_models import BYTE_SPEC
from tests.support.training import relay_params
from toolkit.client import RelayClient
from toolkit.errors import RelayRejected

MICROBATCHES = 4
STEPS = 3


def pipeline(relay) -> dict:
    return requests.get(relay.url + "/api/pipeline", timeout=10).json()


def placed(relay) -> int:
    """Workers placed so far: on a stage now, or banned (a liar may be banned before the next joins)."""
    status = pipeline(relay)
    return sum(len(s["workers"]) for s in status["stages"]) + len(status["trust"]["bans"])


def checked_run(
    serve_relay, launch_stage_worker, corrupt: str = "", liar_stage: int = 0, share: float = 1.0, steps: int = STEPS
):
    """Four workers placed in turn (a joiner goes to the stage with the fewest workers, the lower
    first), the liar (if any) the first placed on ``liar_stage``: the relay's status after
    ``steps`` batches, checked exact, the liar and the honest workers."""
    relay = serve_relay(checked_pipeline(microbatches=MICROBATCHES, check_share=share))
    _, initial = relay_params(relay.url)
    liar, honest = None, []
    for i in range(4):
        if corrupt and i == liar_stage:
            liar = launch_stage_worker(
                relay.url, f"liar-{corrupt}", seed=100, until_step=steps, extra=("--corrupt", corrupt)
            )
        else:
            honest.append(launch_stage_worker(relay.url, f"w{i}", seed=i, until_step=steps))
        if i <= liar_stage:  # placed in this order: the liar lands on its stage
            wait_until(lambda n=i + 1: placed(relay) >= n, 120, f"{i + 1} workers placed")
    for worker in honest:
        assert worker.wait(timeout_s=300) == 0, worker.log_path.read_text()[-3000:]
    step, final = relay_params(relay.url, min_step=steps)
    status = pipeline(relay)
    # a ban after the liar's unchecked results were counted (a stage-0 liar's backwards never are
    # checked) rolled every stage back: the batches it undid are not in the run, their ids reused
    rolled = [r for r in status["trust"]["rollbacks"] if r["outcome"] == "rolled back"]
    undone = sum(r["published_as"] - r["to_version"] for r in rolled)
    workers = honest + ([liar] if liar else [])
    batches = accepted_batches(workers, latest=True)  # a restarted batch's micro-batches: their last read
    reference = replay(BYTE_SPEC, initial, batches, steps=step - undone, microbatches=MICROBATCHES)
    assert relative_difference(final, reference) <= 1e-5
    assert status["counted"] == [[2 * MICROBATCHES] * 2] * (step - len(rolled)), status
    honest_ids = {next(e["peer_id"] for e in w.events() if e["event"] == "joined") for w in honest}
    assert not {b["worker"] for b in status["trust"]["bans"]} & honest_ids, status["trust"]  # no false ban
    return status, liar, honest


def first_lie(liar) -> int:
    """The batch of the liar's first corrupted result: the task it leased last before it."""
    batch = -1
    for e in liar.events():
        if e["event"] == "leased":
            batch = e["batch"]
        elif e["event"] == "corrupted":
            return batch
    raise AssertionError(f"the liar told no lie: {served(liar)}")


def served(liar) -> dict:
    """The tasks the liar leased, counted by batch and kind: why a liar that ended unbanned
    was not caught (the stale one is honest until it serves a first-stage task after batch 0)."""
    counts: dict = {}
    for e in liar.events():
        if e["event"] == "leased":
            counts[f"{e['batch']}:{e['kind']}"] = counts.get(f"{e['batch']}:{e['kind']}", 0) + 1
    return counts


@pytest.mark.parametrize(
    "corrupt, liar_stage, steps", [("scale", 0, STEPS), ("noise", 0, STEPS), ("flip", 1, STEPS), ("stale", 0, 6)]
)
def test_a_worker_sending_wrong_results_is_banned_and_its_batch_recomputed(
    serve_relay, launch_stage_worker, corrupt, liar_stage, steps
):
    """Every result checked: the liar is banned in the batch of its first lie, whichever that is
    (the scheduler's choice of its tasks). The stale liar runs 6 batches, not 3: it lies only in
    first-stage tasks after its first batch (in 1 CI run of about 10 the other stage-0 worker took
    every one of batches 1 and 2)."""
    status, liar, _ = checked_run(serve_relay, launch_stage_worker, corrupt, liar_stage, steps=steps)
    assert liar.wait(timeout_s=120) == 3, served(liar)  # it ends, told it is banned
    events = liar.events()
    liar_id = next(e["peer_id"] for e in events if e["event"] == "joined")
    assert [e for e in events if e["event"] == "banned"], liar.log_path.read_text()[-2000:]
    trust = status["trust"]
    banned_at_its_first_lie(trust, liar)
    assert trust["refereed"] >= 1, trust
    assert liar_id not in {w for s in status["stages"] for w in s["workers"]}, status["stages"]


def banned_at_its_first_lie(trust: dict, liar) -> None:
    """The liar's one ban came at its first lie: a checked result's (in that batch, which restarts),
    or -- the stale liar's, when its first stale batch held only stage-0 backwards for it, which
    send no boundary -- the audit of that batch's upload at its round."""
    liar_id = next(e["peer_id"] for e in liar.events() if e["event"] == "joined")
    (ban,) = trust["bans"]
    assert ban["worker"] == liar_id, trust
    if trust["gradient_lies"]:
        assert trust["gradient_lies"] == 1 and "gradient of micro-batches" in ban["reason"], trust
        return
    assert [e for e in liar.events() if e["event"] == "corrupted"], liar.log_path.read_text()[-2000:]
    assert ban["batch"] == first_lie(liar) and trust["batches_restarted"] == 1, (trust, served(liar))


@pytest.mark.parametrize("corrupt, liar_stage, steps", [("flip", 1, STEPS), ("stale", 0, 6)])
def test_at_a_low_base_share_a_new_liar_is_caught_by_its_probation(
    serve_relay, launch_stage_worker, corrupt, liar_stage, steps
):
    """``check_share = 0.02``: at that share the sign-flipper (every tenth gradient, the first
    included) would survive about 500 of its tasks, the stale worker (honest in its first batch,
    every result after it computed on that batch's parameters) about 50; probation checks the first
    result of each of a new worker's first two batches, so both are banned in their first batches
    all the same, in the batch of their first lie (the stale one's is the second batch it serves a
    first-stage task in: which batches those are is the scheduler's, so its run is long enough for
    two), and the run stays exact."""
    status, liar, _ = checked_run(serve_relay, launch_stage_worker, corrupt, liar_stage, share=0.02, steps=steps)
    assert liar.wait(timeout_s=120) == 3, served(liar)
    trust = status["trust"]
    banned_at_its_first_lie(trust, liar)
    # the checks were probation's (and the monitors' suspects', whose every result is checked), the
    # base share's not more: at 2% it would almost never have chosen the liar's few lies
    assert trust["check_share"] == 0.02 and trust["probation"] == 2 and trust["probation_checks"] >= 1, trust


@pytest.mark.parametrize("liar_stage", [0, 1])
def test_a_worker_lying_only_in_its_uploaded_stage_gradient_is_banned_at_its_first_round(
    serve_relay, launch_stage_worker, liar_stage
):
    """``upload``: every result honest (every check agrees), every stage gradient it uploads at a
    round sign-flipped. A new worker's first uploads are audited (probation): the relay's own copy
    of the stage computes the sum the upload must be from the boundaries it still holds, the
    upload is refused before it commits, the liar banned, its micro-batches' gradients recomputed
    by the other worker of its stage; then the batches counted with its unchecked results (stage
    0's backwards, its own first round) roll back and replay. The run equals one process to 1e-5,
    with the low base share of a real run (probation alone catches it)."""
    status, liar, _ = checked_run(serve_relay, launch_stage_worker, "upload", liar_stage, share=0.02)
    assert liar.wait(timeout_s=120) == 3, liar.log_path.read_text()[-2000:]  # ends, told it is banned
    events = liar.events()
    liar_id = next(e["peer_id"] for e in events if e["event"] == "joined")
    assert [e for e in events if e["event"] == "corrupted"], liar.log_path.read_text()[-2000:]
    trust = status["trust"]
    (ban,) = trust["bans"]
    assert ban["worker"] == liar_id and f"stage {liar_stage} gradient of micro-batches" in ban["reason"], trust
    assert trust["gradient_lies"] == 1 and trust["disagreed"] == 0, trust  # its results were right
    assert trust["gradient_audits_agreed"] >= 1, trust  # the honest workers' probation audits
    assert trust["max_audit_distance"] <= trust["tolerance"], trust


def test_a_patient_upload_liar_is_banned_by_the_audit_of_its_first_lie(serve_relay, launch_stage_worker):
    """``upload-late``: honest in its first two uploads (its probation's audits), then every upload
    sign-flipped. With every upload audited (``check_share = 1.0``) the first lie is refused and
    its worker banned; the run stays exact. (At a low share a lie may be counted unaudited: it is
    reported unchecked, and the ban that ends it rolls back the batches it was counted in.)"""
    status, liar, _ = checked_run(serve_relay, launch_stage_worker, "upload-late", 1, share=1.0, steps=6)
    events = liar.events()
    corrupted = [e for e in events if e["event"] == "corrupted"]
    assert corrupted, liar.log_path.read_text()[-2000:]  # six rounds: it uploads in more than two
    assert liar.wait(timeout_s=120) == 3, liar.log_path.read_text()[-2000:]
    trust = status["trust"]
    (ban,) = trust["bans"]
    assert ban["worker"] == next(e["peer_id"] for e in events if e["event"] == "joined"), trust
    assert trust["gradient_lies"] == 1 and len(corrupted) == 1, (trust, corrupted)  # its first lie was its last


def test_honest_workers_agree_on_every_checked_result(serve_relay, launch_stage_worker):
    status, _, _ = checked_run(serve_relay, launch_stage_worker)
    trust = status["trust"]
    assert trust["bans"] == [] and trust["disagreed"] == 0 and trust["batches_restarted"] == 0, trust
    # every result was checked; each check settled by another worker of its stage agreeing, or by the
    # relay's own copy (first-stage results always; a later stage's while it has only one worker, as
    # in the first batches while workers are still joining: which of the two is timing, not trust)
    assert trust["checks"] >= STEPS * MICROBATCHES * 2, trust
    assert trust["agreed"] + trust["refereed"] >= STEPS * MICROBATCHES, trust
    assert trust["max_agreeing_distance"] <= trust["tolerance"], trust
    # every upload audited (share 1.0) and every one agreeing with the relay's own sum
    assert trust["gradient_lies"] == 0 and trust["gradient_audits_agreed"] >= STEPS * 2, trust
    assert trust["max_audit_distance"] <= trust["tolerance"], trust


def test_on_a_signed_run_a_banned_liar_cannot_come_back_under_its_name(tmp_path, launch_stage_worker, monkeypatch):
    """``auth.mode = "hf"``: the liar's Hugging Face user is banned (the store's ban list), so it
    can neither keep working under a new peer id nor log in again; on an open run only the peer id
    it was given is refused (a rejoin is a new worker: on probation, its first result checked)."""
    hub = standin()
    relay = None
    try:
        relay = hf_relay(
            tmp_path,
            hub,
            {
                **pipeline_overrides(BYTE_SPEC, stages=2, microbatches=MICROBATCHES, check_share=1.0),
                "rounds": {"heartbeat_interval_s": 0.3, "peer_ttl_s": 600.0},
                "limits": {},
            },
        )
        for user in ("alice", "bob", "eve"):
            monkeypatch.setenv(f"HF_TOKEN_{user.upper()}", TOKENS[user])
        login = ("--hf-token-env",)
        liar = launch_stage_worker(
            relay.url, "liar", seed=100, until_step=STEPS, extra=(*login, "HF_TOKEN_EVE", "--corrupt", "scale")
        )
        wait_until(lambda: placed(relay) >= 1, 120, "the liar placed on stage 0")
        honest = [
            launch_stage_worker(relay.url, f"w{i}", seed=i, until_step=2, extra=(*login, f"HF_TOKEN_{user}"))
            for i, user in enumerate(("ALICE", "BOB", "ALICE"))
        ]
        for worker in honest:
            assert worker.wait(timeout_s=300) == 0, worker.log_path.read_text()[-3000:]
        assert liar.wait(timeout_s=60) != 0  # ended: refused, whether as a banned worker or a banned user
        (ban,) = pipeline(relay)["trust"]["bans"]
        liar_id = next(e["peer_id"] for e in liar.events() if e["event"] == "joined")
        assert ban["worker"] == liar_id, ban
        comeback = RelayClient(relay.url)
        with pytest.raises(RelayRejected) as refused:
            comeback.login(TOKENS["eve"])  # the same user, a new peer key: refused at the door
        assert refused.value.code == "user_banned", refused.value
        comeback.close()
    finally:
        if relay is not None:
            relay.stop()
        hub.stop()
