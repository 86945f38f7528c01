"""``Config`` (a dict with attribute access) and how one is made: run a Python file, apply ``key.sub=value``
overrides, translate InternEvo's keys (``internevo``), then validate key by key (``validate``) and across
keys (``checks``).

A config is a Python file of plain dicts (InternEvo style). Names in ALL_CAPS, modules, functions and
names starting with ``_`` are treated as the file's own helpers and are not part of the config, except
``JOB_NAME``, which InternEvo reads as the job's name. Every other top-level name must be a known key
(tessera's, or InternEvo's). Validation happens before any process group exists, so a typo costs a
second, not a queue slot on a cluster.
"""

from __future__ import annotations

import ast
import copy
import importlib.util
import linecache
import logging
import os
import re
import traceback
import types
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from tessera.config.checks import check_config
from tessera.config.errors import ConfigError, where
from tessera.config.internevo import internevo_names, is_internevo_path, translate_internevo
from tessera.config.presets import apply_low_precision_preset
from tessera.config.schema import SCHEMA, Key, Section
from tessera.config.typed import RunConfig, typed_config
from tessera.config.validate import suggest, validate_config
from tessera.logs import log_once

__all__ = ["Config", "load_python_file", "parse_override", "apply_overrides", "blame_overrides"]


class Config(dict):
    """A dict with attribute access, recursively (``cfg.model.hidden_size``)."""

    def __init__(self, data: Mapping[str, Any] | None = None, source: str | None = None):
        super().__init__()
        for k, v in (data or {}).items():
            self[k] = Config(v) if isinstance(v, Mapping) and not isinstance(v, Config) else v
        object.__setattr__(self, "_source", source)

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"config has no key {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = Config(value) if isinstance(value, Mapping) and not isinstance(value, Config) else value

    def __deepcopy__(self, memo: dict) -> Config:
        return Config(copy.deepcopy(dict(self), memo), self.source)

    @property
    def source(self) -> str | None:
        return object.__getattribute__(self, "_source")

    @property
    def typed(self) -> RunConfig:
        """The typed view (``tessera.config.typed``): what train.py, the builder and the tools read, so that mypy
        checks every key they read. Built anew on each access: a copy, which later edits of this dict miss."""
        return typed_config(self, self.source)

    def to_dict(self) -> dict[str, Any]:
        """Plain, JSON-friendly dict (torch dtypes become their names)."""

        def plain(v: Any) -> Any:
            if isinstance(v, Mapping):
                return {k: plain(x) for k, x in v.items()}
            if isinstance(v, (list, tuple)):
                return [plain(x) for x in v]
            if isinstance(v, torch.dtype):
                return str(v)
            return v

        return plain(self)

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_file(cls, path: str | os.PathLike, overrides: Iterable[str] = ()) -> Config:
        """Execute a Python config file, apply ``key.sub=value`` overrides, fill defaults, validate."""
        raw = load_python_file(path)
        texts = list(overrides)
        apply_overrides(raw, texts, source=str(path))
        try:
            return cls.from_dict(raw, source=str(path))
        except ConfigError as e:
            raise blame_overrides(e, texts, str(path)) from None

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str | None = None) -> Config:
        """Validate a plain dict (e.g. written in a test) against the schema and fill defaults; InternEvo's keys
        are translated first (``tessera.config.internevo``)."""
        named = apply_low_precision_preset(renamed_keys(raw), source)
        filled = validate_config(translate_internevo(named, source), source)
        check_config(filled, source)
        return cls(filled, source)


