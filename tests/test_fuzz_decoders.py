"""Property-based fuzzing of every decoder the relay runs on network input.

Each decoder gets arbitrary bytes, structure-aware messages (the schema's own fields with valid,
boundary and hostile values: NaN, huge ints, booleans for ints, over-long strings, unknown
fields) and single-byte mutations of valid encodings. The property, for every input: the decoder
either raises its typed error (``ProtocolError`` / ``ApiError``, a 4xx for the relay) or returns a
value that satisfies the wire contract, checked independently of the decoder:

* every field has its declared type (no bool for an int, no NaN for a float) and limits;
* the value re-encodes and decodes to itself (round trip);
* it is faithful: each field equals what was sent (nothing silently coerced or dropped).

So a mutated valid message is either refused or equal to a valid re-encoding of what the bytes
say. ``test_the_harness_catches_*`` proves the harness fails on a decoder that leaks an untyped
exception or accepts out-of-contract values.

Counts: 1,000 examples per decoder in the default run (``derandomize=True``: the same examples
every run, so a failure reproduces), 10,000 under ``-m slow`` (random). Each test asserts that
the number of examples it asked for really ran.

Inputs that once crashed a decoder with a 500 (JSON nested deeper than the parser's stack, an
integer beyond a double's range in a float field, non-decimal digits such as "\\u00b2" that pass
``str.isdigit()`` but not ``int()``) are now in the generators, and each keeps a named
regression test at the end of this module.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import math
import struct
import re
import time
import types
import typing
from types import SimpleNamespace
from collections.abc import Callable
from typing import Any, get_args, get_origin, get_type_hints

import numpy as np
import pytest
from yarl import URL
from cryptography.exceptions import InvalidSignature
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from relay_server.auth.access import PassIssuer
from relay_server.api.app import _int_query, _path_int
from relay_server.auth.verify import AuthRejected, ChunkDigests, RequestVerifier, container_digests
from relay_server.collaboration.machine import _gradient_meta
from relay_server.core.errors import ApiError
from relay_server.api.moderation import AdminToken, BanRequest, RollbackRequest
from relay_server.rounds.reducer import Reducer, UploadProgress
from relay_server.auth.relay_key import RelayKey
from toolkit.wire.auth import (BODY_SHA256_HEADER, NONCE_HEADER, PASS_HEADER, SIGNATURE_HEADER, TIMESTAMP_HEADER, b64u,
                          decode_pass, digest_metadata, unb64u, verify_pass)
from tests.conftest import BytesStream
from toolkit.wire.compression import get_codec
from toolkit.errors import ProtocolError
from relay_server.backbone.tickets import encode_ticket, new_ticket_key, sign_ticket, verify_ticket
from toolkit.wire.protocol import (AggregatorHeartbeat, AggregatorRegistration, AggregatorWelcome, AssignRequest,
                              DoneRequest, FinalizeRequest, GradientMeta, GradNormReport, GradNormRequest, Heartbeat,
                              JoinRequest, LoginRequest, ParamsManifest, PlanInfo, ShardLeaseRequest, ShardReport,
                              SliceDigest, SliceReport, Ticket, TicketRequest)
from toolkit.wire.schema import MAX_LIST, MAX_STR, Schema
from toolkit.signing import PeerKey
from toolkit.wire.tensor_container import AsyncContainerReader, encode_header_for, parse_header

EXAMPLES, SLOW_EXAMPLES = 1000, 10_000
COMMON = dict(deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
RAN: dict[str, int] = {}  # decoder -> examples run in this session (printed with -s)


def fuzz(strategy: st.SearchStrategy, examples: int = EXAMPLES, slow_examples: int = SLOW_EXAMPLES):
    """Two tests from one property: ``examples`` (derandomized) by default, ``slow_examples``
    (random) under ``-m slow``; each checks that every example it asked for actually ran."""
    def decorate(body: Callable[[Any], None]):
        def run(n: int, derandomize: bool) -> None:
            calls = [0]

            @settings(max_examples=n, derandomize=derandomize, **COMMON)
            @given(strategy)
            def prop(case: Any) -> None:
                calls[0] += 1
                body(case)

            prop()
            assert calls[0] >= n, f"{body.__name__}: only {calls[0]} of {n} examples ran"
            RAN[body.__name__] = RAN.get(body.__name__, 0) + calls[0]
            print(f"[fuzz] {body.__name__}: {calls[0]} examples")

        def fast() -> None:
            run(examples, True)

        @pytest.mark.slow
        def slow() -> None:
            run(slow_examples, False)

        fast.__doc__ = slow.__doc__ = body.__doc__
        return fast, slow
    return decorate


# --- the wire contract, checked independently of toolkit.wire.schema -----------------------------------
def conforms(value: Any, tp: Any, meta: Any, where: str) -> None:
    """Assert ``value`` has type ``tp`` and respects the field limits ``meta``."""
    origin = get_origin(tp)
    if tp is Any:
        assert_json_value(value, where, 0)
    elif origin in (typing.Union, types.UnionType):
        if value is None:
            assert type(None) in get_args(tp), where
            return
        errors = []
        for option in (a for a in get_args(tp) if a is not type(None)):
            try:
                return conforms(value, option, meta, where)
            except AssertionError as exc:
                errors.append(exc)
        raise AssertionError(f"{where}: {value!r} matches no option of {tp}: {errors}")
    elif origin is typing.Literal:
        assert value in get_args(tp), where
    elif origin in (list, tuple):
        assert isinstance(value, (list, tuple)) and len(value) <= meta.get("max_len", MAX_LIST), where
        (item,) = get_args(tp)[:1] or (Any,)
        for i, v in enumerate(value):
            conforms(v, item, {}, f"{where}[{i}]")
    elif origin is dict:
        assert isinstance(value, dict) and all(isinstance(k, str) for k in value), where
        for k, v in value.items():
            conforms(v, get_args(tp)[1], {}, f"{where}.{k}")
    elif isinstance(tp, type) and issubclass(tp, Schema):
        assert type(value) is tp, where
        for f in dataclasses.fields(tp):
            conforms(getattr(value, f.name), get_type_hints(tp)[f.name], f.metadata, f"{where}.{f.name}")
    elif tp is bool:
        assert type(value) is bool, where
    elif tp in (int, float):
        assert type(value) is tp, f"{where}: {type(value).__name__} where {tp.__name__} is declared"
        assert math.isfinite(value), where
        for key, ok in (("ge", value >= meta.get("ge", -math.inf)), ("le", value <= meta.get("le", math.inf)),
                        ("gt", value > meta.get("gt", -math.inf))):
            assert ok, f"{where}: {value} violates {key}={meta.get(key)}"
    elif tp is str:
        assert type(value) is str and len(value) <= meta.get("max_len", MAX_STR), where
        assert "choices" not in meta or value in meta["choices"], where
    else:
        raise AssertionError(f"{where}: unexpected annotation {tp!r}")


def assert_json_value(value: Any, where: str, depth: int) -> None:
    assert depth <= 9, f"{where}: nested deeper than the schema allows"
    if isinstance(value, float):
        assert math.isfinite(value), where
    elif isinstance(value, str):
        assert len(value) <= MAX_STR, where
    elif isinstance(value, dict):
        assert len(value) <= 256, where
        for k, v in value.items():
            assert_json_value(v, f"{where}.{k}", depth + 1)
    elif isinstance(value, list):
        assert len(value) <= 4096, where
        for v in value:
            assert_json_value(v, where, depth + 1)
    else:
        assert value is None or isinstance(value, (bool, int)), where


def same(got: Any, sent: Any) -> bool:
    """Equal as JSON values, except that an integer sent for a float field may come back as a
    float; a bool never stands in for a number."""
    if isinstance(got, bool) or isinstance(sent, bool):
        return type(got) is type(sent) and got == sent
    if isinstance(got, float) and isinstance(sent, int):
        return got == float(sent)  # JSON numbers are doubles: a big integer rounds, it does not change
    if isinstance(got, (int, float)) and isinstance(sent, (int, float)):
        return got == sent
    if isinstance(got, dict) and isinstance(sent, dict):
        return got.keys() == sent.keys() and all(same(got[k], sent[k]) for k in got)
    if isinstance(got, (list, tuple)) and isinstance(sent, list):
        return len(got) == len(sent) and all(same(a, b) for a, b in zip(got, sent))
    return type(got) is type(sent) and got == sent


def expected_json(tp: Any, sent: Any) -> Any:
    """What a faithful decoder returns for ``sent``: the same values, defaults where omitted."""
    origin = get_origin(tp)
    if isinstance(tp, type) and issubclass(tp, Schema):
        assert isinstance(sent, dict) and set(sent) <= {f.name for f in dataclasses.fields(tp)}, "unknown field accepted"
        hints, out = get_type_hints(tp), {}
        for f in dataclasses.fields(tp):
            if f.name in sent:
                out[f.name] = expected_json(hints[f.name], sent[f.name])
            else:
                default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
                out[f.name] = default.to_json() if isinstance(default, Schema) else default
        return out
    if origin in (typing.Union, types.UnionType) and sent is not None:
        options = [a for a in get_args(tp) if a is not type(None)]
        return expected_json(options[0], sent) if len(options) == 1 else sent
    if origin in (list, tuple) and isinstance(sent, list):
        (item,) = get_args(tp)[:1] or (Any,)
        return [expected_json(item, v) for v in sent]
    return sent


def check_decoded(cls: type[Schema], obj: Schema, sent: Any) -> None:
    """The three properties of an accepted message (module docstring)."""
    conforms(obj, cls, {}, cls.__name__)
    assert cls.loads(obj.dumps()) == obj, "does not survive a round trip"
    assert same(obj.to_json(), expected_json(cls, sent)), f"not faithful: {obj} <- {sent}"


def check_schema_bytes(cls: type[Schema], raw: bytes) -> None:
    try:
        obj = cls.loads(raw)
    except ProtocolError as exc:
        assert exc.code in ("bad_json", "bad_schema") and exc.message
        return
    check_decoded(cls, obj, json.loads(raw))


# --- strategies --------------------------------------------------------------------------------------
# Generation is most of a fuzz test's cost (~4 ms an example for nested one_of strategies on this
# machine, ~1 ms for a flat draw), so each field draws once from a pool of chosen values (valid,
# boundary and hostile) or from one cheap primitive strategy.
TEXT = st.text(max_size=24)
JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                      st.floats(allow_nan=True, allow_infinity=True), TEXT)


def _nested(depth: int) -> Any:
    value: Any = 1
    for i in range(depth):
        value = {"x": value} if i % 2 else [value]
    return value


HOSTILE = [None, True, False, 0, -1, 2**63, -(2**63) - 1, 10**30, 10**400, -(10**400), 1.5, -0.0, 1e308, math.nan, math.inf, -math.inf,
           "", "1", "\x00", "\u00e9\u2603", "\udcff", "x" * 5000, [], [1, "a"], {}, {"a": None}, _nested(8), _nested(11)]
ANY_JSON = st.one_of(st.sampled_from(HOSTILE), JSON_LEAF)


def interesting(tp: Any, meta: Any) -> list[Any]:
    """Valid, boundary and wrong-typed values for one field."""
    origin = get_origin(tp)
    if tp is int:
        return [meta[k] + d for k in ("ge", "le", "gt") if k in meta for d in (-1, 0, 1)] + [0, 1, 7, 10**12]
    if tp is float:
        return [0.0, 2.5, 7, 1e-300, 1e7, 1e7 + 1]
    if tp is str:
        limit = meta.get("max_len", MAX_STR)
        return [*meta.get("choices", ()), "ok", "x" * limit, "x" * (limit + 1), "p" * 32]
    if tp is bool:
        return [True, False]
    if origin in (typing.Union, types.UnionType):
        return [None] + [v for a in get_args(tp) if a is not type(None) for v in interesting(a, meta)]
    if origin is typing.Literal:
        return list(get_args(tp))
    if origin in (list, tuple):
        return [[]]
    if origin is dict:
        return [{}, {"name": "cpu", "memory_gb": 12.5}, {"a": math.nan}, _nested(9), _nested(10)]
    return []


def value_for(tp: Any, meta: Any, depth: int = 0) -> st.SearchStrategy:
    """One draw: a chosen value (valid, boundary, hostile) or a cheap primitive of the field's type."""
    origin = get_origin(tp)
    pool = st.sampled_from(interesting(tp, meta) + HOSTILE)
    if isinstance(tp, type) and issubclass(tp, Schema):
        return st.one_of(message_for(tp, depth + 1), pool) if depth < 2 else pool
    if origin in (list, tuple):
        (item,) = get_args(tp)[:1] or (Any,)
        items = value_for(item, {}, depth + 1)
        return st.one_of(pool, st.lists(items, max_size=2)) if depth < 2 else pool
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in get_args(tp) if a is not type(None)]
        return st.one_of(pool, *(value_for(a, meta, depth) for a in inner if get_origin(a) or issubclass(a, Schema)))
    primitive = {int: st.integers(-(2**64), 2**64), float: st.floats(allow_nan=True, allow_infinity=True),
                 str: TEXT}.get(tp)
    return st.one_of(pool, primitive) if primitive is not None else pool


