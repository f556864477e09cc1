"""The fuzz harness every decoder test shares: one property becomes two tests, and the wire
contract a decoded value must satisfy is checked independently of ``toolkit.wire.schema``.

``fuzz(strategy)(body)`` returns ``(fast, slow)``: ``fast`` runs 1,000 examples in the default run
(``derandomize=True``: the same examples every run, so a failure reproduces), ``slow`` 10,000 under
``-m slow`` (random); each asserts that every example it asked for really ran. The contract
(:func:`check_schema_bytes`): every field has its declared type (no bool for an int, no NaN for a
float) and limits, the value re-encodes and decodes to itself, and each field equals what was sent.
The strategies draw valid, boundary and hostile values per field (:func:`schema_inputs`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from collections.abc import Callable
from typing import Any, get_args, get_origin, get_type_hints

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from toolkit.errors import ProtocolError
from toolkit.wire.schema import MAX_LIST, MAX_STR, Schema

EXAMPLES, SLOW_EXAMPLES = 1000, 10_000
COMMON = dict(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
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
        for key, ok in (
            ("ge", value >= meta.get("ge", -math.inf)),
            ("le", value <= meta.get("le", math.inf)),
            ("gt", value > meta.get("gt", -math.inf)),
        ):
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
        assert isinstance(sent, dict) and set(sent) <= {f.name for f in dataclasses.fields(tp)}, (
            "unknown field accepted"
        )
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
JSON_LEAF = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True), TEXT
)


def _nested(depth: int) -> Any:
    value: Any = 1
    for i in range(depth):
        value = {"x": value} if i % 2 else [value]
    return value


HOSTILE = [
    None,
    True,
    False,
    0,
    -1,
    2**63,
    -(2**63) - 1,
    10**30,
    10**400,
    -(10**400),
    1.5,
    -0.0,
    1e308,
    math.nan,
    math.inf,
    -math.inf,
    "",
    "1",
    "\x00",
    "\u00e9\u2603",
    "\udcff",
    "x" * 5000,
    [],
    [1, "a"],
    {},
    {"a": None},
    _nested(8),
    _nested(11),
]
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
    primitive = {
        int: st.integers(-(2**64), 2**64),
        float: st.floats(allow_nan=True, allow_infinity=True),
        str: TEXT,
    }.get(tp)
    return st.one_of(pool, primitive) if primitive is not None else pool


def message_for(cls: type[Schema], depth: int = 0) -> st.SearchStrategy:
    """JSON objects with the schema's fields: required ones always, optional ones sometimes,
    and now and then an unknown field."""
    hints = get_type_hints(cls)
    fields = dataclasses.fields(cls)
    required = {
        f.name: value_for(hints[f.name], f.metadata, depth)
        for f in fields
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
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
    return raw[:i] + bytes([byte]) + raw[i + 1 :]


def schema_inputs(cls: type[Schema]) -> st.SearchStrategy:
    """Arbitrary bytes, structured messages, and one-byte mutations of structured messages."""
    messages = message_for(cls).map(as_bytes)
    return st.one_of(
        st.binary(max_size=200),
        messages,
        st.tuples(messages, st.integers(0, 10**6), st.integers(0, 255)).map(lambda t: mutated(*t)),
    )
