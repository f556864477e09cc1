"""Property-based fuzzing of every decoder the relay runs on network input (the authentication
decoders are ``test_fuzz_auth.py``'s; the harness and the contract check ``tests/support/fuzz.py``).

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
regression test at the end of this module (or of ``test_fuzz_auth.py``).
"""

from __future__ import annotations

import asyncio
import json
import re
import struct
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from yarl import URL

from relay_server.api.app import _int_query, _path_int
from relay_server.api.moderation import AdminToken, BanRequest, RollbackRequest
from relay_server.auth.verify import AuthRejected, container_digests
from relay_server.backbone.tickets import encode_ticket, new_ticket_key, sign_ticket, verify_ticket
from relay_server.collaboration.machine import _gradient_meta
from relay_server.core.errors import ApiError
from relay_server.rounds.reducer import Reducer, UploadProgress
from tests.support.fuzz import (
    ANY_JSON,
    COMMON,
    JSON_LEAF,
    TEXT,
    check_decoded,
    check_schema_bytes,
    fuzz,
    message_for,
    mutated,
    schema_inputs,
)
from tests.support.streams import BytesStream
from toolkit.errors import ProtocolError
from toolkit.wire.auth import b64u
from toolkit.wire.compression import get_codec
from toolkit.wire.protocol import (
    AggregatorHeartbeat,
    AggregatorRegistration,
    AggregatorWelcome,
    AssignRequest,
    DoneRequest,
    FinalizeRequest,
    GradientMeta,
    GradNormReport,
    GradNormRequest,
    Heartbeat,
    JoinRequest,
    LoginRequest,
    ParamsManifest,
    PlanInfo,
    ShardLeaseRequest,
    ShardReport,
    SliceDigest,
    SliceReport,
    Ticket,
    TicketRequest,
)
from toolkit.wire.schema import Schema
from toolkit.wire.tensor_container import AsyncContainerReader, encode_header_for, parse_header

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
        _schema_decoder(_cls, _where)
    )

TICKET_KEY = new_ticket_key()
_VALID_TICKET = encode_ticket(
    sign_ticket(
        Ticket(
            round_id="r1",
            step=3,
            peer_id="p" * 16,
            samples=8,
            version=3,
            plan_version="v",
            expires_at=2e9,
            slices=[SliceDigest(start=0, end=10, header_sha256="0" * 64)],
        ),
        TICKET_KEY,
    )
)


def _ticket_header(header: str) -> None:
    """X-Collab-Ticket, which an aggregator checks before it reduces anything: refused with a
    401/403/409 JSON error unless it decodes and carries this run's MAC."""
    try:
        ticket = verify_ticket(header, TICKET_KEY, now=1e9)
    except ApiError as exc:
        assert exc.status in (401, 403, 409) and exc.code and exc.message
        return
    assert sign_ticket(ticket, TICKET_KEY).mac == ticket.mac


test_fuzz_ticket_header, test_fuzz_ticket_header_slow = fuzz(
    st.one_of(
        st.text(max_size=300),
        st.binary(max_size=300).map(b64u),
        st.just(_VALID_TICKET),
        st.tuples(st.integers(0, len(_VALID_TICKET) - 1), st.sampled_from("AZaz09-_=.")).map(
            lambda t: _VALID_TICKET[: t[0]] + t[1] + _VALID_TICKET[t[0] + 1 :]
        ),
    )
)(_ticket_header)


# --- tensor containers ------------------------------------------------------------------------------------
DTYPE_CODES = ["F32", "F16", "I8", "U8", "I32", "I64", "F64", "BF16", "F8", "", 7, None]
SPEC = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(DTYPE_CODES),
        "shape": st.one_of(st.lists(st.integers(-2, 300), max_size=3), JSON_LEAF),
        "data_offsets": st.one_of(st.lists(st.integers(-4, 2000), min_size=0, max_size=3), JSON_LEAF),
    }
)
HEADER_JSON = st.one_of(
    ANY_JSON,
    st.dictionaries(st.text(max_size=8), SPEC, max_size=3).flatmap(
        lambda d: st.one_of(
            st.just(d),
            st.dictionaries(st.text(max_size=8), st.one_of(TEXT, JSON_LEAF), max_size=3).map(
                lambda m: {**d, "__metadata__": m}
            ),
        )
    ),
)


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


