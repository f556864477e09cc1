"""The ``lowrank-<r>`` boundary codec (:mod:`toolkit.wire.compression.lowrank`): what it keeps, what
it costs, that it is deterministic, that the relay's result check refuses every malformed payload
in one line, and that only pipeline boundaries may use it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from relay_server.core.errors import ApiError
from relay_server.pipeline.ledger import BACKWARD, FORWARD, Step
from relay_server.pipeline.pipeline_config import PipelineSection
from relay_server.pipeline.results import Shapes, read_result
from relay_server.pipeline.star_model import boundary_bytes_per_sample
from toolkit.errors import ProtocolError
from toolkit.pipeline.boundary_codec import at_cut
from toolkit.wire import payloads
from toolkit.wire.compression import LowRankCodec, boundary_codec, get_codec
from toolkit.wire.compression.lowrank import SIGMA_MAX
from toolkit.wire.protocol import PipelineResult

ROWS, WIDTH = 96, 40


def matrix(rank: int, seed: int = 0, rows: int = ROWS, width: int = WIDTH, scale: float = 1.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    spectrum = 2.0 ** -np.arange(rank)
    x = (rng.standard_normal((rows, rank)) * spectrum) @ rng.standard_normal((rank, width))
    return (scale * x).astype(np.float32)


def relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_a_matrix_of_the_kept_rank_comes_back_to_int8_precision():
    codec = boundary_codec("lowrank-8")
    x = matrix(8)
    assert relative(codec.round_trip(x), x) < 1.5e-2


def test_a_full_rank_matrix_loses_about_what_the_best_rank_r_approximation_loses():
    """The randomized range finder is near the truncated SVD (Eckart-Young's optimum)."""
    codec = boundary_codec("lowrank-8")
    x = np.random.default_rng(1).standard_normal((ROWS, WIDTH)).astype(np.float32)
    x[:, :4] *= 10  # a few dominant features, as a residual stream has
    s = np.linalg.svd(x.astype(np.float64), compute_uv=False)
    optimum = float(np.sqrt((s[8:] ** 2).sum() / (s**2).sum()))
    error = relative(codec.round_trip(x), x)
    assert optimum <= error <= 1.15 * optimum, (error, optimum)  # int8 factors included


@pytest.mark.parametrize("scale", [1e-8, 1.0, 1e4])
def test_the_scale_travels_in_float32_so_tiny_gradients_keep_their_precision(scale):
    """Columns quantized against their own peak, scales in float32: a gradient of 1e-8 (below
    float16's normal range) round-trips as precisely as one of 1."""
    codec = boundary_codec("lowrank-8")
    x = matrix(8, scale=scale)
    assert relative(codec.round_trip(x), x) < 1.5e-2


def test_encoding_is_deterministic_and_the_bytes_are_as_documented():
    codec = boundary_codec("lowrank-32")
    x = np.random.default_rng(2).standard_normal((1024, 512)).astype(np.float32)
    first, second = payloads.encode_rows("y", x, codec), payloads.encode_rows("y", x.copy(), codec)
    assert first.keys() == second.keys() == {"y.s", "y.p", "y.q"}
    assert all(np.array_equal(first[k], second[k]) for k in first)
    assert payloads.row_names("y", codec) == set(first)
    nbytes = sum(a.nbytes for a in first.values())
    assert nbytes == codec.matrix_bytes(1024, 512) == 32 * (1024 + 512) + 4 * 32
    assert 2 * x.size / nbytes > 21  # float16 over lowrank-32 at this shape
    assert codec.wire_bytes(x.size) >= nbytes  # the body limit's bound holds


def test_a_matrix_smaller_than_the_rank_travels_at_its_own_rank():
    codec = boundary_codec("lowrank-64")
    x = matrix(6, rows=6, width=WIDTH)
    tensors = payloads.encode_rows("y", x, codec)
    assert tensors["y.p"].shape == (6, 6) and tensors["y.q"].shape == (WIDTH, 6)
    assert relative(payloads.read_rows(tensors, "y", 6, WIDTH, codec), x) < 1.5e-2


def test_the_one_process_cut_compresses_forward_and_backward():
    """``at_cut``: forward is the round trip of the activation, backward the round trip of the
    gradient (what the next stage's worker sends back), not the identity."""
    codec = boundary_codec("lowrank-2")
    h = torch.from_numpy(np.random.default_rng(3).standard_normal((2, 12, 8)).astype(np.float32)).requires_grad_()
    out = at_cut(h, codec)
    g = torch.from_numpy(np.random.default_rng(4).standard_normal((2, 12, 8)).astype(np.float32))
    out.backward(g)
    expected_out = codec.round_trip(h.detach().reshape(-1, 8).numpy()).reshape(2, 12, 8)
    expected_grad = codec.round_trip(g.reshape(-1, 8).numpy()).reshape(2, 12, 8)
    assert np.array_equal(out.detach().numpy(), expected_out)
    assert np.array_equal(h.grad.numpy(), expected_grad)
    assert relative(h.grad.numpy(), g.numpy()) > 0.1  # rank 2 of 8: the gradient really was compressed


def hostile(change) -> dict[str, np.ndarray]:
    tensors = payloads.encode_rows("y", matrix(8), boundary_codec("lowrank-8"))
    change(tensors)
    return tensors


def _nan(t):
    t["y.s"][0] = np.nan


def _negative(t):
    t["y.s"][0] = -1.0


def _huge(t):
    t["y.s"][0] = SIGMA_MAX * 10


@pytest.mark.parametrize(
    "change,code,words",
    [
        (lambda t: t.pop("y.q"), "bad_tensor", "expects tensors"),
        (lambda t: t.update({"y.extra": np.zeros(1, np.float32)}), "bad_tensor", "expects tensors"),
        (lambda t: t.update({"y.p": t["y.p"].astype(np.float16)}), "bad_tensor", "'p' must be int8"),
        (lambda t: t.update({"y.s": t["y.s"].astype(np.float16)}), "bad_tensor", "'s' must be float32"),
        (lambda t: t.update({"y.p": t["y.p"][:-1]}), "bad_tensor", f"must have {ROWS} rows"),
        (lambda t: t.update({"y.q": t["y.q"][:-1]}), "bad_tensor", "'q' must be int8 of shape"),
        (lambda t: t.update({"y.p": t["y.p"][:, :-1]}), "bad_tensor", "'p' must be int8 of shape"),
        (lambda t: t.update({"y.p": t["y.p"].reshape(-1)}), "bad_tensor", "2-D int8"),
        (_nan, "bad_tensor", "NaN or Inf"),
        (_negative, "bad_tensor", "singular values"),
        (_huge, "bad_tensor", "singular values"),
    ],
)
def test_every_malformed_payload_is_refused_in_one_line(change, code, words):
    codec = boundary_codec("lowrank-8")
    with pytest.raises(ProtocolError) as refused:
        payloads.read_rows(hostile(change), "y", ROWS, WIDTH, codec)
    assert refused.value.code == code and words in str(refused.value), str(refused.value)
    assert "\n" not in str(refused.value)


def test_the_largest_accepted_payload_still_decodes_finite():
    """Every int8 byte is a valid entry and ``s`` is capped: the worst a hostile worker can send
    decodes to finite float32 (128 x 128 x r x SIGMA_MAX < float32's max for every rank)."""
    codec = boundary_codec("lowrank-1024")
    r = min(ROWS, WIDTH)
    parts = {
        "s": np.full(r, SIGMA_MAX, np.float32) * np.float32(0.999),
        "p": np.full((ROWS, r), -128, np.int8),
        "q": np.full((WIDTH, r), -128, np.int8),
    }
    assert np.isfinite(codec.read_matrix(parts, ROWS, WIDTH)).all()
    assert 128 * 128 * 1024 * SIGMA_MAX < np.finfo(np.float32).max


def test_the_relay_refuses_a_malformed_boundary_before_anything_downstream_sees_it():
    """``read_result`` (what the relay runs on every result body): a well-formed lowrank forward
    result is kept as the worker sent it; a NaN factor or a wrong row count is a 422 naming it."""
    codec = boundary_codec("lowrank-8")
    shapes = Shapes(width=WIDTH, microbatch_size=2, max_positions=ROWS, vocab=256)
    meta = {"result": PipelineResult(task_id="t1", loss_sum=0.0).dumps().decode()}
    good = payloads.encode_rows("y", matrix(8), codec)
    accepted = read_result(payloads.encode(good, meta), Step(FORWARD, 0, 3), ROWS, shapes, codec)
    _, kept = payloads.decode(accepted.entries["a0"], len(accepted.entries["a0"]))
    assert set(kept) == {"v.s", "v.p", "v.q"} and all(np.array_equal(kept["v" + k[1:]], good[k]) for k in good)
    for change, words in [(_nan, "NaN or Inf"), (lambda t: t.update({"y.p": t["y.p"][:-1]}), "rows")]:
        with pytest.raises(ApiError) as refused:
            read_result(payloads.encode(hostile(change), meta), Step(FORWARD, 0, 3), ROWS, shapes, codec)
        assert refused.value.status == 422 and words in str(refused.value.message), refused.value.message
    gradient = payloads.encode_rows("g", matrix(8), codec)
    with pytest.raises(ApiError):  # a gradient is refused in a forward result: only its own tensors
        read_result(payloads.encode({**good, **gradient}, meta), Step(FORWARD, 0, 3), ROWS, shapes, codec)
    assert "g0" in read_result(payloads.encode(gradient, meta), Step(BACKWARD, 1, 3), ROWS, shapes, codec).entries


def test_lowrank_is_for_boundaries_only_and_its_names_are_checked():
    with pytest.raises(ValueError, match="unknown compression codec"):
        get_codec("lowrank-8")  # run.compression / [moe] codec: a flat vector has no rows to factor
    with pytest.raises(ValueError, match="boundary matrices only"):
        LowRankCodec(8).encode(np.zeros(16, np.float32))
    for name, words in [("lowrank-0", "1..1024"), ("lowrank-2000", "1..1024"), ("topk2-64", "not one of")]:
        with pytest.raises(ValueError, match=words):
            boundary_codec(name)
    assert boundary_codec("int8").name == "int8" and boundary_codec("lowrank-16").name == "lowrank-16"


@pytest.mark.parametrize(
    "section,words",
    [
        ({"boundary_codec": "lowrank-0"}, "pipeline.boundary_codec must be"),
        ({"boundary_codec": "lowrank-x"}, "pipeline.boundary_codec must be"),
        ({"boundary_codec": "lowrank-8", "check_share": 0.1}, "pipeline.check_share needs a boundary codec"),
    ],
)
def test_configuration_mistakes_name_the_field(section, words):
    found = [message for ok, message in PipelineSection(enabled=True, **section).checks(32, 0, False) if not ok]
    assert len(found) == 1 and words in found[0] and "\n" not in found[0], found
    assert not [
        m for ok, m in PipelineSection(enabled=True, boundary_codec="lowrank-8").checks(32, 0, False) if not ok
    ]


def test_the_planner_prices_a_lowrank_boundary_below_float16():
    fp16 = boundary_bytes_per_sample("float16", 512, 128)
    assert boundary_bytes_per_sample("lowrank-8", 512, 128) == 8 * (128 + 512) + 4 * 8 < fp16 / 12
