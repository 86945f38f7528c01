"""The single source of config keys, defaults and cross-checks; every error before any process group exists.

    schema.py     SCHEMA: every key, its types, default and range (model defaults come from ModelArgs)
    validate.py   key-by-key validation: unknown keys (closest valid one), types, ranges, defaults
    checks.py     every rule across keys (model sizes vs TP, data, scaler, ckpt) and the launch layout
    loading.py    Config, running a Python config file, ``key.sub=value`` overrides
    internevo.py  InternEvo's configs as they are: each of its keys mapped, a no-op, or refused (all at once);
                  the table is internevo_table.py, its handlers internevo_keys.py, file rules internevo_rules.py
    typed.py      RunConfig: the typed view of a validated config (frozen dataclasses per section, for mypy)
    dtypes.py     the one table of dtype names and their parsing; ``model.dtype`` -> ModelDtype (storage + TF32)
    errors.py     ConfigError
"""

from tessera.config.checks import (
    check_config,
    check_data,
    check_model_sizes,
    check_world_size,
    parallel_sizes,
    resolve_zero1_size,
)
from tessera.config.errors import ConfigError
from tessera.config.internevo import translate_internevo
from tessera.config.loading import Config, apply_overrides, load_python_file, parse_override
from tessera.config.schema import SCHEMA, Key, Section
from tessera.config.typed import RunConfig, typed_config
from tessera.config.validate import validate_config, validate_section

__all__ = [
    "Config",
    "ConfigError",
    "SCHEMA",
    "Key",
    "Section",
    "RunConfig",
    "typed_config",
    "load_python_file",
    "parse_override",
    "apply_overrides",
    "validate_config",
    "validate_section",
    "translate_internevo",
    "check_config",
    "check_data",
    "check_model_sizes",
    "check_world_size",
    "parallel_sizes",
    "resolve_zero1_size",
]
