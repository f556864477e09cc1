"""The sparse codec ``topk2-<K>`` (toolkit/wire/compression/sparse.py): what it keeps, streamed
decodes, error feedback, deltas, decoders that refuse hostile records, and a real relay running
``run.compression = "topk2-64"`` in sync mode (uploads refused whole, peers bit-identical).

    pytest tests/test_compression_topk2.py            # property tests run FAST examples
    pytest tests/test_compression_topk2.py -m slow    # and SLOW ones
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from hypothesis import strategies as st
from safetensors.numpy import load_file

from relay_server.core.config import ConfigError, load_config
from relay_server.rounds.reducer import CHUNK_ELEMS, Reducer, UploadProgress
from relay_server.rounds.robust import CenteredClipConfig
from tests.support.processes import merged, write_config
from tests.support.properties import twin_property
from toolkit.client import RelayClient
from toolkit.errors import ProtocolError, RelayRejected
from toolkit.wire import payloads
from toolkit.wire.compression import (
    CHUNK,
    TOPK2_INPUT_MAX,
    TOPK2_SCALE_MAX,
    DeltaEncoder,
    ErrorFeedback,
    TensorSpec,
    apply_delta,
    get_codec,
)
from toolkit.wire.protocol import PROTOCOL_VERSION, GradientMeta, Heartbeat, JoinRequest
from toolkit.wire.tensor_container import AsyncContainerReader, iter_encoded

FAST, SLOW = 40, 1000
KS = (4, 64, 2048)


def _property(check: Callable[..., None], **strategies: Any) -> tuple[Callable, Callable]:
    return twin_property(check, FAST, SLOW, **strategies)


@st.composite
def vectors(draw: st.DrawFn) -> np.ndarray:
    """Lengths around chunk boundaries and below K, chunk-varying magnitudes, zero chunks, ties."""
    n = draw(
        st.one_of(
            st.integers(1, 70),
            st.integers(1, 3 * CHUNK + 100),
            st.sampled_from([CHUNK - 1, CHUNK, CHUNK + 1, CHUNK + 3, 2 * CHUNK, 2 * CHUNK + 2047]),
        )
    )
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    exps = rng.integers(draw(st.integers(-140, 0)), draw(st.integers(1, 100)), size=-(-n // CHUNK)).repeat(CHUNK)[:n]
    x = np.ldexp(rng.standard_normal(n), exps)
    x[rng.random(n) < draw(st.sampled_from([0.0, 0.5, 0.99]))] = 0.0
    if draw(st.booleans()):
        x[CHUNK * rng.integers(-(-n // CHUNK)) :][:CHUNK] = 0.0  # an all-zero chunk
    if draw(st.booleans()):
        x[rng.integers(n)] = draw(st.sampled_from([TOPK2_INPUT_MAX, -TOPK2_INPUT_MAX, 1e-40, 3.0]))
    if draw(st.booleans()):
        x[:: draw(st.integers(1, 7))] = 1.0  # ties
    return np.clip(x, -TOPK2_INPUT_MAX, TOPK2_INPUT_MAX).astype(np.float32)


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint32)


def chunks_of(n: int) -> list[tuple[int, int]]:
    """(start, length) of every chunk of an n-vector."""
    return [(s, min(CHUNK, n - s)) for s in range(0, n, CHUNK)]


# --- what it keeps ----------------------------------------------------------------------------
def _round_trip(x: np.ndarray, k: int) -> None:
    codec = get_codec(f"topk2-{k}")
    n = x.size
    tensors = codec.encode(x)
    assert [TensorSpec(a, v.dtype, v.shape) for a, v in tensors] == codec.layout(n)
    assert sum(v.nbytes for _, v in tensors) == codec.wire_bytes(n)
    reused = codec.encode(x, out=codec.encode(x[::-1].copy()))  # buffers of an earlier step
    assert all(np.array_equal(a.view(np.uint8), b.view(np.uint8)) for (_, a), (_, b) in zip(reused, tensors))
    y = codec.decode(tensors, n=n)
    assert y.dtype == np.float32 and y.shape == (n,) and np.isfinite(y).all()
    scales, payload = dict(tensors)["scales"], dict(tensors)["payload"]
    offset = 0
    for c, (start, length) in enumerate(chunks_of(n)):
        kept = min(k, length)
        record = payload[offset : offset + 2 * kept + -(-kept // 4)]
        offset += record.size
        positions = record[: 2 * kept].view("<u2").astype(np.int64)
        assert (np.diff(positions) > 0).all() and positions[-1] < length  # canonical
        chunk, decoded = x[start : start + length].astype(np.float64), y[start : start + length]
        dropped = np.setdiff1d(np.arange(length), positions)
        assert (decoded[dropped] == 0).all()
        if dropped.size:  # the kept values are the largest |x|
            assert np.abs(chunk[positions]).min() >= np.abs(chunk[dropped]).max()
        s, kept_x = float(scales[c]), chunk[positions]
        assert 0 <= s <= TOPK2_SCALE_MAX and (s > 0) == (np.abs(chunk).max() > 0)
        err = np.abs(kept_x - decoded[positions])
        beyond = np.abs(kept_x) - 1.5 * s  # > 0: beyond the outer level, which it takes
        assert (err <= np.maximum(s * 0.5, beyond) * (1 + 1e-6) + 2.0**-149).all(), "more than half a step off"
        start_s = np.float32(np.abs(chunk).max() / np.float32(1.5))  # where the fit starts: never worse
        start_err = (
            kept_x - np.clip(np.rint(kept_x / start_s + 1.5), 0, 3) * start_s + 1.5 * start_s
            if start_s > 0
            else kept_x
        )
        rounding = 2.0**-40 * (kept_x**2).sum() + 2.0**-200  # of s to float32
        assert (err**2).sum() <= (start_err**2).sum() * (1 + 1e-4) + rounding
    assert offset == payload.size


test_round_trip_keeps_the_largest_within_half_a_step, test_round_trip_slow = _property(
    _round_trip, x=vectors(), k=st.sampled_from(KS)
)


def _streamed_pieces(x: np.ndarray, k: int, data: st.DataObject) -> None:
    """Decoding any chunk-aligned split piece by piece (as the relay does) gives decode's bits."""
    codec = get_codec(f"topk2-{k}")
    tensors = dict(codec.encode(x))
    whole = codec.decode(tensors, n=x.size)
    payload = tensors.pop("payload")
    cuts = sorted(data.draw(st.sets(st.sampled_from(range(0, x.size, CHUNK)), max_size=5)))
    edges = [0, *[c for c in cuts if c], x.size]
    pieces = []
    for lo, hi in zip(edges, edges[1:]):
        a, b = codec.payload_range(lo, hi - lo)
        pieces.append(codec.decode_range(tensors, payload[a:b], lo, count=hi - lo))
    assert np.array_equal(bits(np.concatenate(pieces)), bits(whole))