test_fuzz_container_header_parser, test_fuzz_container_header_parser_slow = fuzz(
    st.tuples(
        st.one_of(st.binary(max_size=300), st.tuples(HEADER_JSON, st.integers(0, 7)).map(lambda t: header_bytes(*t))),
        st.sampled_from([0, 1000, 1 << 62]),
    )
)(_container_header)


LOOP = asyncio.new_event_loop()  # one loop for the whole module: the reducer hops to its own thread
NUM = 600  # parameters of the fuzzed run: three int8 blocks, the last one short; one short topk2 chunk
FUZZED_CODECS = ("none", "float16", "int8", "topk2-4")  # topk2-4: a 9-byte record, often canonical by chance
REDUCERS = {name: Reducer(np.zeros(NUM, np.float32), get_codec(name)) for name in FUZZED_CODECS}


def _meta_value() -> st.SearchStrategy:
    good = dict(peer_id="p" * 32, step=0, version=0, samples=8, loss_sum=1.5)
    valid = st.just(json.dumps(good))
    return st.one_of(
        valid,
        message_for(GradientMeta).map(lambda m: json.dumps(m, allow_nan=True)),
        TEXT,
        st.tuples(valid, st.integers(0, 200), st.integers(32, 126)).map(
            lambda t: mutated(t[0].encode(), t[1], t[2]).decode("latin-1")
        ),
    )


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
    body = head + (data * (needed // max(len(data), 1) + 1))[: needed if truthful else data_len]
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


test_fuzz_upload_body, test_fuzz_upload_body_slow = fuzz(
    st.tuples(
        st.sampled_from(sorted(REDUCERS)),
        st.one_of(_meta_value(), st.dictionaries(st.text(max_size=6), TEXT, max_size=2)),
        st.binary(min_size=1, max_size=64),
        st.integers(0, 4000),
        st.booleans(),
        st.sampled_from(FUZZED_CODECS),
        st.sampled_from([NUM, NUM, NUM, NUM - 1, NUM + 256]),
    )
)(_upload_body)


def _gradient_meta_decoder(meta: Any) -> None:
    """GradientMeta as the relay reads it: from the container's ``__metadata__`` entry "collab"."""
    metadata = {"collab": meta} if isinstance(meta, str) else meta
    try:
        gradient = _gradient_meta(metadata)
    except ProtocolError as exc:
        assert exc.code in ("bad_meta", "bad_json", "bad_schema")
        return
    check_decoded(GradientMeta, gradient, json.loads(metadata["collab"]))


test_fuzz_gradient_meta, test_fuzz_gradient_meta_slow = fuzz(
    st.one_of(_meta_value(), st.dictionaries(st.sampled_from(["collab", "codec", "x"]), TEXT, max_size=2))
)(_gradient_meta_decoder)


def _container_digests(raw: bytes) -> None:
    """container_digests on any header bytes the auth middleware may have read."""
    try:
        checker = container_digests(raw[:8].ljust(8, b"\0") + raw[8:])
    except (ProtocolError, AuthRejected):
        return
    assert len(checker.digests) == len(checker.lengths)


test_fuzz_container_digests, test_fuzz_container_digests_slow = fuzz(
    st.one_of(st.binary(max_size=200), st.tuples(HEADER_JSON, st.integers(0, 3)).map(lambda t: header_bytes(*t)))
)(_container_digests)


ADMIN = AdminToken("s" * 43)


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


test_fuzz_query_parameters, test_fuzz_query_parameters_slow = fuzz(
    st.one_of(
        QUERY_CHARS,
        st.integers(-(10**15), 10**15).map(str),
        st.sampled_from(
            ["", "-", "+5", " 5", "5 ", "1_000", "\u0661\u0662", "\u00b2", "9" * 400, "-0", "007", "0x10", "1e3"]
        ),
    )
)(_query_int)


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
        if (
            not isinstance(obj, dict)
            or set(obj) != {"version", "samples", "samples_per_s"}
            or not all(type(v) in (int, float) for v in obj.values())
        ):
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
