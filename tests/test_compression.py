"""Codecs (toolkit/wire/compression/): exactness bounds, streaming decode, validation of untrusted
tensors, error feedback and parameter deltas. Property tests run FAST examples each by default
and SLOW examples under ``-m slow``.

    pytest tests/test_compression.py            # ~10 s
    pytest tests/test_compression.py -m slow    # long fuzzing
"""

from __future__ import annotations

import asyncio
import io
import subprocess
import sys
from typing import Any, Callable

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from relay_server.rounds.reducer import CHUNK_ELEMS
from tests.support.properties import twin_property
from toolkit.errors import ProtocolError
from toolkit.wire.compression import (
    BLOCK,
    CODECS,
    INT8_INPUT_MAX,
    SCALE_MAX,
    Codec,
    DeltaEncoder,
    ErrorFeedback,
    TensorSpec,
    apply_delta,
    get_codec,
)
from toolkit.wire.tensor_container import AsyncContainerReader, encoded_size, iter_encoded, read_container

FAST, SLOW = 100, 2000
NAMES = sorted(CODECS)
# Largest magnitude each codec accepts (float16: the largest float32 that does not round to inf).
LIMITS = {
    "none": float(np.finfo(np.float32).max),
    "float16": float(np.float32(65519.996)),
    "int8": float(np.float32(INT8_INPUT_MAX * (1 - 2**-20))),
}
TINY = 2.0**-149  # float32's smallest subnormal


def _property(check: Callable[..., None], **strategies: Any) -> tuple[Callable, Callable]:
    return twin_property(check, FAST, SLOW, **strategies)


