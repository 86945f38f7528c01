"""Key-by-key validation against ``SCHEMA``: unknown keys (with the closest valid one), types, ranges, defaults.

Checks that involve several keys are in ``tessera.config.checks``; both run before any process group
exists (``Config.from_dict``).
"""

from __future__ import annotations

import copy
import difflib
import math
from collections.abc import Iterable, Mapping
from typing import Any

from tessera.config.errors import ConfigError, where
from tessera.config.schema import REQUIRED, SCHEMA, Key, Section

__all__ = ["validate_config", "validate_section", "suggest"]


def suggest(name: str, valid: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the closest valid name, else the list of valid names."""
    close = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else f"; valid keys: {sorted(valid)}"


def _type_name(types_: tuple[type, ...]) -> str:
    return " or ".join(t.__name__ for t in types_)


def _validate_value(key: Key, value: Any, dotted: str, source: str | None) -> Any:
    if value is None and key.nullable:
        return None
    ok = isinstance(value, key.types) and not (isinstance(value, bool) and bool not in key.types)
    if not ok:
        raise ConfigError(
            f"{dotted}: expected {_type_name(key.types)}, got {type(value).__name__} {value!r}{where(source)}"
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{dotted}: must be finite, got {value!r}{where(source)}")
    if key.check is not None:
        problem = key.check(value)
        if problem:  # (a check that names its key already is not prefixed twice)
            raise ConfigError(f"{dotted}: {problem.removeprefix(f'{dotted}: ')}, got {value!r}{where(source)}")
    if isinstance(value, tuple):
        value = list(value)
    return value


def _validate_section(spec: Section, raw: Any, prefix: str, source: str | None) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a dict, got {type(raw).__name__}{where(source)}")
    for name in raw:
        if name not in spec.keys:
            dotted = f"{prefix}.{name}" if prefix else name
            raise ConfigError(f"unknown key {dotted!r}{suggest(name, spec.keys)}{where(source)}")
    out: dict[str, Any] = {}
    for name, sub in spec.keys.items():
        dotted = f"{prefix}.{name}" if prefix else name
        if isinstance(sub, Section):
            if name not in raw and not sub.optional:
                raise ConfigError(f"missing required section {dotted!r}{where(source)}")
            out[name] = _validate_section(sub, raw.get(name, {}), dotted, source)
        elif name in raw:
            out[name] = _validate_value(sub, raw[name], dotted, source)
        elif sub.default is REQUIRED:
            raise ConfigError(f"missing required key {dotted!r}{where(source)}")
        else:
            out[name] = copy.deepcopy(sub.default)
    return out


def validate_config(raw: Mapping[str, Any], source: str | None = None) -> dict[str, Any]:
    """A whole config, key by key: a new plain dict with every default filled in."""
    return _validate_section(SCHEMA, dict(copy.deepcopy(raw)), "", source)


def validate_section(name: str, raw: Mapping[str, Any], source: str | None = None) -> dict[str, Any]:
    """One top-level section (e.g. ``"data"`` for ``build_data``'s partial dicts), key by key, defaults filled."""
    spec = SCHEMA.keys[name]
    if not isinstance(spec, Section):
        raise KeyError(f"{name!r} is a key, not a section of the config")
    return _validate_section(spec, dict(copy.deepcopy(raw)), name, source)
