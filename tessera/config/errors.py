"""The one exception every config problem raises (its own module so that leaf modules can raise it)."""


class ConfigError(ValueError):
    """A config problem; the message names the key (and the file when there is one)."""