test_streamed_decode_equals_whole, test_streamed_decode_slow = _property(
    _streamed_pieces, x=vectors(), k=st.sampled_from(KS), data=st.data()
)


def test_bits_per_parameter_and_tail_records() -> None:
    codec = get_codec("topk2-64")
    n = 25_000_000
    assert abs(codec.wire_bytes(n) * 8 / n - (64 * 18 + 32) / 4096) < 1e-3  # 0.289
    assert codec.payload_size(CHUNK) == 64 * 9 // 4
    assert codec.payload_size(CHUNK + 10) == 144 + 2 * 10 + 3  # a 10-value tail keeps all 10
    assert codec.payload_size(CHUNK + 100) == 2 * 144  # a tail of >= K values: a whole record
    assert [codec.payload_size(n) for n in (0, 1, 4, 5)] == [0, 3, 9, 12]
    x = np.array([3.0, -1.0, 0.5], np.float32)  # n < K: every value is kept
    y = codec.decode(codec.encode(x), n=3)
    assert np.sign(y).tolist() == [1, -1, 1] and np.abs(y - x).max() < 0.5


def test_the_fitted_scale_cuts_the_squared_error_of_gaussian_chunks() -> None:
    """The kept values are a chunk's largest, bunched in magnitude: the least-squares scale
    (module docstring) codes them with about 2% relative squared error, where absmax / 1.5 gives 13%."""
    x = np.random.default_rng(2).standard_normal(500 * CHUNK).astype(np.float32)
    y = get_codec("topk2-64").decode(get_codec("topk2-64").encode(x), n=x.size)
    kept = y != 0
    relative = float(((x[kept] - y[kept]).astype(np.float64) ** 2).sum() / (x[kept].astype(np.float64) ** 2).sum())
    assert kept.sum() == 500 * 64 and relative < 0.03, relative


