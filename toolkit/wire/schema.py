"""Typed, validated JSON messages: the base class every wire schema derives from.

Why hand-written and not pydantic: the wire schemas are a handful of flat dataclasses, and
pydantic's major-version churn broke hivemind installs on Colab (DESIGN.md section 11). This
module checks exactly what crosses the network -- types, finiteness, ranges, string and list
lengths -- and nothing else.

A field's limits go in its metadata: ``field(metadata=limits(ge=0, le=10))``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import types
import typing
from typing import Any, TypeVar, get_args, get_origin, get_type_hints

from toolkit.errors import ProtocolError

T = TypeVar("T", bound="Schema")

MAX_STR = 4096
MAX_LIST = 1_000_000


def limits(
    *,
    ge: float | None = None,
    le: float | None = None,
    gt: float | None = None,
    max_len: int | None = None,
    choices: tuple[str, ...] | None = None,
    pattern: str | None = None,
) -> dict[str, Any]:
    """Field metadata with the bounds :func:`Schema.from_json` enforces (``pattern``: a regular
    expression the whole string must match, for a family of names such as ``topk2-<K>``)."""
    return {
        k: v
        for k, v in dict(ge=ge, le=le, gt=gt, max_len=max_len, choices=choices, pattern=pattern).items()
        if v is not None
    }


class Schema:
    """Mixin for frozen keyword-only dataclasses that cross the network as JSON."""

    def to_json(self) -> dict[str, Any]:
        return _dump(self)

    def dumps(self) -> bytes:
        return json.dumps(self.to_json(), separators=(",", ":"), allow_nan=False).encode()

    @classmethod
    def from_json(cls: type[T], obj: Any, path: str = "") -> T:
        """Build and validate from parsed JSON; raise ProtocolError naming the bad field."""
        where = path or cls.__name__
        if not isinstance(obj, dict):
            raise ProtocolError("bad_schema", f"{where}: expected an object, got {type(obj).__name__}")
        hints = _hints(cls)
        # Schema is a mixin of dataclasses, not one itself: its type does not say that cls is
        known = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = set(obj) - set(known)
        if unknown:
            raise ProtocolError("bad_schema", f"{where}: unknown field(s) {sorted(unknown)[:5]}")
        values = {}
        for name, f in known.items():
            if name not in obj:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise ProtocolError("bad_schema", f"{where}.{name}: missing")
                continue
            values[name] = _check(obj[name], hints[name], f"{where}.{name}", f.metadata)
        return cls(**values)

    @classmethod
    def loads(cls: type[T], raw: bytes | str) -> T:
        try:
            obj = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ProtocolError("bad_json", f"{cls.__name__}: body is not valid JSON ({exc})") from None
        except RecursionError:  # "[[[[..." nested deeper than the parser's stack
            raise ProtocolError("bad_json", f"{cls.__name__}: body is nested too deeply") from None
        return cls.from_json(obj)


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = get_type_hints(cls)
    return _HINTS[cls]


def _dump(value: Any) -> Any:
    if isinstance(value, Schema):
        fields = dataclasses.fields(value)  # type: ignore[arg-type]  # a Schema is a dataclass (see from_json)
        return {f.name: _dump(getattr(value, f.name)) for f in fields}
    if isinstance(value, (list, tuple)):
        return [_dump(v) for v in value]
    if isinstance(value, dict):
        return {k: _dump(v) for k, v in value.items()}
    return value


def _check(value: Any, tp: Any, where: str, meta: Any) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        _check_json_size(value, where)
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in get_args(tp):
            return None
        options = [a for a in get_args(tp) if a is not type(None)]
        errors = []
        for option in options:
            try:
                return _check(value, option, where, meta)
            except ProtocolError as exc:
                errors.append(exc.message)
        raise ProtocolError("bad_schema", errors[0] if len(errors) == 1 else f"{where}: {errors}")
    if origin is typing.Literal:
        if value not in get_args(tp):
            raise ProtocolError("bad_schema", f"{where}: must be one of {get_args(tp)}, got {value!r}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise ProtocolError("bad_schema", f"{where}: expected a list")
        if len(value) > meta.get("max_len", MAX_LIST):
            raise ProtocolError("bad_schema", f"{where}: list too long ({len(value)})")
        (item,) = get_args(tp)[:1] or (Any,)
        items = [_check(v, item, f"{where}[{i}]", {}) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ProtocolError("bad_schema", f"{where}: expected an object with string keys")
        if len(value) > meta.get("max_len", MAX_LIST) or any(len(k) > MAX_STR for k in value):
            raise ProtocolError("bad_schema", f"{where}: object too large ({len(value)} keys)")
        _, item = get_args(tp)
        return {k: _check(v, item, f"{where}.{k}", {}) for k, v in value.items()}
    if isinstance(tp, type) and issubclass(tp, Schema):
        return tp.from_json(value, where)
    if tp is bool:
        if not isinstance(value, bool):
            raise ProtocolError("bad_schema", f"{where}: expected true/false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProtocolError("bad_schema", f"{where}: expected an integer")
        if not -(2**63) <= value < 2**63:  # no wire integer needs more; bounds every unlimited field
            raise ProtocolError("bad_schema", f"{where}: out of range")
        return _check_range(value, where, meta)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ProtocolError("bad_schema", f"{where}: expected a number")
        if isinstance(value, int) and abs(value) > 2**1023:  # beyond a double: float() would overflow
            raise ProtocolError("bad_schema", f"{where}: out of range")
        if not math.isfinite(value):
            raise ProtocolError("bad_schema", f"{where}: must be finite")
        return _check_range(float(value), where, meta)
    if tp is str:
        if not isinstance(value, str):
            raise ProtocolError("bad_schema", f"{where}: expected a string")
        if len(value) > meta.get("max_len", MAX_STR):
            raise ProtocolError("bad_schema", f"{where}: string too long")
        if "choices" in meta and value not in meta["choices"]:
            raise ProtocolError("bad_schema", f"{where}: must be one of {meta['choices']}")
        if "pattern" in meta and not re.fullmatch(meta["pattern"], value):
            raise ProtocolError("bad_schema", f"{where}: must match {meta['pattern']}")
        return value
    raise TypeError(f"schema type {tp!r} at {where} is not supported")  # a bug, not bad input


def _check_range(value: float, where: str, meta: Any) -> Any:
    if "ge" in meta and value < meta["ge"]:
        raise ProtocolError("bad_schema", f"{where}: must be >= {meta['ge']}, got {value}")
    if "gt" in meta and value <= meta["gt"]:
        raise ProtocolError("bad_schema", f"{where}: must be > {meta['gt']}, got {value}")
    if "le" in meta and value > meta["le"]:
        raise ProtocolError("bad_schema", f"{where}: must be <= {meta['le']}, got {value}")
    return value


def _check_json_size(value: Any, where: str, depth: int = 0) -> None:
    """Free-form fields (Any) still get bounded depth and no non-finite numbers."""
    if depth > 8:
        raise ProtocolError("bad_schema", f"{where}: nested too deeply")
    if isinstance(value, float) and not math.isfinite(value):
        raise ProtocolError("bad_schema", f"{where}: must be finite")
    if isinstance(value, str) and len(value) > MAX_STR:
        raise ProtocolError("bad_schema", f"{where}: string too long")
    if isinstance(value, dict):
        if len(value) > 256:
            raise ProtocolError("bad_schema", f"{where}: too many keys")
        for k, v in value.items():
            _check_json_size(v, f"{where}.{k}", depth + 1)
    if isinstance(value, list):
        if len(value) > 4096:
            raise ProtocolError("bad_schema", f"{where}: list too long")
        for v in value:
            _check_json_size(v, where, depth + 1)