def message_for(cls: type[Schema], depth: int = 0) -> st.SearchStrategy:
    """JSON objects with the schema's fields: required ones always, optional ones sometimes,
    and now and then an unknown field."""
    hints = get_type_hints(cls)
    fields = dataclasses.fields(cls)
    required = {f.name: value_for(hints[f.name], f.metadata, depth) for f in fields
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    optional = {f.name: value_for(hints[f.name], f.metadata, depth) for f in fields if f.name not in required}
    if depth == 0:
        optional["admin"] = st.sampled_from(HOSTILE)  # a field no schema has
    return st.fixed_dictionaries(required, optional=optional)


def as_bytes(message: dict) -> bytes:
    return json.dumps(message, allow_nan=True).encode()  # NaN / Infinity tokens: Python's parser reads them


def mutated(raw: bytes, position: int, byte: int) -> bytes:
    if not raw:
        return bytes([byte])
    i = position % (len(raw) + 1)
    return raw[:i] + bytes([byte]) + raw[i + 1:]


def schema_inputs(cls: type[Schema]) -> st.SearchStrategy:
    """Arbitrary bytes, structured messages, and one-byte mutations of structured messages."""
    messages = message_for(cls).map(as_bytes)
    return st.one_of(st.binary(max_size=200), messages,
                     st.tuples(messages, st.integers(0, 10**6), st.integers(0, 255)).map(lambda t: mutated(*t)))


# --- JSON message decoders: requests to the relay and aggregators, and what peers decode --------------
SCHEMA_DECODERS = [  # (message, test name, where it is decoded)
    (JoinRequest, "join_request", "POST /api/peers/join"),
    (Heartbeat, "heartbeat", "POST /api/peers/{id}/heartbeat: the numbers round membership and the weight cap use"),
    (LoginRequest, "login_request", "POST /api/auth/login (public: no pass protects it)"),
    (ShardLeaseRequest, "shard_lease_request", "POST /api/peers/{id}/shards/lease"),
    (ShardReport, "shard_report", "POST /api/peers/{id}/shards/report"),
    (PlanInfo, "plan_info", "the plan as a peer decodes it from the relay"),
    (BanRequest, "admin_ban_request", "POST /api/admin/bans"),
    (RollbackRequest, "admin_rollback_request", "POST /api/admin/rollback"),
    (TicketRequest, "ticket_request", "POST /api/rounds/{step}/ticket"),
    (DoneRequest, "done_request", "POST /api/rounds/{step}/done"),
    (ParamsManifest, "params_manifest", "a sliced version's manifest, as a peer decodes it"),
    (AggregatorRegistration, "aggregator_registration", "an aggregator registering with the relay"),
    (AggregatorWelcome, "aggregator_welcome", "the relay's answer, as the aggregator decodes it"),
    (AggregatorHeartbeat, "aggregator_heartbeat", "an aggregator's measurements"),
    (GradNormRequest, "grad_norm_request", "the relay asking an aggregator for its slice's squared norm"),
    (GradNormReport, "grad_norm_report", "an aggregator's squared norm, as the relay decodes it"),
    (FinalizeRequest, "finalize_request", "the relay telling an aggregator to finalize"),
    (AssignRequest, "assign_request", "the relay moving a slice to an aggregator"),
    (SliceReport, "slice_report", "an aggregator's finalized slice, as the relay decodes it"),
]


def _schema_decoder(cls: type[Schema], where: str) -> Callable[[bytes], None]:
    def decode(raw: bytes) -> None:
        check_schema_bytes(cls, raw)

    decode.__name__, decode.__doc__ = f"_{cls.__name__}", f"{cls.__name__}: {where}."
    return decode


for _cls, _name, _where in SCHEMA_DECODERS:
    globals()[f"test_fuzz_{_name}"], globals()[f"test_fuzz_{_name}_slow"] = fuzz(schema_inputs(_cls))(
        _schema_decoder(_cls, _where))

TICKET_KEY = new_ticket_key()
_VALID_TICKET = encode_ticket(sign_ticket(Ticket(
    round_id="r1", step=3, peer_id="p" * 16, samples=8, version=3, plan_version="v", expires_at=2e9,
    slices=[SliceDigest(start=0, end=10, header_sha256="0" * 64)]), TICKET_KEY))


def _ticket_header(header: str) -> None:
    """X-Collab-Ticket, which an aggregator checks before it reduces anything: refused with a
    401/403/409 JSON error unless it decodes and carries this run's MAC."""
    try:
        ticket = verify_ticket(header, TICKET_KEY, now=1e9)
    except ApiError as exc:
        assert exc.status in (401, 403, 409) and exc.code and exc.message
        return
    assert sign_ticket(ticket, TICKET_KEY).mac == ticket.mac


test_fuzz_ticket_header, test_fuzz_ticket_header_slow = fuzz(st.one_of(
    st.text(max_size=300), st.binary(max_size=300).map(b64u), st.just(_VALID_TICKET),
    st.tuples(st.integers(0, len(_VALID_TICKET) - 1), st.sampled_from("AZaz09-_=.")).map(
        lambda t: _VALID_TICKET[:t[0]] + t[1] + _VALID_TICKET[t[0] + 1:])))(_ticket_header)


# --- tensor containers ------------------------------------------------------------------------------------
DTYPE_CODES = ["F32", "F16", "I8", "U8", "I32", "I64", "F64", "BF16", "F8", "", 7, None]
SPEC = st.fixed_dictionaries({"dtype": st.sampled_from(DTYPE_CODES),
                              "shape": st.one_of(st.lists(st.integers(-2, 300), max_size=3), JSON_LEAF),
                              "data_offsets": st.one_of(st.lists(st.integers(-4, 2000), min_size=0, max_size=3),
                                                        JSON_LEAF)})
HEADER_JSON = st.one_of(
    ANY_JSON,
    st.dictionaries(st.text(max_size=8), SPEC, max_size=3).flatmap(lambda d: st.one_of(
        st.just(d), st.dictionaries(st.text(max_size=8), st.one_of(TEXT, JSON_LEAF), max_size=3).map(
            lambda m: {**d, "__metadata__": m}))))


def header_bytes(obj: Any, pad: int) -> bytes:
    raw = json.dumps(obj, allow_nan=True).encode() + b" " * pad
    return struct.pack("<Q", len(raw)) + raw


def _container_header(case: tuple[bytes, int]) -> None:
    """parse_header on arbitrary bytes: a typed refusal, or a header whose entries are
    contiguous, non-negative, consistent with their shapes and within the data limit."""
    raw, limit = case
    prefix, body = raw[:8].ljust(8, b"\0"), raw[8:]
    try:
        header = parse_header(prefix, body, max_data_bytes=limit)
    except ProtocolError as exc:
        assert exc.code in ("bad_tensor", "body_too_large")
        return
    position = 0
    for e in header.entries:
        assert e.begin == position and e.end - e.begin == e.numel * e.dtype.itemsize and min(e.shape, default=0) >= 0
        position = e.end
    assert header.data_bytes == position <= limit
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in header.metadata.items())


