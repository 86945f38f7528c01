"""The typed view of the config (``tessera.config.typed``) against the one schema, and what it buys: mypy
refuses a misspelled key read in train.py.

The dataclasses are written out (mypy reads source, not classes built at run time), so these tests are what
keeps them from drifting: every section and key of ``SCHEMA`` is a field and nothing else is, each field's
type is the key's accepted types (``Literal`` of exactly the choices its ``OneOf`` check accepts), and the
view holds the validated values unchanged."""

import dataclasses
import subprocess
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
import torch

from tessera.config import SCHEMA, Config, ConfigError, RunConfig, typed_config, validate_config
from tessera.config.schema import Key, OneOf, Section, _fp8_rules, _str_list
from tessera.config.typed import FILLED_KEYS

ROOT = Path(__file__).resolve().parents[1]

BASE = dict(
    model=dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256, dtype=torch.float32,
               fp32_modules=("output",), rope_scaling=dict(type="linear", factor=2.0)),
    parallel=dict(tensor=dict(size=2, mode="msp")),
    data=dict(type="synthetic", seq_len=32, min_length_dict={"cn/": 50}),
    grad_scaler=dict(fp16=dict(initial_scale=2**10)),
)


def _atoms(hint) -> set:
    """A field's annotation as a set of what it admits: types, ``("literal", value)``, ``("sequence", item)``,
    ``("mapping", key)`` and None."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return set().union(*(_atoms(a) for a in typing.get_args(hint)))
    if origin is typing.Literal:
        return {("literal", v) for v in typing.get_args(hint)}
    if hint is type(None):
        return {None}
    if origin is Sequence:
        return {("sequence", typing.get_args(hint)[0])}
    if origin is Mapping:
        return {("mapping", typing.get_args(hint)[0])}
    return {hint}


def _expected_atoms(path: str, key: Key) -> set:
    """What the schema's key accepts, in ``_atoms``'s terms. An int is a float to a type checker (PEP 484's
    numeric tower), so (float, int) is ``float``; a list or tuple of strings is a ``Sequence[str]``."""
    if isinstance(key.check, OneOf):
        out: set = {("literal", c) for c in key.check.choices}
    else:
        kinds = set(key.types) - ({int} if float in key.types else set())
        out = set()
        for t in kinds:
            if t in (list, tuple) and key.check is _fp8_rules:  # (pattern, recipe) pairs
                out.add(("sequence", tuple[str, str]))
            elif t in (list, tuple):
                assert key.check is _str_list, f"{path}: a list key that is not a list of strings needs its own type"
                out.add(("sequence", str))
            elif t is dict:
                out.add(("mapping", str))
            else:
                out.add(t)
    if key.nullable and path not in FILLED_KEYS:
        out.add(None)
    return out


def _sections(cls: type, spec: Section, prefix: str = ""):
    """(dotted path, dataclass, schema section) of every section, the root first."""
    yield prefix, cls, spec
    hints = typing.get_type_hints(cls)
    for name, sub in spec.keys.items():
        if isinstance(sub, Section):
            yield from _sections(hints[name], sub, f"{prefix}{name}.")


def _keys(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)} - ({"source"} if cls is RunConfig else set())


def test_every_schema_section_and_key_is_a_field_and_nothing_else():
    for prefix, cls, spec in _sections(RunConfig, SCHEMA):
        where = prefix.rstrip(".") or "the config"
        assert dataclasses.is_dataclass(cls), f"{where}: a section must be a dataclass"
        assert _keys(cls) == set(spec.keys), f"{where}: fields differ from the schema's keys"


def test_every_field_type_is_its_keys_accepted_types():
    for prefix, cls, spec in _sections(RunConfig, SCHEMA):
        hints = typing.get_type_hints(cls)
        for name, key in spec.keys.items():
            if isinstance(key, Key):
                path = f"{prefix}{name}"
                assert _atoms(hints[name]) == _expected_atoms(path, key), path


def test_the_filled_keys_are_nullable_in_the_schema_and_filled_by_check_config():
    for path in FILLED_KEYS:
        section, name = path.rsplit(".", 1)
        key = SCHEMA.keys[section].keys[name]  # type: ignore[union-attr]
        assert isinstance(key, Key) and key.nullable and key.default is None, path
    cfg = Config.from_dict(BASE)
    assert cfg.typed.model.num_kv_attention_heads == 4
    assert cfg.typed.model.max_position_embeddings == 32
    assert cfg.typed.lr_scheduler.total_steps == cfg.data.total_steps


def test_no_field_has_a_default_the_schema_is_the_one_home_of_defaults():
    for prefix, cls, _ in _sections(RunConfig, SCHEMA):
        defaulted = [f.name for f in dataclasses.fields(cls)
                     if f.name != "source" and (f.default is not dataclasses.MISSING
                                                or f.default_factory is not dataclasses.MISSING)]
        assert defaulted == [], prefix


def test_the_view_holds_the_validated_values_unchanged():
    cfg = Config.from_dict(BASE, source="cfg.py")
    view = cfg.typed
    assert view.as_dict() == cfg  # every key, nested sections included
    assert view.source == "cfg.py"
    assert view.model.dtype is torch.float32
    assert view.model.fp32_modules == ["output"]  # validation made the tuple a list
    assert view.model.rope_scaling == {"type": "linear", "factor": 2.0}
    assert view.data.min_length_dict == {"cn/": 50}
    assert view.parallel.tensor.mode == "msp" and view.parallel.tensor.size == 2
    assert view.grad_scaler.fp16.initial_scale == 2**10 and view.grad_scaler.max_scale == 2**24
    assert view.model.compile.enabled == "auto"
    assert view.data.as_dict() == dict(cfg.data)


def test_the_view_is_a_copy_and_frozen():
    cfg = Config.from_dict(BASE)
    view = cfg.typed
    cfg.model.fp32_modules.append("norm")
    cfg.data.min_length_dict["en/"] = 3
    assert view.model.fp32_modules == ["output"] and view.data.min_length_dict == {"cn/": 50}
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.data.seq_len = 64  # type: ignore[misc]


def test_a_dict_that_was_not_validated_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"typed_config: key 'seed' is missing.*\(in my.py\)"):
        typed_config({"job_name": "x"}, source="my.py")
    with pytest.raises(ConfigError, match=r"'model.num_kv_attention_heads' is None.*check_config"):
        typed_config(validate_config(BASE))  # key by key only: the derived defaults are not filled


def test_mypy_refuses_a_misspelled_key_read_in_train_py(tmp_path):
    """The guarantee itself: train.py with one key misspelled on the typed view fails mypy, naming the key; the
    same file as it is passes (so the failure is the misspelling's)."""
    pytest.importorskip("mypy", reason="the type checker runs in CI (.ci/run installs it)")
    source = (ROOT / "train.py").read_text()
    read = "cfg.data.seq_len"
    assert read in source, "train.py no longer reads cfg.data.seq_len: misspell another key it reads"
    (tmp_path / "train_as_is.py").write_text(source)
    (tmp_path / "train_typo.py").write_text(source.replace(read, read + "n", 1))
    # the repository's mypy settings and cache (warm after CI's mypy step)
    proc = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                           str(tmp_path / "train_as_is.py"), str(tmp_path / "train_typo.py")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    errors = [line for line in proc.stdout.splitlines() if ": error:" in line]
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert errors and all("train_typo.py" in line for line in errors), proc.stdout
    assert any('"DataConfig" has no attribute "seq_lenn"' in line for line in errors), proc.stdout
