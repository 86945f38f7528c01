"""InternEvo's configs as they are: each key InternEvo defines is mapped onto tessera's, accepted as a no-op at
the value given, or refused when the value asks for something tessera lacks.

``translate_internevo`` runs inside ``Config.from_dict`` (so inside every ``Config.from_file``) before the
key-by-key validation; what it returns is a tessera config, which tessera's own validation then checks as
any other. Every refusal of a file is collected and raised in one ``ConfigError`` (key, value, why), so a
published InternEvo config is fixed in one edit, not one per run. Keys InternEvo does not define are left
to tessera's validation (an unknown key gets the closest valid name, as always).

What each key gets is the table ``tessera.config.internevo_keys.KEYS`` (docs/internevo.md's key
table is that table). A file is read as an InternEvo config when it defines a top-level name only
InternEvo has (``model_type``, ``beta2_scheduler``, ``monitor``, ``use_fp32_norm``, ...): then tessera's
own keys are read with InternEvo's meaning too (``parallel.tensor=2``, ``local:`` paths, ``data.type=
'tokenized'``, the values tessera lacks, such as pipeline size 2) and the file-level rules below apply
(InternEvo's defaults for keys the file leaves out, random tokens without a train folder, InternEvo's
checkpoint-loading order). A tessera config without such a name is translated only where it spells a
key InternEvo's way, and otherwise reaches validation unchanged.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from typing import Any

from tessera.config.errors import ConfigError, where
from tessera.config.internevo_keys import MISSING, is_tessera_path, same_value
from tessera.config.internevo_rules import file_rules
from tessera.config.internevo_table import KEYS, SECTIONS
from tessera.config.validate import suggest

__all__ = ["Translation", "translate_internevo", "is_internevo_path", "internevo_names", "internevo_markers", "KEYS"]

logger = logging.getLogger("tessera")


def internevo_markers(raw: Mapping[str, Any]) -> list[str]:
    """The top-level names of ``raw`` that only InternEvo defines (JOB_NAME aside, which tessera files may use
    as a helper): a file with one is read as an InternEvo config."""
    return [name for name in raw if name != "JOB_NAME" and (name in KEYS or name in SECTIONS)
            and not is_tessera_path(name)]


def is_internevo_path(path: str) -> bool:
    """Whether ``path`` (dotted) is a key InternEvo defines, a section of one, or inside a key whose value is a
    whole dict (``generation.top_k``): a command-line override may set it."""
    parts = path.split(".")
    heads = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return path in SECTIONS or any(head in KEYS for head in heads)


def internevo_names(prefix: str) -> list[str]:
    """The names InternEvo defines right under the dotted ``prefix`` ("" for the top level)."""
    head = f"{prefix}." if prefix else ""
    return sorted({p[len(head):].split(".")[0] for p in (*KEYS, *SECTIONS) if p.startswith(head)})


class Translation:
    """One file's translation: the original (``raw``, read only), the tessera config being made (``out``), and
    what happened to each InternEvo key: mapped, accepted as a no-op, accepted with a difference, refused."""

    def __init__(self, raw: Mapping[str, Any], source: str | None = None) -> None:
        self.raw = copy.deepcopy(dict(raw))
        self.out: dict[str, Any] = copy.deepcopy(dict(raw))
        self.source = source
        self.markers = internevo_markers(raw)
        self.internevo = bool(self.markers)
        self.mapped: list[str] = []
        self.noops: list[str] = []
        self.differences: list[str] = []
        self.refusals: list[str] = []
        self.consumed: set[str] = set()  # keys of the file already read as InternEvo's (no longer tessera's)
        self._once: set[str] = set()

    # ------------------------------------------------------------------ reading the original
    def get(self, path: str, default: Any = MISSING) -> Any:
        node: Any = self.raw
        for part in path.split("."):
            if not isinstance(node, Mapping) or part not in node:
                return default
            node = node[part]
        return node

    def has(self, path: str) -> bool:
        return self.get(path) is not MISSING

    def once(self, key: str) -> bool:
        """True the first time ``key`` is asked (for rules that several keys trigger)."""
        if key in self._once:
            return False
        self._once.add(key)
        return True

    # ------------------------------------------------------------------ writing the tessera config
    def drop(self, path: str) -> None:
        *head, last = path.split(".")
        node: Any = self.out
        for part in head:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(last, None)

    def put(self, path: str, value: Any, origin: str) -> bool:
        """Set tessera's ``path`` to ``value`` (for ``origin``); refused when tessera has no such key, or when
        the file sets it to something else itself."""
        if not is_tessera_path(path):
            self.refuse(origin, self.get(origin), f"needs tessera's {path}, which this version does not have")
            return False
        mine = self.get(path)
        if mine is not MISSING and path != origin and path not in self.consumed and not same_value(mine, value):
            self.refuse(origin, self.get(origin), f"means {path}={value!r}, but the file sets {path}={mine!r}")
            return False
        *head, last = path.split(".")
        node = self.out
        for part in head:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[last] = value
        return True

    # ------------------------------------------------------------------ what happened to a key
    def noop(self, path: str, value: Any, why: str = "") -> None:
        """Accepted: InternEvo does nothing tessera would not at this value (or it only tunes InternEvo's runtime)."""
        self.noops.append(f"{path}={value!r}" + (f" ({why})" if why else ""))
        self.consumed.add(path)
        self.drop(path)

    def map(self, path: str, value: Any, target: str, new: Any, why: str = "") -> None:
        """Tessera has the concept as ``target``: ``path=value`` becomes ``target=new``."""
        self.consumed.add(path)
        if path != target:
            self.drop(path)
        if self.put(target, new, path):
            self.mapped.append(f"{path}={value!r} -> {target}={new!r}" + (f" ({why})" if why else ""))

    def default(self, target: str, value: Any, why: str) -> None:
        """InternEvo's value of a key the file leaves out, where tessera's default differs."""
        if self.put(target, value, target):
            self.mapped.append(f"{target}={value!r} ({why})")

    def refuse(self, path: str, value: Any, why: str) -> None:
        shown = "" if value is MISSING else f"={value!r}"
        self.refusals.append(f"{path}{shown}: {why}")
        self.consumed.add(path)
        self.drop(path)

    def differ(self, text: str) -> None:
        """Accepted, but tessera does not do exactly what InternEvo does: said once, as a warning."""
        self.differences.append(text)

    # ------------------------------------------------------------------ the walk
    def walk(self, node: Mapping[str, Any], prefix: str = "", internevo_only: bool = False) -> None:
        for name, value in node.items():
            path = f"{prefix}{name}"
            tessera = is_tessera_path(path)
            if tessera and path in SECTIONS and isinstance(value, Mapping):
                self.walk(value, path + ".")
            elif path in KEYS:
                if self.internevo or not tessera:  # tessera's own keys keep their meaning in tessera files
                    KEYS[path].handle(self, path, value)
            elif path in SECTIONS and not tessera:
                if isinstance(value, Mapping):
                    self.walk(value, path + ".", internevo_only=True)
                else:
                    self.refuse(path, value, "InternEvo's section: expected a dict")
                self.drop(path)
            elif internevo_only:  # inside a section only InternEvo has: a key InternEvo does not define there
                self.refuse(path, value, f"unknown key{suggest(name, internevo_names(prefix.rstrip('.')))}")
            # anything else is tessera's to validate (an unknown key gets the closest valid name there)

    def report(self) -> None:
        """Raise every refusal together; otherwise log what was mapped and accepted (one line each)."""
        if self.refusals:
            lines = "\n  ".join(self.refusals)
            what = "an InternEvo config" if self.internevo else "a config"
            n = len(self.refusals)
            raise ConfigError(f"{n} setting{'s' * (n > 1)} of {what} that tessera cannot honour"
                              f"{where(self.source)}:\n  {lines}")
        name = self.source or "config"
        if self.mapped:
            logger.info("%s: InternEvo keys mapped: %s", name, "; ".join(self.mapped))
        if self.noops:
            logger.info("%s: InternEvo keys accepted as no-ops: %s", name, ", ".join(self.noops))
        if self.differences:
            logger.warning("%s: tessera differs from InternEvo here: %s", name, "; ".join(self.differences))


def translate_internevo(raw: Mapping[str, Any], source: str | None = None) -> dict[str, Any]:
    """``raw`` with every InternEvo key translated; a ConfigError lists every refusal at once."""
    t = Translation(raw, source)
    t.walk(t.raw)
    file_rules(t)
    t.report()
    return t.out