test_fuzz_container_header_parser, test_fuzz_container_header_parser_slow = fuzz(st.tuples(
    st.one_of(st.binary(max_size=300), st.tuples(HEADER_JSON, st.integers(0, 7)).map(lambda t: header_bytes(*t))),
    st.sampled_from([0, 1000, 1 << 62])))(_container_header)




LOOP = asyncio.new_event_loop()  # one loop for the whole module: the reducer hops to its own thread
NUM = 600  # parameters of the fuzzed run: three int8 blocks, the last one short; one short topk2 chunk
FUZZED_CODECS = ("none", "float16", "int8", "topk2-4")  # topk2-4: a 9-byte record, often canonical by chance
REDUCERS = {name: Reducer(np.zeros(NUM, np.float32), get_codec(name)) for name in FUZZED_CODECS}


def _meta_value() -> st.SearchStrategy:
    good = dict(peer_id="p" * 32, step=0, version=0, samples=8, loss_sum=1.5)
    valid = st.just(json.dumps(good))
    return st.one_of(valid, message_for(GradientMeta).map(lambda m: json.dumps(m, allow_nan=True)), TEXT,
                     st.tuples(valid, st.integers(0, 200), st.integers(32, 126)).map(
                         lambda t: mutated(t[0].encode(), t[1], t[2]).decode("latin-1")))