def load_python_file(path: str | os.PathLike) -> dict[str, Any]:
    """Run the config file as a module and return its config-relevant globals."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ConfigError(f"config file {path} is a folder, not a Python file")
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    spec = importlib.util.spec_from_file_location("_tessera_config", path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"cannot load config file {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise ConfigError(_syntax_error_text(path, e)) from None
    except OSError as e:
        if e.filename is not None and os.path.abspath(os.fspath(e.filename)) == os.path.abspath(path):
            raise ConfigError(f"cannot read config file {path}: {e.strerror or e}") from None  # e.g. permissions
        raise ConfigError(_running_error_text(path, e)) from e
    except Exception as e:  # any error while running user code is a config error
        raise ConfigError(_running_error_text(path, e)) from e
    out: dict[str, Any] = {}
    for name, value in vars(module).items():
        if name.startswith("_") or name.isupper() and name != "JOB_NAME":
            continue
        if isinstance(value, (types.ModuleType, types.FunctionType, type)):
            continue
        out[name] = value
    return out


def _syntax_error_text(path: str, e: SyntaxError) -> str:
    """One line: the file (the config, or a file it imports), the line and column, what is wrong, the line's text."""
    where = f"config file {path}"
    if e.filename and os.path.abspath(e.filename) != os.path.abspath(path):
        where = f"{e.filename} (imported by config file {path})"
    column = f", column {e.offset}" if e.offset else ""
    return f"syntax error in {where}, line {e.lineno}{column}: {e.msg}{_quoted(e.text)}"


def _running_error_text(path: str, e: BaseException) -> str:
    """One line: the config file's line that raised (the last frame in it), that line's text, and the exception;
    where it was raised, when that is another file (a helper the config imports)."""
    config_line, last = None, None
    for frame, lineno in traceback.walk_tb(e.__traceback__):
        last = (frame.f_code.co_filename, lineno)
        if os.path.abspath(frame.f_code.co_filename) == os.path.abspath(path):
            config_line = lineno
    if config_line is None:
        return f"error while running config file {path}: {type(e).__name__}: {_one_line(str(e))}"
    linecache.checkcache(path)
    text = linecache.getline(path, config_line)
    inner = last is not None and os.path.abspath(last[0]) != os.path.abspath(path)
    raised = f" (raised at {last[0]}, line {last[1]})" if inner and last is not None else ""
    return (f"error while running config file {path}, line {config_line}{_quoted(text)}: {type(e).__name__}: "
            f"{_one_line(str(e))}{raised}")


def _quoted(line: str | None) -> str:
    """`` `text` `` of a source line, for an error message (empty when there is none)."""
    text = (line or "").strip()
    return f" `{text}`" if text else ""


def _one_line(text: str) -> str:
    return " ".join(text.split())


def parse_override(text: str, source: str | None = None, label: str | None = None) -> tuple[list[str], Any]:
    """``"model.dtype=bf16"`` -> (["model", "dtype"], "bf16"); values are Python literals. ``label`` begins each
    error message (default ``bad override 'TEXT'``; ``apply_overrides`` adds the override's place on the command
    line)."""
    label = label or f"bad override {text!r}"
    if "=" not in text:
        raise ConfigError(f"{label}: expected key.sub=value{where(source)}")
    key, value_text = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(p.isidentifier() for p in parts):
        raise ConfigError(f"{label}: {key!r} is not a dotted key name")
    stripped = value_text.strip()
    try:
        value = ast.literal_eval(stripped)
    except (ValueError, SyntaxError) as e:
        # a bare word (bf16, torch.bfloat16, a path) is taken as a string; anything else is an error
        if stripped and all(c.isalnum() or c in "._-/+:" for c in stripped):
            value = stripped
        else:
            raise ConfigError(f"{label}: value {value_text!r} is not a Python literal: {_literal_problem(e)}") from None
    return parts, value


def _literal_problem(e: ValueError | SyntaxError) -> str:
    """What ``ast.literal_eval`` found wrong with an override's value, and where in it."""
    if isinstance(e, SyntaxError):
        return f"{e.msg}" + (f" at column {e.offset} of the value" if e.offset else "")
    return "only numbers, strings, lists, tuples, dicts, True, False and None are literals (quote a string)"


