"""Audits of stage gradients (``relay_server.trust.gradient_audit``), the parts that need no
process: the relay's sum equals a worker's, which uploads are audited, what agrees through each
codec and what is a lie, and the reducer's commit point refusing an upload the audit refused. The
audits against real dishonest workers are ``tests/test_trust_pipeline.py``."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from relay_server.rounds.reducer import Reducer, UploadProgress
from relay_server.trust.compare import distance, tolerance
from relay_server.trust.gradient_audit import AuditDeps, GradientAudits, GradientLie
from tests.support.pipeline_models import BYTE_SPEC, referee_and_stages
from toolkit.pipeline import compute
from toolkit.wire import payloads
from toolkit.wire.compression import get_codec
from toolkit.wire.tensor_container import AsyncContainerReader, iter_encoded

WIDTH = BYTE_SPEC.kwargs["d_model"]
NONE = get_codec("none")
TOL = tolerance("", "none")


def entry(array: np.ndarray) -> bytes:
    return payloads.encode(payloads.encode_rows("v", array.astype(np.float32), NONE))


def test_the_relays_sum_of_a_stage_gradient_is_the_workers() -> None:
    """Stage 0 and the last stage, two micro-batches each: the referee's sum of parameter
    gradients from the stored boundaries equals what a worker holds after the two backwards."""
    referee, stages = referee_and_stages(version=5)
    last_inputs, first_inputs, sums = [], [], [None, None]
    for m in (3, 8):
        batch = torch.randint(0, 256, (2, BYTE_SPEC.kwargs["seq_len"] + 1), generator=torch.Generator().manual_seed(m))
        y = compute.forward(stages[0], stages[0].inputs(batch), m)
        last = compute.backward(stages[1], y, m, grad_output=None, batch=batch, samples=2)
        first = compute.backward(stages[0], stages[0].inputs(batch), m, grad_output=last.input)
        for k, grads in ((1, last.params), (0, first.params)):
            flat = torch.cat([g.reshape(-1) for g in grads])
            sums[k] = flat if sums[k] is None else sums[k] + flat
        data = payloads.encode({"batch": batch.numpy()})
        a0 = entry(y.reshape(-1, WIDTH).detach().numpy())
        g0 = entry(last.input.reshape(-1, WIDTH).numpy())
        last_inputs.append((m, {"a0": a0, "batch": data}))
        first_inputs.append((m, {"batch": data, "g0": g0}))
    assert distance(referee.stage_gradient(1, 5, last_inputs), sums[1].numpy()) < 1e-6
    assert distance(referee.stage_gradient(0, 5, first_inputs), sums[0].numpy()) < 1e-6
    assert referee.stage_gradient(0, 4, first_inputs) is None  # another version: no opinion


def audits(reference: np.ndarray | None, codec: str = "none", share: float = 1e-9, **deps) -> GradientAudits:
    referee = SimpleNamespace(stage_gradient=lambda stage, version, inputs: reference)
    base = dict(share=share, tolerance=TOL, codec=get_codec(codec), referee=referee, suspect=lambda w: False)
    return GradientAudits(AuditDeps(**{**base, **deps}))


def verdict(a: GradientAudits, values: np.ndarray, worker: str = "w", wait_s: float = 5.0) -> str:
    """What the audit of one upload of ``worker`` said: agreed, lie, unserved or not audited."""

    async def run() -> str:
        if not a.chosen("r1", f"{worker}.0", worker):
            return "not audited"
        if not a.begin("r1", f"{worker}.0", worker, 0, 5, 0, [(0, {})]):
            return "unserved"
        before = a.counters.unserved
        try:
            await a.verify(f"{worker}.0", values, wait_s)
        except GradientLie as lie:
            assert lie.worker == worker and "relay's own computation" in lie.reason
            return "lie"
        return "unserved" if a.counters.unserved > before else "agreed"

    return asyncio.run(run())


RNG = np.random.default_rng(4)
TRUTH = (RNG.standard_normal(50_000) * np.exp(RNG.standard_normal(50_000))).astype(np.float32)  # heavy tails
HONEST = TRUTH * (1 + 1e-6 * RNG.standard_normal(TRUTH.size)).astype(np.float32)  # another BLAS's rounding


@pytest.mark.parametrize("codec", ["none", "float16", "int8"])
def test_an_honest_upload_agrees_and_a_flipped_or_scaled_one_is_a_lie_through_every_auditable_codec(codec) -> None:
    """The upload went through the run's codec; so does the relay's sum before the comparison."""
    c = get_codec(codec)

    def sent(x: np.ndarray) -> np.ndarray:
        return c.decode(c.encode(x), n=x.size)

    assert verdict(audits(TRUTH, codec), sent(HONEST)) == "agreed"
    assert verdict(audits(TRUTH, codec), sent(-HONEST)) == "lie"
    assert verdict(audits(TRUTH, codec), sent(1.01 * HONEST)) == "lie"  # 1% off: past 3e-3


def test_which_uploads_are_audited() -> None:
    """A new worker's first two uploads, the monitors' suspects', then the share by the secret."""
    a = audits(TRUTH)
    assert [verdict(a, HONEST) for _ in range(3)] == ["agreed", "agreed", "not audited"]
    suspect = audits(TRUTH, suspect=lambda w: True, probation=0)
    assert verdict(suspect, HONEST) == "agreed"
    half = audits(TRUTH, share=0.5, probation=0)
    chosen = sum(half.chosen(f"round{i}", "w.0", "w") for i in range(2000))
    assert 900 < chosen < 1100
    assert audits(TRUTH, share=0.0).chosen("r1", "w.0", "w") is False  # checks off: no audits
    assert audits(TRUTH, referee=None).chosen("r1", "w.0", "w") is False


