"""The one exception every config problem raises (its own module so that leaf modules can raise it)."""


class ConfigError(ValueError):
    """A config problem; the message names the key (and the file when there is one)."""


def where(source: str | None) -> str:
    """The `` (in FILE)`` suffix of a config error message; empty for a config without a file."""
    return f" (in {source})" if source else ""
