"""Typed settings from TOML tables and ``RELAY_<SECTION>_<KEY>`` environment variables.

The generic half of :mod:`relay_server.core.config`: build keyword-only dataclasses from parsed
TOML, refusing unknown keys and coercing strings (as the environment gives them) to each field's
type, with an error that names the setting. Knows nothing of the run's sections.
"""

from __future__ import annotations

import dataclasses
from typing import Any, get_type_hints


class ConfigError(ValueError):
    """A configuration value is missing or invalid; the message names the setting."""


def build_section(cls: type, raw: dict[str, Any], where: str) -> Any:
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(raw) - names
    if unknown:
        raise ConfigError(f"unknown setting(s) {sorted(f'{where}{u}' for u in unknown)}")
    values = {}
    for name, value in raw.items():
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"[{where}{name}] must be a table")
            values[name] = build_section(tp, value, f"{name}.")
        else:
            values[name] = coerce(value, tp, f"{where}{name}")
    return cls(**values)


def coerce(value: Any, tp: Any, where: str) -> Any:
    if tp is bool:
        if isinstance(value, str):
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: {value!r} is not a valid bool")
    if tp in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        try:
            return tp(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: {value!r} is not a valid {tp.__name__}") from None
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    return value  # lists / dicts as TOML gave them


def apply_env(config: Any, env: Any) -> None:
    for f in dataclasses.fields(config):
        section = getattr(config, f.name)
        if not dataclasses.is_dataclass(section):
            continue
        for sf in dataclasses.fields(section):
            key = f"RELAY_{f.name}_{sf.name}".upper()
            if key in env:
                set_setting(config, f.name, sf.name, env[key])


def set_setting(config: Any, section: str, key: str, value: Any) -> None:
    target = getattr(config, section, None)
    if target is None or not dataclasses.is_dataclass(target) or key not in {f.name for f in dataclasses.fields(target)}:
        raise ConfigError(f"unknown setting {section}.{key}")
    setattr(target, key, coerce(value, get_type_hints(type(target))[key], f"{section}.{key}"))