# sections that moved, old path -> new path: a config written with the old name still loads, told the new one once
RENAMED_SECTIONS: dict[tuple[str, ...], tuple[str, ...]] = {
    ("model", "fp8"): ("model", "low_precision"),  # it holds every sub-bf16 format (mxfp8, nvfp4), not only fp8
}


def _new_name(parts: list[str]) -> list[str]:
    """An override's key path under the sections' current names (logged once per old name)."""
    for old, new in RENAMED_SECTIONS.items():
        if tuple(parts[: len(old)]) == old:
            _tell_renamed(old, new)
            return [*new, *parts[len(old):]]
    return parts


def _tell_renamed(old: tuple[str, ...], new: tuple[str, ...]) -> None:
    log_once(f"config: {'.'.join(old)} is now called {'.'.join(new)}; read as {'.'.join(new)}", logging.WARNING)


def renamed_keys(raw: Mapping[str, Any]) -> dict[str, Any]:
    """``raw`` with every section of an old name (``RENAMED_SECTIONS``) under its new one; keys given under both
    names merge, the old name's last (a command-line override of the old name wins over the file's new one)."""
    out = dict(raw)
    for old, new in RENAMED_SECTIONS.items():
        parent = out.get(old[0])
        if not isinstance(parent, Mapping) or old[1] not in parent:
            continue
        parent = dict(parent)
        legacy = parent.pop(old[1])
        current = parent.get(new[1])
        if isinstance(legacy, Mapping) and isinstance(current, Mapping):
            legacy = {**current, **legacy}
        parent[new[1]] = legacy
        out[old[0]] = parent
        _tell_renamed(old, new)
    return out


def apply_overrides(raw: dict[str, Any], overrides: Iterable[str], source: str | None = None) -> None:
    """Apply CLI overrides in place; keys are checked against the schema (typos get a suggestion). A key
    InternEvo defines may be overridden too (``model.num_chunks=1``); the translation then reads it. An error
    names the override and its place among them (``override 2 of 3 on the command line``)."""
    texts = list(overrides)
    for n, text in enumerate(texts, 1):
        label = f"bad override {text!r} (override {n} of {len(texts)} on the command line)"
        parts, value = parse_override(text, source, label)
        parts = _new_name(parts)
        node: dict[str, Any] = raw
        spec: Section | None = SCHEMA
        for i, p in enumerate(parts):
            dotted = ".".join(parts[: i + 1])
            if spec is not None and p in spec.keys:
                sub: Key | Section | None = spec.keys[p]
            elif is_internevo_path(dotted):
                sub = None  # InternEvo's key or section: no schema below here
            else:  # tessera's names and InternEvo's at this level
                names = {*(spec.keys if spec is not None else ()), *internevo_names(".".join(parts[:i]))}
                raise ConfigError(f"{label}: unknown key {dotted!r}{suggest(p, names)}")
            if i == len(parts) - 1:
                node[p] = value
            else:
                if isinstance(sub, Key):
                    raise ConfigError(f"{label}: {dotted!r} is not a section")
                node = node.setdefault(p, {})
                if not isinstance(node, dict):
                    raise ConfigError(f"{label}: {dotted!r} is not a dict in the config")
                spec = sub if isinstance(sub, Section) else None


def blame_overrides(error: ConfigError, overrides: Iterable[str], source: str) -> ConfigError:
    """``error`` (found validating a config file with ``overrides`` applied) as the overrides' error when its
    message names a key one of them set (or a key inside a section one set): ``override model.dtype=bogus: ...``
    without the `` (in FILE)`` that would send the reader to a file that does not hold the value. Otherwise
    ``error`` unchanged."""
    blamed = []
    for text in overrides:
        key = text.split("=", 1)[0].strip()
        if key and re.search(rf"(?<![\w.]){re.escape(key)}(?!\w)", str(error)):
            blamed.append(text)
    if not blamed:
        return error
    message = str(error).removesuffix(where(source))
    return ConfigError(f"override{'s' * (len(blamed) > 1)} {' '.join(blamed)}: {message}")
