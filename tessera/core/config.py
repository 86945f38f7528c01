"""The config a launch takes, and the documented path of ``Config`` / ``ConfigError``.

``as_config`` accepts what a user hands ``launch_from_torch`` / ``launch_from_slurm`` or the builder: a
``Config``, a dict of sections, or the path of a Python config file, and returns the validated
``Config`` (every error a ``ConfigError`` naming the key, before any process group exists).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from tessera.config import Config, ConfigError

__all__ = ["Config", "ConfigError", "as_config"]


def as_config(config: Config | Mapping[str, Any] | str | os.PathLike) -> Config:
    """A validated ``Config`` from a ``Config`` (returned as is), a dict of sections, or a config file's path."""
    if isinstance(config, Config):
        return config
    if isinstance(config, (str, os.PathLike)):
        return Config.from_file(config)
    return Config.from_dict(config)
