"""Typed settings: keyword-only dataclasses built from TOML tables and from environment strings.

The generic half of :mod:`relay_server.core.config`; it knows nothing of the run's sections.
Every field is checked against its declared type (the dataclass's type hints), from either source:

* **TOML** values already have a type, and it must be the field's: an integer for ``int``, a
  number for ``float``, ``true``/``false`` for ``bool``, a string for ``str``, an array whose
  items have the item type for ``list[...]``/``tuple[...]``, a table for ``dict[...]``. Nothing is
  converted from a string: ``target_batch = "64"`` is refused, not guessed at.
* **Environment** values are strings, parsed by the field's type: numbers and ``str`` as written;
  ``bool`` as ``true``/``false`` (also ``1``/``0``, ``yes``/``no``, ``on``/``off``); a list as a
  TOML or JSON array (``'["alice", "bob"]'``, ``'[4, 4]'``) or comma-separated
  (``alice,bob``, ``4,4``, ``0.9,0.95``: items trimmed, empty ones dropped, so an empty value is
  an empty list; an item holding a comma needs the array form); a table as a TOML inline table
  (``'{ d = 32, hidden = 64 }'``) or a JSON object (``'{"d": 32, "hidden": 64}'``).

Errors name the setting, what was found and the syntax expected, on one line. Unknown keys are
refused with the closest known name, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import sys
from types import GenericAlias
from typing import Any, get_args, get_origin, get_type_hints

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 (some TPU VMs): the same parser from PyPI
    import tomli as tomllib

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_PLURALS = {bool: "true/false values", int: "integers", float: "numbers", str: "strings"}

PATH = {"path": True}
"""Field metadata marking a ``str`` setting as a file or directory: a relative path written in a
config file is resolved against that file's directory (``relay_server.core.config.resolve_paths``)."""


class ConfigError(ValueError):
    """A configuration value is missing or invalid; the message names the setting and the fix."""


def closest(name: str, known: list[str]) -> str:
    """`` (did you mean X?)`` for the known name nearest to a misspelled one, else ``""``."""
    match = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f" (did you mean {match[0]}?)" if match else ""


def build_section(cls: type, raw: dict[str, Any], where: str) -> Any:
    """An instance of the dataclass ``cls`` from one parsed TOML table; ``where`` prefixes the
    names in errors (``"run."``). Nested dataclass fields are TOML sub-tables."""
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in raw:
        if key not in names:
            suggestion = closest(where + key, [where + n for n in names])
            raise ConfigError(f"unknown setting {where}{key}{suggestion}: fix or remove it")
    values = {}
    for name, value in raw.items():
        tp = hints[name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}{name} must be a table: write it as [{where}{name}]")
            values[name] = build_section(tp, value, f"{where}{name}.")
        else:
            values[name] = check_value(value, tp, f"{where}{name}")
    return cls(**values)


def describe(tp: Any) -> str:
    """The type ``tp`` in words, as errors name it."""
    origin, args = get_origin(tp), get_args(tp)
    if tp is bool:
        return "true or false"
    if tp in (int, float, str):
        return {int: "an integer", float: "a number", str: "a string"}[tp]
    if origin is list or (origin is tuple and len(args) == 2 and args[1] is Ellipsis):
        return "a list of " + (_PLURALS.get(args[0], "values") if args else "values")
    if origin is tuple:
        return f"a list of exactly {len(args)} values ({', '.join(describe(a) for a in args)})"
    if origin is dict:
        return "a table"
    return "a value"


def check_value(value: Any, tp: Any, where: str) -> Any:
    """``value`` as TOML (or Python code) gave it, checked against ``tp``; lists come back as
    lists, tuples as tuples, floats as floats (an integer is a valid number)."""
    origin, args = get_origin(tp), get_args(tp)
    if tp is Any:
        return value
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif tp is str:
        ok = isinstance(value, str)
    elif origin in (list, tuple):
        ok = isinstance(value, (list, tuple))
        if ok:
            return _check_items(list(value), origin, args, where)
    elif origin is dict:
        ok = isinstance(value, dict) and all(isinstance(k, str) for k in value)
        if ok and len(args) == 2 and args[1] is not Any:
            value = {k: check_value(v, args[1], f"{where}.{k}") for k, v in value.items()}
    else:
        raise TypeError(f"{where}: unsupported setting type {tp!r}")
    if not ok:
        unquote = ": write it without quotes" if isinstance(value, str) and tp in (int, float, bool) else ""
        raise ConfigError(f"{where} must be {describe(tp)}, got {_shown(value)}{unquote}")
    return value


def _check_items(items: list[Any], origin: type, args: tuple[Any, ...], where: str) -> Any:
    if origin is list or (len(args) == 2 and args[1] is Ellipsis):
        item_tp = args[0] if args else Any
        checked = [check_value(v, item_tp, f"{where}[{i}]") for i, v in enumerate(items)]
        return checked if origin is list else tuple(checked)
    if len(items) != len(args):
        raise ConfigError(f"{where} must be {describe(GenericAlias(tuple, args))}, got {len(items)} value(s)")
    return tuple(check_value(v, t, f"{where}[{i}]") for i, (v, t) in enumerate(zip(items, args)))