def _upload_body(case: tuple[str, Any, bytes, int, bool, str, int]) -> None:
    """The whole upload path after authentication, as put_gradient runs it: the container header
    (length prefix, JSON, total length), the GradientMeta in its metadata, the codec's layout
    check, side-tensor validation and the chunked reduction. Only typed errors; an accepted
    upload leaves a finite sum and weights exactly its samples."""
    codec, meta, data, data_len, truthful, layout_codec, layout_num = case
    reducer = REDUCERS[codec]
    layout = get_codec(layout_codec).layout(layout_num)  # usually the run's own; sometimes another codec's or size
    metadata = {"collab": meta} if isinstance(meta, str) else meta
    specs = [(s.name, s.dtype, s.shape) for s in layout]
    try:
        head = encode_header_for(specs, metadata)
    except (TypeError, ProtocolError):
        return  # metadata that cannot even be written; parse_header's own fuzz covers such bytes
    needed = sum(s.nbytes for s in layout)
    body = head + (data * (needed // max(len(data), 1) + 1))[:needed if truthful else data_len]
    reducer.sum.fill(0.0)
    reducer.weights.fill(0.0)

    async def run() -> int | None:
        reader = AsyncContainerReader(BytesStream(body), reducer.codec.wire_bytes(NUM), total_bytes=len(body))
        header = await reader.read_header()
        gradient = _gradient_meta(header.metadata)
        reducer.check(header)
        await reducer.reduce(reader, header, gradient.samples, lambda: True, UploadProgress(), "peer")
        return gradient.samples

    try:
        samples = LOOP.run_until_complete(run())
    except (ProtocolError, ApiError) as exc:
        assert 400 <= getattr(exc, "status", 400) < 500 and exc.message
        return
    assert np.isfinite(reducer.sum).all() and np.all(reducer.weights == samples)


test_fuzz_upload_body, test_fuzz_upload_body_slow = fuzz(st.tuples(
    st.sampled_from(sorted(REDUCERS)),
    st.one_of(_meta_value(), st.dictionaries(st.text(max_size=6), TEXT, max_size=2)),
    st.binary(min_size=1, max_size=64), st.integers(0, 4000), st.booleans(),
    st.sampled_from(FUZZED_CODECS), st.sampled_from([NUM, NUM, NUM, NUM - 1, NUM + 256])))(_upload_body)


def _gradient_meta_decoder(meta: Any) -> None:
    """GradientMeta as the relay reads it: from the container's ``__metadata__`` entry "collab"."""
    metadata = {"collab": meta} if isinstance(meta, str) else meta
    try:
        gradient = _gradient_meta(metadata)
    except ProtocolError as exc:
        assert exc.code in ("bad_meta", "bad_json", "bad_schema")
        return
    check_decoded(GradientMeta, gradient, json.loads(metadata["collab"]))


test_fuzz_gradient_meta, test_fuzz_gradient_meta_slow = fuzz(st.one_of(
    _meta_value(), st.dictionaries(st.sampled_from(["collab", "codec", "x"]), TEXT, max_size=2)))(_gradient_meta_decoder)


# --- authentication ----------------------------------------------------------------------------------------
RELAY_KEY = RelayKey.generate()
PEER = PeerKey()
GOOD_PASS = PassIssuer(RELAY_KEY, ttl_s=600).issue("alice", PEER.public_raw).access_pass
GOOD_RAW = unb64u(GOOD_PASS)


def _pass_decoder(case: tuple[int, int, bytes | str]) -> None:
    """Arbitrary, truncated, extended or bit-flipped passes: ValueError or a decoded pass; and a
    pass that differs from the genuine one by any bit never verifies."""
    mode, flip, raw = case
    if isinstance(raw, str):
        token = raw
    elif mode == 0:
        token = b64u(raw)
    else:
        changed = bytearray(GOOD_RAW)
        changed[flip % len(changed)] ^= 1 << (flip // len(changed) % 8)
        token = b64u(bytes(changed) + raw[:mode - 1])  # the flipped pass, sometimes with trailing bytes
    try:
        claims, body, signature = decode_pass(token)
    except ValueError:
        return
    assert len(signature) == 64 and claims.encode_claims() == body  # decodes to what it re-encodes to
    try:
        verify_pass(token, RELAY_KEY.public)
    except InvalidSignature:
        return
    assert token == GOOD_PASS, "a modified pass verified"


test_fuzz_pass_decoder, test_fuzz_pass_decoder_slow = fuzz(st.tuples(
    st.integers(0, 4), st.integers(0, 10**5), st.one_of(st.binary(max_size=200), st.text(max_size=300))))(_pass_decoder)


HEADER_TEXT = st.text(max_size=80)
VERIFIER = RequestVerifier(RELAY_KEY, max_skew_s=60)
SIGNED_NAMES = [PASS_HEADER, TIMESTAMP_HEADER, NONCE_HEADER, BODY_SHA256_HEADER, SIGNATURE_HEADER]


def _valid_headers(body: bytes) -> dict[str, str]:
    import requests

    from toolkit.signing import AccessPass, AccessPassHolder, SignedAuth

    claims, _, _ = decode_pass(GOOD_PASS)
    access = AccessPass(token=GOOD_PASS, claims=claims, relay_public=RELAY_KEY.public, clock_offset_s=0.0,
                        received_mono=time.monotonic(), lifetime_s=600)
    prepared = requests.Request("POST", "http://relay.test/api/progress", data=body,
                                headers={"Content-Type": "application/json"}).prepare()
    SignedAuth(PEER, AccessPassHolder(lambda previous: access))(prepared)
    return dict(prepared.headers)


def _signed_headers(case: tuple[dict[str, str | None], bytes]) -> None:
    """The signed-request header decoder (RequestVerifier) on a valid request with any of its auth
    headers replaced, dropped or kept: a typed 4xx refusal, or acceptance only of the request
    exactly as signed (a fresh valid signature for every example, so nonces never repeat)."""
    changes, body = case
    headers = _valid_headers(b'{"x":1}')
    original = dict(headers)
    for name, value in changes.items():
        if value is None:
            headers.pop(name, None)
        else:
            headers[name] = value
    try:
        VERIFIER.verify(method="POST", path_qs="/api/progress", headers=headers, body=body)
    except AuthRejected as exc:
        assert exc.status in (401, 403, 429, 503) and exc.code and exc.message
        return
    assert body == b'{"x":1}' and all(headers.get(n) == original[n] for n in [*SIGNED_NAMES, "Content-Type"]), \
        "a changed request verified"


test_fuzz_signed_request_headers, test_fuzz_signed_request_headers_slow = fuzz(st.tuples(
    st.dictionaries(st.sampled_from(SIGNED_NAMES + ["Content-Type"]), st.one_of(st.none(), HEADER_TEXT), max_size=3),
    st.sampled_from([b'{"x":1}', b'{"x":2}', b""])))(_signed_headers)


CHUNK = 4096


def _chunk_digests(case: tuple[Any, Any, list[int], bytes, int]) -> None:
    """The chunk-digest metadata of a signed upload, and the per-chunk check it drives: a typed
    401 refusal, or digests that tile the tensors exactly; a chunk is accepted only if it is the
    data that was signed."""
    chunk_bytes, digests, sizes, data, flip = case
    arrays = [np.frombuffer((data * (s // max(len(data), 1) + 1))[:s], np.uint8) for s in sizes]
    metadata = digest_metadata([(f"t{i}", a) for i, a in enumerate(arrays)], CHUNK)
    if chunk_bytes is not None:
        metadata["collab_chunk_bytes"] = chunk_bytes
    if digests is not None:
        metadata["collab_chunk_sha256"] = digests
    try:
        checker = ChunkDigests(sizes, metadata, min_chunk_bytes=CHUNK)
    except AuthRejected as exc:
        assert exc.status == 401 and exc.code in ("missing_chunk_digests", "bad_chunk_digests")
        return
    assert len(checker.digests) == len(checker.lengths) and sum(checker.lengths) == sum(sizes)
    segments = [a.tobytes()[i:i + checker.chunk_bytes] for a in arrays for i in range(0, a.size, checker.chunk_bytes)]
    for index, segment in enumerate(segments):
        tampered = bytes([segment[0] ^ (1 + flip % 255)]) + segment[1:] if flip % 2 else segment
        try:
            checker.check(index, tampered)
        except AuthRejected as exc:
            assert exc.code == "chunk_digest_mismatch"
            continue
        assert hashlib.sha256(tampered).digest() == checker.digests[index]


test_fuzz_chunk_digest_metadata, test_fuzz_chunk_digest_metadata_slow = fuzz(st.tuples(
    st.one_of(st.none(), st.sampled_from([str(CHUNK), "4096 ", "-1", "1e4", "\u0664\u0660\u0669\u0666"]),
              st.integers(0, 1 << 25).map(str), TEXT),
    st.one_of(st.none(), st.binary(max_size=160).map(b64u), TEXT),
    st.lists(st.integers(0, 3 * CHUNK), max_size=3), st.binary(min_size=1, max_size=32),
    st.integers(0, 1000)))(_chunk_digests)


def _container_digests(raw: bytes) -> None:
    """container_digests on any header bytes the auth middleware may have read."""
    try:
        checker = container_digests(raw[:8].ljust(8, b"\0") + raw[8:])
    except (ProtocolError, AuthRejected):
        return
    assert len(checker.digests) == len(checker.lengths)


test_fuzz_container_digests, test_fuzz_container_digests_slow = fuzz(st.one_of(
    st.binary(max_size=200), st.tuples(HEADER_JSON, st.integers(0, 3)).map(lambda t: header_bytes(*t))))(
    _container_digests)


ADMIN = AdminToken("s" * 43)


def _admin_authorization(header: str | None) -> None:
    """The admin token check: 401 for anything but the exact bearer token."""
    try:
        ADMIN.check(header)
    except ApiError as exc:
        assert exc.status == 401 and exc.code in ("admin_auth_required", "bad_admin_token")
        return
    assert header is not None and header.partition(" ")[2].strip() == "s" * 43 and header.startswith("Bearer ")


test_fuzz_admin_authorization, test_fuzz_admin_authorization_slow = fuzz(st.one_of(
    st.none(), st.text(max_size=60), st.text(max_size=50).map(lambda t: "Bearer " + t),
    st.tuples(st.integers(0, 42), st.characters()).map(lambda t: "Bearer " + ("s" * 43)[:t[0]] + t[1] +
                                                        ("s" * 43)[t[0] + 1:])))(_admin_authorization)


# --- query and path parameters ------------------------------------------------------------------------------
QUERY_CHARS = st.text(st.characters(codec="utf-8"), max_size=30)


def _query_int(raw: str) -> None:
    """``?min_step=&have=&wait=`` as the params handler reads them: an int within +-10**12 spelled
    in ASCII digits, or 400 bad_query; the path's ``{step}``: a non-negative ASCII int or 400."""
    from urllib.parse import quote

    request = SimpleNamespace(query=URL("/api/params?wait=" + quote(raw, safe="")).query)  # aiohttp's parser
    try:
        value = _int_query(request, "wait", 0)
    except ApiError as exc:
        assert (exc.status, exc.code) == (400, "bad_query")
    else:
        assert re.fullmatch(r"-?[0-9]+", raw) and type(value) is int and value == int(raw) and abs(value) <= 10**12
        float(value)  # the handler turns it into a float: it must fit
    route = SimpleNamespace(match_info={"step": raw})
    try:
        step = _path_int(route, "step")
    except ApiError as exc:
        assert (exc.status, exc.code) == (400, "bad_path")
    else:
        assert raw.isascii() and raw.isdigit() and step == int(raw) and 0 <= step < 10**12


test_fuzz_query_parameters, test_fuzz_query_parameters_slow = fuzz(st.one_of(
    QUERY_CHARS, st.integers(-(10**15), 10**15).map(str), st.sampled_from(
        ["", "-", "+5", " 5", "5 ", "1_000", "\u0661\u0662", "\u00b2", "9" * 400, "-0", "007", "0x10", "1e3"])))(
    _query_int)


# --- the harness itself can fail ------------------------------------------------------------------------------
class LeakyHeartbeat(Heartbeat):
    """A decoder with a classic bug: it indexes the JSON before validating it."""

    @classmethod
    def loads(cls, raw: bytes | str) -> "LeakyHeartbeat":
        json.loads(raw)["samples"]  # KeyError / TypeError on many inputs, outside the contract
        return super().loads(raw)


class LaxHeartbeat(Heartbeat):
    """A decoder that forgets the limits: it accepts a negative sample count."""

    @classmethod
    def loads(cls, raw: bytes | str) -> "LaxHeartbeat":
        try:
            obj = json.loads(raw)
        except ValueError:
            raise ProtocolError("bad_json", "not JSON") from None
        if not isinstance(obj, dict) or set(obj) != {"version", "samples", "samples_per_s"} or \
                not all(type(v) in (int, float) for v in obj.values()):
            raise ProtocolError("bad_schema", "no")
        return cls(version=int(obj["version"]), samples=int(obj["samples"]), samples_per_s=float(obj["samples_per_s"]))


@pytest.mark.parametrize("broken", [LeakyHeartbeat, LaxHeartbeat])
def test_the_harness_catches_a_broken_decoder(broken: type[Heartbeat]) -> None:
    @settings(max_examples=300, derandomize=True, report_multiple_bugs=False, phases=[Phase.generate], **COMMON)
    @given(schema_inputs(Heartbeat))
    def prop(raw: bytes) -> None:
        check_schema_bytes(broken, raw)

    with pytest.raises(Exception) as caught:
        prop()
    assert not isinstance(caught.value, ProtocolError)  # a leaked exception or a failed contract check


# --- inputs that once crashed a decoder with a 500 (regressions) -------------------------------------
def test_regression_deeply_nested_json() -> None:
    with pytest.raises(ProtocolError):
        LoginRequest.loads(b"[" * 100_000)


def test_regression_huge_integer_in_a_float_field() -> None:
    with pytest.raises(ProtocolError):
        Heartbeat.loads(b'{"version": 0, "samples": 1, "samples_per_s": 1' + b"0" * 400 + b"}")


def test_regression_superscript_chunk_size() -> None:
    with pytest.raises(AuthRejected):
        ChunkDigests([CHUNK], {"collab_chunk_bytes": "\u00b2", "collab_chunk_sha256": ""})


def test_regression_superscript_timestamp() -> None:
    headers = _valid_headers(b"{}") | {TIMESTAMP_HEADER: "\u00b2"}
    with pytest.raises(AuthRejected):
        VERIFIER.verify(method="POST", path_qs="/api/progress", headers=headers, body=b"{}")