@st.composite
def wide_vectors(draw: st.DrawFn, limit: float = LIMITS["int8"], max_len: int = 3 * BLOCK + 40) -> np.ndarray:
    """float32 vectors with lengths around block boundaries and a wide, block-varying dynamic
    range: zero blocks, subnormals, per-element outliers, values near the codec's limit."""
    n = draw(
        st.one_of(
            st.integers(0, 3),
            st.integers(0, max_len),
            st.sampled_from([BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK, 2 * BLOCK + 7]),
        )
    )
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    top = int(np.floor(np.log2(limit)))
    lo = draw(st.integers(-160, top))
    hi = draw(st.integers(lo, top))
    blocks = -(-n // BLOCK)
    exps = rng.integers(lo, hi + 1, size=blocks).repeat(BLOCK)[:n]
    if draw(st.booleans()):  # outliers inside blocks: a second exponent per element
        exps = np.where(rng.random(n) < 0.05, rng.integers(lo, hi + 1, size=n), exps)
    x = np.ldexp(rng.standard_normal(n), exps)
    x[rng.random(n) < draw(st.sampled_from([0.0, 0.1, 0.9]))] = 0.0
    if blocks and draw(st.booleans()):
        x[BLOCK * rng.integers(blocks) :][:BLOCK] = 0.0  # an all-zero block
    if n and draw(st.booleans()):
        x[rng.integers(n)] = draw(st.sampled_from([limit, -limit, TINY, -TINY, 1e-40, 1.0]))
    return np.clip(x, -limit, limit).astype(np.float32)


def small_vectors(limit: float) -> st.SearchStrategy[np.ndarray]:
    """Hypothesis-native arrays, so failures shrink to the fewest, simplest values."""
    return hnp.arrays(
        np.float32, st.integers(0, BLOCK + 3), elements=st.floats(-limit, limit, width=32, allow_subnormal=True)
    )


def vectors_for(name: str) -> st.SearchStrategy[np.ndarray]:
    return st.one_of(wide_vectors(LIMITS[name]), small_vectors(LIMITS[name]))


codec_and_vector = st.sampled_from(NAMES).flatmap(lambda name: st.tuples(st.just(name), vectors_for(name)))


def bits(a: np.ndarray) -> np.ndarray:
    """Bit patterns, so comparisons see -0.0 vs 0.0 and never NaN != NaN."""
    return a.view(np.uint32 if a.dtype == np.float32 else np.uint16)


def int8_step(scales: np.ndarray, n: int) -> np.ndarray:
    """Each element's quantization step (its block's scale), float64 (n,)."""
    return scales.astype(np.float64).repeat(BLOCK)[:n]


# --- round trips ------------------------------------------------------------------------------
def _round_trip(case: tuple[str, np.ndarray]) -> None:
    name, x = case
    codec = get_codec(name)
    tensors = codec.encode(x)
    assert [TensorSpec(k, v.dtype, v.shape) for k, v in tensors] == codec.layout(x.size)
    assert sum(v.nbytes for _, v in tensors) == codec.wire_bytes(x.size)
    reused = codec.encode(x, out=codec.encode(x[::-1].copy()))  # buffers of an earlier step
    assert all(np.array_equal(a.view(np.uint8), b.view(np.uint8)) for (_, a), (_, b) in zip(reused, tensors))
    y = codec.decode(tensors)
    assert y.dtype == np.float32 and y.shape == x.shape
    assert np.isfinite(y).all()
    x64, err = x.astype(np.float64), np.abs(x.astype(np.float64) - y)
    if name == "none":
        assert np.array_equal(bits(y), bits(x))
    elif name == "float16":
        assert np.array_equal(y, x.astype(np.float16).astype(np.float32))  # IEEE round to nearest
        assert (err <= np.maximum(np.abs(x64) * 2.0**-11, 2.0**-25)).all()
    else:
        scales, q = tensors[0][1], tensors[1][1]
        assert q.min(initial=0) >= -127 and q.max(initial=0) <= 127
        step = int8_step(scales, x.size)
        assert (err <= step * (0.5 + 1e-4) + TINY).all(), "more than half a quantization step off"
        absmax = np.abs(np.pad(x64, (0, -x.size % BLOCK))).reshape(-1, BLOCK).max(axis=1)
        assert (scales >= absmax / 127 * (1 - 2**-22)).all()  # no value outside [-127, 127] steps
        assert (scales <= absmax / 127 * (1 + 2**-18) + TINY).all()  # and the step is tight
        assert (y[step == 0] == 0).all()


test_round_trip, test_round_trip_slow = _property(_round_trip, case=codec_and_vector)


def _float16_exact(h: np.ndarray) -> None:
    x = h[np.isfinite(h)].astype(np.float32)
    assert np.array_equal(bits(get_codec("float16").decode(get_codec("float16").encode(x))), bits(x))


test_float16_exact_on_representable, test_float16_exact_on_representable_slow = _property(
    _float16_exact, h=hnp.arrays(np.uint16, st.integers(0, 600)).map(lambda a: a.view(np.float16))
)


def _decode_range_splits(case: tuple[str, np.ndarray], data: st.DataObject) -> None:
    """Decoding any aligned split piece by piece (as the relay does) gives decode's exact bits."""
    name, x = case
    codec = get_codec(name)
    tensors = dict(codec.encode(x))
    whole = codec.decode(tensors)
    payload = tensors.pop("payload")
    starts = range(0, x.size, codec.alignment)
    cuts = sorted(data.draw(st.sets(st.sampled_from(starts), max_size=6)) if x.size else set())
    edges = [0, *[c for c in cuts if c], x.size]
    pieces = [codec.decode_range(tensors, payload[a:b], a) for a, b in zip(edges, edges[1:])]
    assert np.array_equal(bits(np.concatenate([np.zeros(0, np.float32), *pieces])), bits(whole))


test_decode_range_splits, test_decode_range_splits_slow = _property(
    _decode_range_splits, case=codec_and_vector, data=st.data()
)


def test_int8_gaussian_ratio_and_cosine() -> None:
    n = 1 << 20
    x = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    codec = get_codec("int8")
    tensors = codec.encode(x)
    assert codec.wire_bytes(n) / (4 * n) <= 0.26
    assert encoded_size(tensors, {"codec": "int8"}) / (4 * n) <= 0.26  # container header included
    y = codec.decode(tensors).astype(np.float64)
    cosine = float(np.dot(x, y) / np.linalg.norm(x.astype(np.float64)) / np.linalg.norm(y))
    assert cosine >= 0.999
    assert get_codec("float16").wire_bytes(n) == 2 * n and get_codec("none").wire_bytes(n) == 4 * n


def test_small_vectors_and_edge_values() -> None:
    int8 = get_codec("int8")
    for n in (0, 1, BLOCK - 1, BLOCK, BLOCK + 1):
        x = np.arange(n, dtype=np.float32) - n / 2
        assert np.allclose(int8.decode(int8.encode(x)), x, atol=n / 254 + 1e-6)
    x = np.array([0.0, -0.0, TINY, -3 * TINY, 1e-40, 3.3e38, -3.3e38], dtype=np.float32)
    for value in x:  # each alone in its block: exact or within half a step
        y = int8.decode(int8.encode(np.full(3, value, np.float32)))
        assert np.isfinite(y).all() and abs(float(y[0]) - float(value)) <= abs(float(value)) / 254 + TINY
    assert (int8.decode(int8.encode(np.zeros(1000, np.float32))) == 0).all()


# --- bad input to encode ----------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", [0, 300, 70_000])
def test_encode_rejects_non_finite(name: str, bad: float, where: int) -> None:
    x = np.ones(70_001, dtype=np.float32)
    x[where] = bad
    with pytest.raises(ValueError, match=f"index {where} is not finite"):
        get_codec(name).encode(x)


def test_encode_rejects_out_of_range_and_wrong_arrays() -> None:
    with pytest.raises(ValueError, match="float16 overflows"):
        get_codec("float16").encode(np.array([1.0, 65520.0], np.float32))
    assert get_codec("float16").decode(get_codec("float16").encode(np.float32([65519.99])))[0] == 65504
    for huge in (np.finfo(np.float32).max, -3.39e38):
        with pytest.raises(ValueError, match="index 1 is out of range"):
            get_codec("int8").encode(np.array([1.0, huge], np.float32))
    for name in NAMES:
        for wrong in (np.zeros(4), np.zeros((2, 2), np.float32), [1.0, 2.0]):
            with pytest.raises(ValueError, match="1-D float32"):
                get_codec(name).encode(wrong)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="out must be writable tensors laid out as"):
        get_codec("int8").encode(np.ones(300, np.float32), out=get_codec("int8").encode(np.ones(200, np.float32)))
    with pytest.raises(ValueError, match="unknown compression codec 'zstd'"):
        get_codec("zstd")