def _shown(value: Any) -> str:
    kind = {
        bool: "true/false",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        tuple: "a list",
        dict: "a table",
    }.get(type(value), type(value).__name__)
    return f"{json.dumps(value) if isinstance(value, str) else repr(value)} ({kind})"


_EXAMPLES = {str: ("alice", "bob"), int: ("4", "4"), float: ("0.9", "0.95")}


def env_syntax(tp: Any, variable: str) -> str:
    """How to write a value of type ``tp`` in the environment variable ``variable``."""
    origin, args = get_origin(tp), get_args(tp)
    if origin in (list, tuple):
        a, b = _EXAMPLES.get(args[0] if args else str, _EXAMPLES[str])
        quoted = f'"{a}", "{b}"' if args and args[0] is str else f"{a}, {b}"
        return f"write {variable} as an array ('[{quoted}]') or comma-separated ({a},{b})"
    if origin is dict:
        return f"write {variable} as a TOML inline table ('{{ d = 32 }}') or a JSON object ('{{\"d\": 32}}')"
    if tp is bool:
        return f"write {variable}=true or {variable}=false"
    return f"write {variable} as {describe(tp)}"


def parse_env(text: str, tp: Any, where: str, variable: str) -> Any:
    """The value of ``variable`` (a string, as the environment gives it) for the setting ``where``
    of type ``tp``, parsed as the module docstring states."""

    def refuse(why: str) -> ConfigError:
        return ConfigError(
            f"{variable}={text!r} is not {describe(tp)} for {where} ({why}): {env_syntax(tp, variable)}"
        )

    origin, args = get_origin(tp), get_args(tp)
    stripped = text.strip()
    if tp is str:
        return text
    if tp is bool:
        if stripped.lower() in _TRUE + _FALSE:
            return stripped.lower() in _TRUE
        raise refuse("not a true/false word")
    if tp in (int, float):
        try:
            return tp(stripped)
        except ValueError:
            raise refuse("not a number" if tp is float else "not a whole number") from None
    if origin in (list, tuple) and not stripped.startswith("["):
        item_tp = args[0] if args and (origin is list or args[-1] is Ellipsis) else None
        parts = [p.strip() for p in stripped.split(",") if p.strip()]
        if item_tp is None:  # a fixed tuple: each item by its own type
            item_types = list(args) if len(parts) == len(args) else []
            if not item_types:
                raise refuse(f"{len(parts)} comma-separated value(s), {len(args)} expected")
        else:
            item_types = [item_tp] * len(parts)
        items = []
        for part, item_tp in zip(parts, item_types):
            try:
                items.append(part if item_tp is Any else parse_env(part, item_tp, where, variable))
            except ConfigError:
                raise refuse(f"{part!r} is not {describe(item_tp)}") from None
        return check_value(items, tp, where)
    if origin in (list, tuple, dict):
        opener = "{" if origin is dict else "["
        if not stripped.startswith(opener):
            raise refuse(f"does not start with {opener}")
        try:
            value = inline_value(stripped)
        except ValueError as exc:
            raise refuse(str(exc)) from None
        try:
            return check_value(value, tp, where)
        except ConfigError as exc:
            raise refuse(str(exc)) from None
    raise TypeError(f"{where}: unsupported setting type {tp!r}")


def inline_value(text: str) -> Any:
    """A TOML inline value (array, inline table) or, failing that, a JSON one."""
    try:
        parsed = tomllib.loads(f"v = {text}")
        if set(parsed) == {"v"}:
            return parsed["v"]
    except tomllib.TOMLDecodeError:
        pass
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise ValueError("neither a TOML nor a JSON value; quote strings") from None


def set_setting(config: Any, section: str, key: str, value: Any) -> None:
    """Set ``section.key`` to ``value`` (a Python value: checked against the field's type)."""
    target = getattr(config, section, None)
    if target is None or not dataclasses.is_dataclass(target):
        raise ConfigError(f"unknown section [{section}]{closest(section, _sections(config))}")
    names = [f.name for f in dataclasses.fields(target)]
    if key not in names:
        where = f"{section}.{key}"
        raise ConfigError(f"unknown setting {where}{closest(where, [f'{section}.{n}' for n in names])}")
    setattr(target, key, check_value(value, get_type_hints(type(target))[key], f"{section}.{key}"))


def path_settings(section: Any) -> list[str]:
    """The names of the fields of ``section`` marked :data:`PATH`."""
    return [f.name for f in dataclasses.fields(section) if f.metadata.get("path")]


def _sections(config: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(config) if dataclasses.is_dataclass(getattr(config, f.name))]
