"""``RELAY_<SECTION>_<FIELD>`` environment variables: which settings they override, and refusing
the ones that name none.

``RELAY_SERVER_PORT=9000`` sets ``[server] port``; a top-level table (``[dataset]``,
``[objective]``) is replaced whole by ``RELAY_DATASET`` / ``RELAY_OBJECTIVE`` (an inline table).
Values are parsed by the field's type (:func:`relay_server.core.typed.parse_env`).

A misspelled override must fail like a misspelled TOML key, not be ignored: a variable is ours,
and refused when it names no setting, if its first word after ``RELAY_`` is a section's name or
close to one (``RELAY_SERVR_PORT``), if the rest is a field's name (``RELAY_PORT``: the section
left out), or if the whole name is close to a setting's (``RELAY_TARGT_BATCH``). Other ``RELAY_*`` variables are left alone: nothing in this project
reads one (peers and notebooks use ``COLLAB_*``), but a shell may hold, say, ``RELAY_URL`` for
other tools, and refusing to start over it would help no one.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any, get_type_hints

from relay_server.core.typed import ConfigError, closest, parse_env

PREFIX = "RELAY_"


def variables(config_cls: type) -> dict[str, tuple[str, str | None, Any]]:
    """Every override's variable name -> (section, field or None for a whole table, its type)."""
    out: dict[str, tuple[str, str | None, Any]] = {}
    for name, tp in get_type_hints(config_cls).items():
        if dataclasses.is_dataclass(tp):
            for sub, sub_tp in get_type_hints(tp).items():
                out[f"{PREFIX}{name}_{sub}".upper()] = (name, sub, sub_tp)
        else:
            out[f"{PREFIX}{name}".upper()] = (name, None, tp)
    return out


def apply_env(config: Any, env: Mapping[str, str]) -> None:
    """Apply every ``RELAY_*`` override in ``env`` to ``config``; refuse one that names no setting
    (with the closest name) before anything is applied."""
    known = variables(type(config))
    sections = sorted({section.upper() for section, _, _ in known.values()})
    fields = {field.upper() for _, field, _ in known.values() if field}
    for variable in sorted(v for v in env if v.startswith(PREFIX) and v not in known):
        rest = variable[len(PREFIX) :]
        head = rest.split("_")[0]
        if (
            head in sections
            or difflib.get_close_matches(head, sections, n=1, cutoff=0.75)
            or rest in fields
            or difflib.get_close_matches(variable, list(known), n=1, cutoff=0.85)
        ):
            raise ConfigError(
                f"environment variable {variable} names no setting{closest(variable, list(known))}: "
                "fix or unset it (overrides are RELAY_<SECTION>_<FIELD>, e.g. RELAY_RUN_TARGET_BATCH)"
            )
    for variable in sorted(v for v in env if v in known):
        section, field, tp = known[variable]
        where = f"{section}.{field}" if field else section
        value = parse_env(env[variable], tp, where, variable)
        if field is None:
            setattr(config, section, value)
        else:
            setattr(getattr(config, section), field, value)
