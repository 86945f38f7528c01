"""``from tessera.core.config import Config, ConfigError``: the DESIGN.md path of the config API.

Re-exports of ``tessera.config``, where the config code lives; patch and extend it there.
"""

from tessera.config import Config, ConfigError

__all__ = ["Config", "ConfigError"]