# --- validation of received tensors -----------------------------------------------------------
def _int8_side(n: int = 1000, **override: Any) -> dict[str, Any]:
    side: dict[str, Any] = {"scales": np.full(-(-n // BLOCK), 0.01, np.float32)}
    side.update(override)
    return {k: v for k, v in side.items() if v is not None}


@pytest.mark.parametrize(
    "side, payload_dtype, message",
    [
        (_int8_side(scales=np.full(4, 0.01)), "i1", "must be float32 of shape"),
        (_int8_side(scales=np.full(4, 0.01, np.float16)), "i1", "must be float32 of shape"),
        (_int8_side(scales=np.full(4, 1, np.int32)), "i1", "must be float32 of shape"),
        (_int8_side(scales=np.full(3, 0.01, np.float32)), "i1", "must be float32 of shape"),
        (_int8_side(scales=np.full(5, 0.01, np.float32)), "i1", "must be float32 of shape"),
        (_int8_side(scales=np.full((4, 1), 0.01, np.float32)), "i1", "must be float32 of shape"),
        (_int8_side(scales=np.float32([0.01, np.nan, 0.01, 0.01])), "i1", "first: block 1"),
        (_int8_side(scales=np.float32([0.01, 0.01, np.inf, 0.01])), "i1", "first: block 2"),
        (_int8_side(scales=np.float32([0.01, 0.01, 0.01, -1e-30])), "i1", "first: block 3"),
        (_int8_side(scales=np.float32([SCALE_MAX * 2, 0, 0, 0])), "i1", "first: block 0"),
        (_int8_side(scales=None), "i1", "expects side tensors"),
        (_int8_side(extra=np.zeros(1, np.float32)), "i1", "expects side tensors"),
        (_int8_side(), "<f4", "payload must be int8"),
    ],
)
def test_int8_validate_rejects(side: dict[str, Any], payload_dtype: str, message: str) -> None:
    with pytest.raises(ProtocolError, match=message) as info:
        get_codec("int8").validate(side, np.dtype(payload_dtype), 1000)
    assert isinstance(info.value, ValueError) and info.value.code == "bad_tensor"


@pytest.mark.parametrize(
    "name, side, payload_dtype",
    [
        ("float16", {}, "<f4"),
        ("float16", {"scales": np.zeros(4, np.float32)}, "<f2"),
        ("none", {}, "<f2"),
        ("none", {"scales": np.zeros(4, np.float32)}, "<f4"),
    ],
)
def test_validate_rejects_other_codecs(name: str, side: dict, payload_dtype: str) -> None:
    with pytest.raises(ProtocolError):
        get_codec(name).validate(side, np.dtype(payload_dtype), 1000)


def test_check_layout_rejects_bad_headers() -> None:
    codec, n = get_codec("int8"), 1000
    good = codec.layout(n)
    codec.check_layout(good, n)
    scales, payload = good
    for bad in (
        [payload, scales],
        [payload],
        [scales, payload._replace(shape=(n + 1,))],
        [scales, payload._replace(name="grad")],
        [scales, payload, scales._replace(name="x")],
        [scales._replace(shape=(10**9,)), payload],
        [scales, payload._replace(dtype=np.dtype("u1"))],
    ):
        with pytest.raises(ProtocolError, match="codec 'int8' expects tensors"):
            codec.check_layout(bad, n)
    with pytest.raises(ProtocolError):
        get_codec("none").check_layout(get_codec("float16").layout(n), n)


def _validated_scales_decode_finite(scales: np.ndarray, seed: int) -> None:
    """Whatever a hostile peer puts in the payload (-128 included), scales that pass validate
    decode to finite values: the relay's sum cannot be poisoned through the int8 path."""
    codec, n = get_codec("int8"), scales.size * BLOCK
    codec.validate({"scales": scales}, np.dtype("i1"), n)
    payload = np.random.default_rng(seed).integers(-128, 128, n).astype(np.int8)
    payload[::BLOCK] = -128
    assert np.isfinite(codec.decode([("scales", scales), ("payload", payload)])).all()


test_validated_scales_decode_finite, test_validated_scales_decode_finite_slow = _property(
    _validated_scales_decode_finite,
    seed=st.integers(0, 2**32 - 1),
    scales=hnp.arrays(
        np.float32, st.integers(1, 8), elements=st.floats(0, float(SCALE_MAX), width=32) | st.just(float(SCALE_MAX))
    ),
)


def _bad_scales_rejected(scales: np.ndarray, bad: float, where: int) -> None:
    scales = scales.copy()
    scales[where % scales.size] = bad
    with pytest.raises(ProtocolError):
        get_codec("int8").validate({"scales": scales}, np.dtype("i1"), scales.size * BLOCK)


test_bad_scales_rejected, test_bad_scales_rejected_slow = _property(
    _bad_scales_rejected,
    where=st.integers(0, 100),
    scales=hnp.arrays(np.float32, st.integers(1, 20), elements=st.floats(0, 1e6, width=32)),
    bad=st.sampled_from([np.nan, np.inf, -np.inf, -1.0, -TINY, float(np.finfo(np.float32).max)]),
)


def test_decode_range_rejects_bad_calls() -> None:
    codec = get_codec("int8")
    side = dict(codec.encode(np.ones(1000, np.float32))[:1])
    with pytest.raises(ValueError, match="alignment 256"):
        codec.decode_range(side, np.zeros(10, np.int8), 100)
    with pytest.raises(ProtocolError, match="beyond the 4 blocks"):
        codec.decode_range(side, np.zeros(300, np.int8), 768)
    with pytest.raises(ProtocolError, match="1-D int8"):
        codec.decode_range(side, np.zeros(10, np.float32), 0)
    with pytest.raises(ValueError, match="out must be float32"):
        codec.decode_range(side, np.zeros(10, np.int8), 0, out=np.zeros(11, np.float32))


# --- the relay's streaming path, end to end through the container ------------------------------
def test_streaming_reduction_through_container() -> None:
    """Two peers' int8 gradients summed chunk by chunk as the relay would: header checked, side
    tensors validated, each CHUNK_ELEMS payload chunk decoded as soon as it is read."""
    assert CHUNK_ELEMS % BLOCK == 0, "relay chunks must start on int8 block boundaries"
    codec, n = get_codec("int8"), 2 * CHUNK_ELEMS + 1000
    rng = np.random.default_rng(2)
    grads = [rng.standard_normal(n).astype(np.float32) for _ in range(2)]
    total = np.zeros(n, np.float32)
    scratch = np.empty(CHUNK_ELEMS, np.float32)

    async def receive(body: bytes) -> None:
        stream = asyncio.StreamReader()
        stream.feed_data(body)
        stream.feed_eof()
        reader = AsyncContainerReader(stream, max_data_bytes=4 * n)
        header = await reader.read_header()
        codec.check_layout(header.entries, n)
        side = {e.name: await reader.read_tensor(e) for e in header.entries[:-1]}
        codec.validate(side, header.entries[-1].dtype, n)
        async for start, piece in reader.iter_chunks(header.entries[-1], CHUNK_ELEMS):
            decoded = codec.decode_range(side, piece, start, out=scratch[: piece.size])
            np.add(total[start : start + piece.size], decoded, out=total[start : start + piece.size])

    for g in grads:
        asyncio.run(receive(b"".join(iter_encoded(codec.encode(g), {"codec": codec.name}))))
    expected = sum(codec.decode(codec.encode(g)) for g in grads)
    assert np.array_equal(total, expected)


def test_peer_download_through_container() -> None:
    codec, n = get_codec("int8"), 5000
    tensors = codec.encode(np.linspace(-1, 1, n, dtype=np.float32))
    header, received = read_container(io.BytesIO(b"".join(iter_encoded(tensors))), max_data_bytes=4 * n)
    codec.check_layout(header.entries, n)
    assert np.array_equal(codec.decode(received), codec.decode(tensors))


# --- error feedback ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_error_feedback_bounds_accumulated_error(name: str) -> None:
    """After T steps the relay holds sum(x_t) - residual_T: the stream's error stays within half
    a step (one last quantization), while without feedback it grows with T."""
    n, steps = 3000, 60
    rng = np.random.default_rng(3)
    codec = get_codec(name)
    feedback = ErrorFeedback(codec, n)
    sent = np.zeros(n)
    naive = np.zeros(n)
    truth = np.zeros(n)
    for t in range(steps):
        x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 1)).astype(np.float32)
        x[:BLOCK] = 0.003  # small values in a block with one big one: rounded to 0 every step,
        x[0] = 20.0  # so only the carried residual ever sends them
        target = x + feedback.residual  # what this step's encode sees
        tensors = feedback.compress(x)
        sent += codec.decode(tensors)
        naive += codec.decode(codec.encode(x))
        truth += x
    last = dict(tensors)
    bound = {
        "none": np.zeros(n),
        "float16": np.abs(target) * 2.0**-11 + 2.0**-25,
        "int8": int8_step(last.get("scales", np.zeros(0)), n) * (0.5 + 1e-4),
    }[name]
    assert (np.abs(feedback.residual) <= bound).all()
    rounding = steps * 2.0**-23 * 30  # float32 rounding of |x + residual| <= ~30, once per step
    assert np.allclose(truth - sent, feedback.residual, rtol=0, atol=rounding)
    assert (np.abs(truth - sent) <= bound + rounding).all()
    if name == "int8":
        assert np.abs(truth - naive).max() > 5 * np.abs(truth - sent).max()
        assert (naive[1:BLOCK] == 0).all() and np.abs(sent[1:BLOCK] - truth[1:BLOCK]).max() <= 0.1


def test_error_feedback_slices_and_failures() -> None:
    codec, n = get_codec("int8"), 1000
    whole, sliced = ErrorFeedback(codec, n), ErrorFeedback(codec, n)
    x = np.random.default_rng(4).standard_normal(n).astype(np.float32)
    whole.compress(x[:300])  # two aggregators' slices: [0, 300) and [300, 1000)
    whole.compress(x[300:], start=300)
    sliced.compress(x[:300], start=0)
    sliced.compress(x[300:], start=300)
    assert np.array_equal(whole.residual, sliced.residual) and np.abs(whole.residual).max() > 0
    bad = x.copy()
    bad[500] = np.nan
    with pytest.raises(ValueError, match="not finite"):
        whole.compress(bad[300:], start=300)
    assert (whole.residual[300:] == 0).all() and (whole.residual[:300] == sliced.residual[:300]).all()
    with pytest.raises(ValueError, match="within the 1000 values"):
        whole.compress(x, start=1)
    before = sliced.residual.copy()  # an upload that never arrived is taken back
    lost = sliced.compress(x[300:], start=300)
    sliced.undo(lost, x[300:], start=300)
    assert np.allclose(sliced.residual, before, rtol=0, atol=1e-6)


# --- parameter deltas -------------------------------------------------------------------------
def _delta_bit_identity(name: str, n: int, seed: int) -> None:
    """Peers applying every delta (whole or streamed in pieces) stay bit-identical to the relay's
    ``public``, and ``public`` stays within one quantization step of the master."""
    codec = get_codec(name)
    rng = np.random.default_rng(seed)
    master = rng.standard_normal(n).astype(np.float32)
    relay = DeltaEncoder(codec, master)
    whole_peer, streaming_peer = master.copy(), master.copy()
    late_peer: np.ndarray | None = None
    for step in range(24):
        update = rng.standard_normal(n) * 10.0 ** rng.uniform(-6, -1)
        update[: n // 3] = 0.0  # frozen parameters
        master -= update.astype(np.float32)
        if step == 12:
            master[n // 2 :] = rng.standard_normal(n - n // 2)  # a rollback-sized jump
        if step == 6:
            late_peer = relay.public.copy()  # a newcomer downloads the public copy once
        delta = master.astype(np.float64) - relay.public
        tensors = relay.encode_step(master)
        apply_delta(codec, whole_peer, tensors)
        if late_peer is not None:
            apply_delta(codec, late_peer, tensors)
        side = dict(tensors[:-1])
        payload = tensors[-1][1]
        cuts = sorted({0, n, *(int(c) // codec.alignment * codec.alignment for c in rng.integers(0, n, 3))})
        for a, b in zip(cuts, cuts[1:]):
            np.add(streaming_peer[a:b], codec.decode_range(side, payload[a:b], a), out=streaming_peer[a:b])
        for peer in (whole_peer, streaming_peer, late_peer):
            assert peer is None or np.array_equal(bits(peer), bits(relay.public))
        gap = np.abs(master.astype(np.float64) - relay.public)
        rounding = np.spacing(np.abs(master))  # of the float32 add ``public += decoded``
        if name == "int8":  # one quantization step of the latest delta's block
            assert (gap <= int8_step(side["scales"], n) + rounding).all()
        else:
            assert (gap <= np.abs(delta) * 2.0**-11 + 2.0**-25 + rounding).all()


test_delta_bit_identity, test_delta_bit_identity_slow = _property(
    _delta_bit_identity,
    name=st.sampled_from(NAMES),
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 3 * BLOCK) | st.sampled_from([1, BLOCK, 5003]),
)


def test_delta_encoder_rejects_shape_mismatch() -> None:
    relay = DeltaEncoder(get_codec("int8"), np.zeros(10, np.float32))
    with pytest.raises(ValueError, match="master must have shape"):
        relay.encode_step(np.zeros(11, np.float32))
    with pytest.raises(ProtocolError, match="10 values"):
        apply_delta(get_codec("int8"), np.zeros(10, np.float32), get_codec("int8").encode(np.zeros(9, np.float32)))


# --- packaging --------------------------------------------------------------------------------
@pytest.mark.integration
def test_codec_module_does_not_import_torch() -> None:
    code = "import sys, toolkit.wire.compression; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_every_codec_is_a_codec() -> None:
    for name in NAMES:
        codec = get_codec(name)
        assert isinstance(codec, Codec) and codec.name == name and CHUNK_ELEMS % codec.alignment == 0
        assert codec.layout(7)[-1].name == "payload"
