"""CenteredClip: resists a x1000 attacker where the mean does not, is the mean when nobody is
clipped, is deterministic whatever the arrival order, and never moves further than L * tau."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from relay_server.rounds.robust import CenteredClipConfig, RobustAccumulator, capped_weights, centered_clip

D = 2048


def honest_and_attacker(seed: int = 0, n_honest: int = 8, scale: float = 1000.0):
    rng = np.random.default_rng(seed)
    mu = rng.normal(size=D).astype(np.float32)
    honest = [mu + rng.normal(size=D).astype(np.float32) for _ in range(n_honest)]
    attacker = scale * (mu + rng.normal(size=D).astype(np.float32))  # a gradient, x1000
    return mu, honest, attacker


def test_centered_clip_resists_x1000_attacker() -> None:
    mu, honest, attacker = honest_and_attacker()
    honest_mean = np.mean(honest, axis=0)
    rows, weights = honest + [attacker], [32.0] * 9
    plain = np.average(rows, axis=0, weights=weights)
    robust = centered_clip(rows, weights)
    noise = np.linalg.norm(honest_mean - mu)  # the honest mean's own error, ~ sqrt(D / 8)
    assert np.linalg.norm(plain - honest_mean) > 50 * noise
    assert np.linalg.norm(robust.center - honest_mean) < 0.5 * noise
    assert robust.clipped >= 1


def test_attacker_cannot_buy_weight_with_claimed_samples() -> None:
    mu, honest, attacker = honest_and_attacker(seed=1)
    honest_mean = np.mean(honest, axis=0)
    weights = [32.0] * 8 + [1e9]  # the attacker claims a billion samples
    capped = centered_clip(honest + [attacker], weights)
    uncapped = centered_clip(honest + [attacker], weights, config=CenteredClipConfig(max_weight_ratio=0))
    noise = np.linalg.norm(honest_mean - mu)
    assert np.linalg.norm(capped.center - honest_mean) < noise
    assert np.linalg.norm(uncapped.center - honest_mean) > 2 * noise  # why the cap exists


def test_equals_weighted_mean_when_honest_and_tau_large() -> None:
    _, honest, _ = honest_and_attacker(seed=2)
    weights = [10.0, 20, 30, 40, 10, 20, 30, 40]
    result = centered_clip(honest, weights, config=CenteredClipConfig(tau=1e12, iterations=1))
    np.testing.assert_allclose(result.center, np.average(honest, axis=0, weights=weights), rtol=1e-5, atol=1e-5)
    assert result.clipped == 0


def test_capped_weights_rejects_bad_weights() -> None:
    for bad in ([], [1.0, 0.0], [1.0, float("nan")], [-1.0]):
        with pytest.raises(ValueError):
            capped_weights(bad, 4.0)
    np.testing.assert_allclose(capped_weights([1, 1, 1, 100], 2.0), np.array([1, 1, 1, 2]) / 5)


def _accumulate(order: list[int], rows: list[np.ndarray], chunk: int, start=None) -> np.ndarray:
    acc = RobustAccumulator(num_params=D, chunk_elems=chunk, start=start)
    for i in order:
        for lo in range(0, D, chunk):
            acc.add_chunk(f"peer{i}", lo, rows[i][lo : lo + chunk] * 16, samples=16)  # sums, as uploaded
    grad = np.full(D, np.nan, dtype=np.float32)
    acc.finish_into(grad)
    return grad


def test_deterministic_whatever_the_arrival_order() -> None:
    _, honest, attacker = honest_and_attacker(seed=3)
    rows = honest + [attacker]
    first = _accumulate(list(range(9)), rows, chunk=500)
    again = _accumulate([8, 3, 1, 0, 7, 2, 6, 5, 4], rows, chunk=500)
    assert first.tobytes() == again.tobytes()
    per_chunk = np.concatenate(
        [centered_clip([r[lo : lo + 500] for r in rows], [16.0] * 9).center for lo in range(0, D, 500)]
    )
    np.testing.assert_array_equal(first, per_chunk)  # chunk-wise CenteredClip, last chunk short


def test_accumulator_chunks_only_count_their_senders() -> None:
    rows = [np.full(D, v, dtype=np.float32) for v in (1.0, 3.0)]
    acc = RobustAccumulator(num_params=D, chunk_elems=1024, config=CenteredClipConfig(tau=1e12))
    acc.add_chunk("a", 0, rows[0][:1024], samples=1)
    acc.add_chunk("b", 0, rows[1][:1024], samples=1)
    acc.add_chunk("a", 1024, rows[0][1024:], samples=1)  # b died before its second chunk
    grad = np.empty(D, dtype=np.float32)
    acc.finish_into(grad)
    np.testing.assert_allclose(grad[:1024], 2.0)
    np.testing.assert_allclose(grad[1024:], 1.0)
    empty = RobustAccumulator(num_params=10, chunk_elems=4)
    out = np.ones(10, dtype=np.float32)
    empty.finish_into(out)
    assert not out.any()
    with pytest.raises(ValueError):
        empty.add_chunk("a", 1, np.zeros(4, np.float32), samples=1)  # not on a chunk boundary


def test_robust_sgd_final_loss_close_to_clean_run() -> None:
    """Linear regression trained by 8 honest peers + 1 peer sending gradients x1000 every round:
    with CenteredClip the final loss stays within 5% of a clean run; with the mean it does not."""
    rng = np.random.default_rng(0)
    dim, lr, rounds = 64, 0.1, 60
    w_true = rng.normal(size=dim)
    data = [rng.normal(size=(64, dim)) for _ in range(9)]
    targets = [x @ w_true + 0.1 * rng.normal(size=64) for x in data]
    x_eval = rng.normal(size=(512, dim))
    y_eval = x_eval @ w_true

    def train(aggregate, attack: bool) -> float:
        w = np.zeros(dim)
        for _ in range(rounds):
            grads = [x.T @ (x @ w - y) / len(y) for x, y in zip(data, targets)]
            if attack:
                grads[8] = grads[8] * 1000
            w = w - lr * aggregate(grads)
        return float(np.mean((x_eval @ w - y_eval) ** 2))

    mean = lambda grads: np.mean(grads, axis=0)  # noqa: E731
    robust = lambda grads: centered_clip(grads, [64.0] * len(grads)).center.astype(np.float64)  # noqa: E731
    clean = train(mean, attack=False)
    assert train(robust, attack=True) <= 1.05 * clean + 1e-3
    assert not train(mean, attack=True) <= 1.05 * clean + 1e-3  # diverges (or inf/nan)


@settings(max_examples=100, deadline=None, database=None)
@given(
    st.integers(1, 6).flatmap(
        lambda n: st.tuples(
            st.lists(arrays(np.float32, 16, elements=st.floats(-1e6, 1e6, width=32)), min_size=n, max_size=n),
            st.lists(st.floats(0.5, 100), min_size=n, max_size=n),
            st.integers(1, 5),
        )
    )
)
def test_center_moves_at_most_iterations_times_tau(case) -> None:
    rows, weights, iterations = case
    result = centered_clip(rows, weights, config=CenteredClipConfig(iterations=iterations))
    start = np.median(np.stack(rows), axis=0)
    assert np.all(np.isfinite(result.center))
    moved = np.linalg.norm(result.center.astype(np.float64) - start)
    assert moved <= iterations * result.tau * (1 + 1e-5) + 1e-3