def test_codec_names() -> None:
    assert get_codec("topk2-64").name == "topk2-64" and get_codec("topk2-2048").k == 2048
    for bad in ("topk2-3", "topk2-0", "topk2-2052", "topk2-", "topk2-064x", "topk3-64", "TOPK2-64", "int4"):
        with pytest.raises(ValueError) as info:
            get_codec(bad)
        assert "\n" not in str(info.value) and ("topk2" in str(info.value)), str(info.value)
    assert "multiple of 4" in str(pytest.raises(ValueError, get_codec, "topk2-6").value)


def test_encode_refuses_non_finite_and_out_of_range() -> None:
    codec = get_codec("topk2-64")
    for bad, match in ((np.nan, "not finite"), (np.inf, "not finite"), (TOPK2_INPUT_MAX * 1.01, "out of range")):
        x = np.zeros(3 * CHUNK + 5, np.float32)
        x[2 * CHUNK + 7] = bad
        with pytest.raises(ValueError, match=match):
            codec.encode(x)


# --- error feedback and deltas ----------------------------------------------------------------
def test_error_feedback_sends_the_sum_minus_the_residual() -> None:
    """After T steps the relay has received sum(x_t) - residual_T (float32 rounding of one add per
    step aside): the dropped values are owed, not lost, and go out once they grow large enough."""
    codec, n, steps = get_codec("topk2-64"), 2 * CHUNK + 1000, 40
    rng = np.random.default_rng(3)
    feedback = ErrorFeedback(codec, n)
    sent, truth = np.zeros(n), np.zeros(n)
    for _ in range(steps):
        x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-2, 0)).astype(np.float32)
        tensors = feedback.compress(x)
        sent += codec.decode(tensors, n=n)
        truth += x
    rounding = steps * 2.0**-23 * np.abs(truth).max() * 4
    assert np.allclose(truth - sent, feedback.residual, rtol=0, atol=rounding)
    assert np.abs(truth - sent).max() < np.abs(truth).max()  # it did send most of the mass...
    assert np.count_nonzero(sent) > 0.3 * n  # ...spread over far more than K of each chunk

    before = feedback.residual.copy()  # an upload that never arrived is taken back
    x = rng.standard_normal(n).astype(np.float32)
    lost = feedback.compress(x)
    feedback.undo(lost, x)
    assert np.allclose(feedback.residual, before, rtol=0, atol=1e-6)


def test_deltas_keep_peers_bit_identical_and_public_converges() -> None:
    """Peers applying every topk2 delta (whole or streamed per chunk range) hold the relay's
    ``public`` bit for bit; a master that stops moving is reached within half a step per value."""
    codec, n = get_codec("topk2-64"), 3 * CHUNK + 77
    rng = np.random.default_rng(5)
    master = rng.standard_normal(n).astype(np.float32)
    relay = DeltaEncoder(codec, np.zeros(n, np.float32))
    whole_peer, streaming_peer = np.zeros(n, np.float32), np.zeros(n, np.float32)
    for step in range(200):
        if step < 20:
            master -= (rng.standard_normal(n) * 1e-2).astype(np.float32)
        tensors = relay.encode_step(master)
        apply_delta(codec, whole_peer, tensors)
        side, payload = dict(tensors[:-1]), tensors[-1][1]
        for lo in range(0, n, 2 * CHUNK):
            hi = min(n, lo + 2 * CHUNK)
            a, b = codec.payload_range(lo, hi - lo)
            piece = codec.decode_range(side, payload[a:b], lo, count=hi - lo)
            np.add(streaming_peer[lo:hi], piece, out=streaming_peer[lo:hi])
        assert np.array_equal(bits(whole_peer), bits(relay.public))
        assert np.array_equal(bits(streaming_peer), bits(relay.public))
    gap = np.abs(master.astype(np.float64) - relay.public)
    assert gap.max() < 1e-3 * np.abs(master).max(), gap.max()