def test_an_audit_the_relay_cannot_compute_lets_the_upload_commit_unaudited() -> None:
    """Another version (the referee has no opinion), a codec that drops values, a referee too slow
    for the upload's deadline: unserved, never a lie."""
    assert verdict(audits(None), -HONEST) == "unserved"
    assert verdict(audits(TRUTH, "topk2-64"), -HONEST) == "unserved"  # at the ticket: nothing to compare through
    slow = SimpleNamespace(stage_gradient=lambda stage, version, inputs: time.sleep(0.5) or TRUTH)
    assert verdict(audits(TRUTH, referee=slow), -HONEST, wait_s=0.05) == "unserved"


def test_a_refused_audit_adds_nothing_and_a_passed_one_commits() -> None:
    """The reducer hands the whole decoded upload to ``verify`` before its commit point."""
    reducer = Reducer(np.zeros(TRUTH.size, dtype=np.float32), NONE)
    seen: list[np.ndarray] = []

    def send(grad: np.ndarray, lie: bool) -> UploadProgress:
        body = b"".join(iter_encoded([("payload", grad)], {"codec": "none"}))
        progress = UploadProgress()

        async def verify(values: np.ndarray) -> None:
            seen.append(values.copy())
            if lie:
                raise GradientLie("w", "test")

        async def run() -> None:
            reader = _feed(body)
            header = await reader.read_header()
            reducer.check(header)
            await reducer.reduce(reader, header, 1, lambda: True, progress, "w", verify=verify)

        try:
            asyncio.run(run())
        except GradientLie:
            pass
        return progress

    try:
        assert not send(-TRUTH, lie=True).committed
        np.testing.assert_array_equal(reducer.sum, 0.0)
        assert send(TRUTH, lie=False).committed
        asyncio.run(reducer.run(lambda: None))  # the add job ran
        np.testing.assert_array_equal(reducer.sum, TRUTH)
        np.testing.assert_array_equal(seen[0], -TRUTH)
        np.testing.assert_array_equal(seen[1], TRUTH)
    finally:
        reducer.close()


def _feed(body: bytes) -> AsyncContainerReader:
    stream = asyncio.StreamReader()
    stream.feed_data(body)
    stream.feed_eof()
    return AsyncContainerReader(stream, len(body), total_bytes=len(body))