# --- hostile records --------------------------------------------------------------------------
N = 2 * CHUNK + 100  # two whole chunks and a tail of 100 >= K values
CODEC = get_codec("topk2-64")
GOOD = CODEC.encode(np.random.default_rng(7).standard_normal(N).astype(np.float32))


def tampered(scales: Callable | None = None, payload: Callable | None = None) -> dict[str, np.ndarray]:
    t = {name: array.copy() for name, array in GOOD}
    if scales:
        t["scales"] = scales(t["scales"])
    if payload:
        t["payload"] = payload(t["payload"])
    return t


def set_at(offset: int, value: bytes) -> Callable:
    def change(p: np.ndarray) -> np.ndarray:
        p[offset : offset + len(value)] = np.frombuffer(value, np.uint8)
        return p

    return change


def scale(value: float, at: int = 1) -> Callable:
    def change(s: np.ndarray) -> np.ndarray:
        s[at] = value
        return s

    return change


R = 144  # record bytes of a whole chunk, K = 64
HOSTILE = {
    "position_out_of_range": (tampered(payload=set_at(2 * R + 2 * 63, (100).to_bytes(2, "little"))), "chunk 2"),
    "position_beyond_uint16_chunk": (tampered(payload=set_at(R + 2 * 63, (4096).to_bytes(2, "little"))), "chunk 1"),
    "duplicate_position": (tampered(payload=lambda p: set_at(R + 2, bytes(p[R : R + 2]))(p)), "chunk 1"),
    "unsorted_positions": (
        tampered(payload=lambda p: set_at(R, bytes(p[R + 2 : R + 4]) + bytes(p[R : R + 2]))(p)),
        "chunk 1",
    ),
    "nan_scale": (tampered(scales=scale(np.nan)), "chunk 1"),
    "inf_scale": (tampered(scales=scale(np.inf)), "chunk 1"),
    "negative_scale": (tampered(scales=scale(-1.0)), "chunk 1"),
    "huge_scale": (tampered(scales=scale(float(TOPK2_SCALE_MAX) * 2)), "chunk 1"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_records_are_refused_naming_the_chunk(name: str) -> None:
    tensors, where = HOSTILE[name]
    with pytest.raises(ProtocolError, match=where) as info:
        CODEC.decode(tensors, n=N)
    assert info.value.code == "bad_tensor"
    public = np.ones(N, np.float32)
    with pytest.raises(ProtocolError, match=where):
        apply_delta(CODEC, public, tensors)
    assert (public == 1).all()  # refused whole: nothing applied


def test_the_largest_valid_scales_decode_finite_and_sum_finite() -> None:
    """Whatever codes a payload holds, scales at the limit decode to at most 1.5 * 2^100, and 2^26
    such uploads still sum below float32's max (the reason for the limit)."""
    tensors = {name: array.copy() for name, array in GOOD}
    tensors["scales"][:] = TOPK2_SCALE_MAX
    tensors["payload"][2 * 64 : R] = 0xFF  # every code 3 (level 1.5) in chunk 0
    y = CODEC.decode(tensors, n=N)
    assert np.isfinite(y).all() and np.abs(y).max() == np.float32(1.5 * 2.0**100)
    assert np.isfinite(np.float32(1.5 * 2.0**100) * np.float32(2**26))


def test_padding_bits_and_wrong_sizes_and_dtypes_are_refused() -> None:
    codec, n = get_codec("topk2-4"), 6  # a 6-value vector keeps 4: one code byte, no padding
    good = dict(codec.encode(np.arange(1, 7, dtype=np.float32)))
    codec.decode(good, n=n)
    tail = get_codec("topk2-64")  # a 5-value vector: 5 codes in 2 bytes, 6 padding bits
    five = dict(tail.encode(np.arange(1, 6, dtype=np.float32)))
    five["payload"][-1] |= 0b0100
    with pytest.raises(ProtocolError, match="chunk 0"):
        tail.decode(five, n=5)
    cases = [
        ({**dict(GOOD), "payload": dict(GOOD)["payload"][:-1]}, "payload elements"),  # truncated
        ({**dict(GOOD), "payload": np.zeros(CODEC.payload_size(N), np.int8)}, "payload must be uint8"),
        ({**dict(GOOD), "scales": dict(GOOD)["scales"].astype(np.float64)}, "scales"),
        ({**dict(GOOD), "scales": dict(GOOD)["scales"][:-1]}, "scales"),
        ({"payload": dict(GOOD)["payload"]}, "side tensors"),
    ]
    for tensors, match in cases:
        with pytest.raises(ProtocolError, match=match):
            CODEC.decode(tensors, n=N)
    header = [
        TensorSpec("scales", np.dtype("<f4"), (3,)),
        TensorSpec("payload", np.dtype("u1"), (CODEC.payload_size(N) + 1,)),
    ]
    with pytest.raises(ProtocolError, match="expects tensors"):
        CODEC.check_layout(header, N)


def reduce_body(reducer: Reducer, body: bytes, peer_id: str = "") -> UploadProgress:
    """One upload through the relay's streaming reducer (fed the bytes, in-process)."""

    async def go() -> UploadProgress:
        stream = asyncio.StreamReader()
        stream.feed_data(body)
        stream.feed_eof()
        reader = AsyncContainerReader(stream, max_data_bytes=CODEC.wire_bytes(reducer.numel))
        header = await reader.read_header()
        reducer.check(header)
        progress = UploadProgress()
        await reducer.reduce(reader, header, 8, lambda: True, progress, peer_id)
        return progress

    return asyncio.run(go())


def test_the_reducer_streams_topk2_chunks_and_refuses_a_bad_later_chunk_whole() -> None:
    n = 2 * CHUNK_ELEMS + 5000  # three relay chunks, the last with a tail record
    codec = get_codec("topk2-64")
    reducer = Reducer(np.zeros(n, np.float32), codec)
    try:
        rng = np.random.default_rng(9)
        grads = [rng.standard_normal(n).astype(np.float32) for _ in range(2)]
        for g in grads:
            assert reduce_body(reducer, b"".join(iter_encoded(codec.encode(g)))).committed
        expected = codec.decode(codec.encode(grads[0]), n=n) + codec.decode(codec.encode(grads[1]), n=n)
        assert np.array_equal(reducer.sum, expected)
        bad = dict(codec.encode(grads[0]))
        offset = codec.payload_size(CHUNK_ELEMS + 5 * CHUNK)  # chunk 5 of the second relay chunk
        bad["payload"][offset + 2 : offset + 4] = bad["payload"][offset : offset + 2]  # a duplicate
        for body in (
            b"".join(iter_encoded(list(bad.items()))),
            b"".join(iter_encoded(codec.encode(grads[0])))[:-1000],
        ):  # a truncated body
            with pytest.raises(Exception) as info:
                reduce_body(reducer, body)
            assert getattr(info.value, "code", "") in ("bad_tensor", "truncated_body"), info.value
        assert np.array_equal(reducer.sum, expected)  # whole or nothing
    finally:
        reducer.close()


def test_centered_clip_reduces_topk2_uploads_and_forgets_a_refused_one() -> None:
    """Robust mode stores each peer's decoded chunks: a hostile upload refused in its second relay
    chunk leaves nothing behind (kept, its first chunk would move the center by ~400), so the
    honest upload alone is the center."""
    n, codec = CHUNK_ELEMS + 3 * CHUNK, get_codec("topk2-64")
    reducer = Reducer(np.zeros(n, np.float32), codec, robust=CenteredClipConfig())
    try:
        good = codec.encode(np.random.default_rng(4).standard_normal(n).astype(np.float32))
        bad = {name: array.copy() for name, array in good}
        offset = codec.payload_size(CHUNK_ELEMS)  # the first record of the second relay chunk
        bad["payload"][offset : offset + 2] = np.frombuffer((4096).to_bytes(2, "little"), np.uint8)
        bad["scales"][: CHUNK_ELEMS // CHUNK] *= 1000  # its first relay chunk, valid, would pull the center
        with pytest.raises(Exception) as info:
            reduce_body(reducer, b"".join(iter_encoded(list(bad.items()))), "mallory")
        assert getattr(info.value, "code", "") == "bad_tensor", info.value
        assert reduce_body(reducer, b"".join(iter_encoded(good)), "alice").committed
        asyncio.run(reducer.run(reducer.finish_mean))
        np.testing.assert_allclose(reducer.sum, codec.decode(good, n=n) / 8, rtol=0, atol=1e-6)  # per sample
    finally:
        reducer.close()


def test_dense_only_places_refuse_topk2_in_one_line(tmp_path: Path) -> None:
    """run.compression takes topk2 names (a bad K is one line); moe.codec (and
    pipeline.boundary_codec) keep to the dense codecs, and so do the row payloads themselves."""
    for section, overrides, field in (
        ("run", {"run": {"compression": "topk2-6"}}, "run.compression"),
        ("download", {"run": {"download_compression": "topk3-64"}}, "run.download_compression"),
        ("moe", {"moe": {"enabled": True, "codec": "topk2-64"}}, "moe.codec"),
    ):  # pipeline: test_pipeline.py
        with pytest.raises(ConfigError) as info:
            load_config(write_config(tmp_path / f"{section}.toml", merged(overrides)))
        assert field in str(info.value) and "\n" not in str(info.value), str(info.value)
    load_config(write_config(tmp_path / "ok.toml", merged({"run": {"compression": "topk2-64"}})))
    with pytest.raises(ValueError, match="sparse"):
        payloads.encode_rows("x", np.ones((2, 4), np.float32), get_codec("topk2-64"))


# --- a real relay -----------------------------------------------------------------------------
VECTOR = CHUNK_ELEMS + 3 * CHUNK + 1000  # two relay chunks; the last chunk's tail record is 1000 values
SGD = {"name": "sgd", "lr": 1.0, "weight_decay": 0.0, "momentum": 0.0}


def vector_relay(serve_relay, compression: str, download: str = ""):
    """The run of these tests on an in-process relay (requests only: no restart, no log read)."""
    return serve_relay(
        {
            "model": {"factory": "toolkit.models:Vector", "kwargs": {"numel": VECTOR}},
            "optimizer": SGD,
            "run": {"target_batch": 8, "compression": compression, "download_compression": download},
            "rounds": {"deadline_initial_s": 60.0, "deadline_floor_s": 30.0},
        }
    )


def stored(relay, step: int) -> dict[str, np.ndarray]:
    """The relay's state file of ``step``: ``params`` (what peers hold) and ``master``."""
    return load_file(str(relay.data_dir / "state" / f"step-{step:08d}.safetensors"))


def test_hostile_uploads_to_a_real_relay_are_refused_and_the_round_adds_only_the_good_one(serve_relay) -> None:
    relay = vector_relay(serve_relay, "topk2-64")
    client = RelayClient(relay.url)
    joined = client.join(JoinRequest(peer_name="a", protocol=PROTOCOL_VERSION))
    codec, peer = get_codec(joined.run.compression), joined.peer_id
    public = np.empty(VECTOR, np.float32)
    assert client.params.download_params(public, codec=codec, peer_id=peer) == 0
    meta = GradientMeta(peer_id=peer, step=0, version=0, samples=8, loss_sum=1.0)
    gradient = np.random.default_rng(1).standard_normal(VECTOR).astype(np.float32)
    good = dict(codec.encode(gradient))
    late = codec.payload_size(CHUNK_ELEMS + CHUNK)  # a record in the second relay chunk: the first was staged
    hostile = {
        "duplicate position": {
            **good,
            "payload": set_at(late + 2, bytes(good["payload"][late : late + 2]))(good["payload"].copy()),
        },
        "position out of range": {
            **good,
            "payload": set_at(
                codec.payload_size(VECTOR) - R + 2 * 63,  # the tail's
                (1000).to_bytes(2, "little"),
            )(good["payload"].copy()),
        },
        "nan scale": {**good, "scales": scale(np.nan, 3)(good["scales"].copy())},
        "one byte short": {**good, "payload": good["payload"][:-1]},
        "int8 payload": {**good, "payload": good["payload"].view(np.int8)},
    }
    for what, tensors in [*hostile.items(), ("good", good)]:
        client.heartbeat(peer, Heartbeat(version=0, samples=8, samples_per_s=10.0))
        relay.wait_for(lambda s: s["round"] is not None and s["round"]["expected_peers"] == 1, what="the round")
        if what == "good":
            break
        with pytest.raises(RelayRejected) as info:
            client.upload_gradient(list(tensors.items()), meta, codec.name)
            pytest.fail(f"{what}: accepted")
        assert info.value.code == "bad_tensor" and info.value.status in (400, 422), (what, info.value)
        assert relay.status()["step"] == 0, what  # nothing was applied
    client.upload_gradient(list(good.items()), meta, codec.name)
    assert client.params.download_params(public, have=0, codec=codec, min_step=1, wait_s=30, peer_id=peer) == 1
    state = stored(relay, 1)
    expected = np.zeros(VECTOR, np.float32) - codec.decode(list(good.items()), n=VECTOR) / np.float32(8)
    np.testing.assert_allclose(state["master"], expected, rtol=0, atol=1e-6)  # the good upload alone
    assert np.array_equal(bits(public), bits(state["params"]))
    client.close()


@pytest.mark.parametrize(
    ("compression", "download"), [("int8", ""), ("topk2-64", ""), ("topk2-64", "topk2-256"), ("topk2-64", "int8")]
)
def test_two_peers_hold_the_relays_public_copy_bit_for_bit(serve_relay, compression: str, download: str) -> None:
    """Sync mode, two peers with error feedback; the relay broadcasts deltas against ``public``
    (in ``run.download_compression`` where it is set): after every step both peers (one always on
    deltas, one that rejoins with a full download) hold the relay's stored ``params`` bit for bit,
    and the master is exactly the SGD of what the relay decoded."""
    relay = vector_relay(serve_relay, compression, download)
    codec, down = get_codec(compression), get_codec(download or compression)
    assert RelayClient(relay.url).get_run().download_compression == download  # peers are told
    peers = []
    for name in ("a", "b"):
        client = RelayClient(relay.url)
        joined = client.join(JoinRequest(peer_name=name, protocol=PROTOCOL_VERSION))
        public = np.empty(VECTOR, np.float32)
        assert client.params.download_params(public, codec=down, peer_id=joined.peer_id) == 0
        peers.append((client, joined.peer_id, public, ErrorFeedback(codec, VECTOR)))
    rng = np.random.default_rng(11)
    master = np.zeros(VECTOR, np.float32)
    for step in range(4):
        for client, peer, _, _ in peers:
            client.heartbeat(peer, Heartbeat(version=step, samples=4, samples_per_s=10.0))
        relay.wait_for(lambda s: s["round"] is not None and s["round"]["expected_peers"] == 2, what="the round")
        total = np.zeros(VECTOR, np.float32)
        for client, peer, _, feedback in peers:
            tensors = feedback.compress(rng.standard_normal(VECTOR).astype(np.float32))
            total += codec.decode(tensors, n=VECTOR)
            client.upload_gradient(
                tensors, GradientMeta(peer_id=peer, step=step, version=step, samples=4, loss_sum=1.0), codec.name
            )
        master = master - total / np.float32(8)
        for i, (client, peer, public, _) in enumerate(peers):
            have = None if (i == 1 and step == 2) else step  # b re-downloads once in full
            assert (
                client.params.download_params(
                    public, have=have, codec=down, min_step=step + 1, wait_s=30, peer_id=peer
                )
                == step + 1
            )
        state = stored(relay, step + 1)
        np.testing.assert_allclose(state["master"], master, rtol=0, atol=1e-5)
        for _, _, public, _ in peers:
            assert np.array_equal(bits(public), bits(state["params"]))
    assert not np.array_equal(state["params"], state["master"])  # lossy: public is its own copy
    for client, *_ in peers:
        client.close()
