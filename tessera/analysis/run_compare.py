"""Runs side by side, from nothing but the ``metrics.jsonl`` that train.py writes (``tools/compare_runs.py``).

A run is one metric of one record kind (``train`` loss by default; ``valid`` for the held-out losses,
``eval`` for the lm-eval scores, ``<task>/<metric>``) by step; records of other kinds are read past. Two runs
are compared step by step, bitwise or within ``atol + rtol * |reference|`` (numpy's ``isclose`` rule; a NaN
equals only a NaN), and report the first step where they part and their largest gap. Runs of one setting with
different seeds form a group; a group's figure is each run's last logged value, or the mean of its last
``window`` logged values, and groups are set against a baseline group with Welch's interval over the seeds
(``seed_stats``) and, where both ran the same seeds, with the paired interval of the per-seed differences.
A run's seed is the ``seed`` of its metrics.jsonl's ``event`` records (train.py writes it at start), else
the number in a ``seed<N>`` part of its path (``runs/bf16_seed7``, ``study/nvfp4/seed7/run``): runs written
before the seed was logged pair by their folder names.

What a run may leave behind is read as train.py means it: a step logged twice (a run resumed from an
earlier checkpoint repeats the steps after it) counts with its last record, and a line cut short (a run
killed mid-write) is skipped with a note. Anything else that is not a JSON object per line is an error
naming the file and line.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from tessera.analysis.seed_stats import Paired, Welch, mean, paired_interval, sample_std, welch_interval

__all__ = ["CompareError", "Series", "Group", "Difference", "GroupSummary", "metrics_path", "read_series",
           "expand_paths", "parse_group", "short_labels", "same_bits", "first_difference", "largest_difference",
           "shared_steps", "window_value", "summarize", "verdict", "moving_average", "METRICS_FILE",
           "WindowMismatch", "SeedPairs", "pair_by_seed", "seed_in_path", "with_seed"]

METRICS_FILE = "metrics.jsonl"
WITHIN_NOISE, DIFFERS = "within seed noise", "differs"


class CompareError(Exception):
    """Input that cannot be compared (a missing, empty or corrupt file, runs of different lengths): one line."""


class WindowMismatch(CompareError):
    """The runs' last ``window`` logged steps are not the same steps: no group figure compares like with like."""


@dataclass(frozen=True)
class Series:
    """One metric of one record kind of one run, in step order."""

    path: str  # the metrics.jsonl it came from
    steps: tuple[int, ...]
    values: tuple[float, ...]
    notes: tuple[str, ...] = ()  # what was read leniently (torn lines), for the tool to print
    label: str = ""
    seed: int | None = None  # the run's seed, None where neither its records nor its path tell it
    seed_from: str = ""  # where the seed was read: "metrics.jsonl", "folder name", or a caller's source

    def by_step(self) -> dict[int, float]:
        return dict(zip(self.steps, self.values))


@dataclass(frozen=True)
class Group:
    """Runs of one setting, one per seed."""

    name: str
    runs: tuple[Series, ...]


def metrics_path(location: str) -> str:
    """The metrics.jsonl of a run: the file itself, ``<folder>/metrics.jsonl``, or the one
    ``<folder>/<job_name>/metrics.jsonl`` under a log folder (train.py's ``log_folder``)."""
    if os.path.isfile(location):
        return location
    if not os.path.isdir(location):
        raise CompareError(f"{location}: no such file or folder")
    direct = os.path.join(location, METRICS_FILE)
    if os.path.isfile(direct):
        return direct
    below = sorted(glob.glob(os.path.join(glob.escape(location), "*", METRICS_FILE)))
    if len(below) == 1:
        return below[0]
    if below:
        raise CompareError(f"{location}: several runs below it ({', '.join(below)}): name one")
    raise CompareError(f"{location}: no {METRICS_FILE} there (pass <log_folder>/<job_name> of a run, or the file)")


_WORDS = ("null", "true", "false", "NaN", "Infinity", "-Infinity")  # the literals json.dumps writes


def _cut_short(text: str, e: json.JSONDecodeError) -> bool:
    """Whether the text ends inside its object (a write cut short): the decoder ran out of text, inside a
    string (no closing quote before the end), or inside a literal (``"loss": Na``)."""
    rest = text[e.pos:]
    return text.startswith("{") and (e.pos >= len(text) or e.msg.startswith("Unterminated string")
                                     or any(w.startswith(rest) and rest != w for w in _WORDS))


def _parse_line(path: str, number: int, line: str, notes: list[str]) -> dict[str, Any] | None:
    """The record of one line; None for a blank or torn one (which adds a note)."""
    text = line.strip()
    if not text:
        return None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        if _cut_short(text, e):
            notes.append(f"{path}:{number}: a line cut short (a run killed mid-write) skipped")
            return None
        raise CompareError(f"{path}:{number}: not a JSON line ({e.msg})") from None
    if not isinstance(record, dict):
        raise CompareError(f"{path}:{number}: not a JSON object")
    return record


def _value(path: str, number: int, record: dict[str, Any], metric: str) -> tuple[int, float]:
    step, value = record.get("step"), record.get(metric)
    if not isinstance(step, int) or isinstance(step, bool):
        raise CompareError(f"{path}:{number}: a {record.get('kind')} record without an integer 'step'")
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        numeric = sorted(k for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool))
        raise CompareError(f"{path}:{number}: no number '{metric}' in this {record.get('kind')} record "
                           f"(its numbers: {', '.join(numeric)})")
    return step, float(value)


_SEED_PART = re.compile(r"(?:.*[^a-z0-9])?seed[-_=]?(\d+)", re.IGNORECASE)  # seed7, bf16_seed7, seed=7


def seed_in_path(path: str) -> int | None:
    """The N of the deepest folder of ``path`` named ``seed<N>`` or ``<anything>_seed<N>`` (also ``-``, ``=``)."""
    for part in reversed(os.path.normpath(os.path.dirname(os.path.abspath(path))).split(os.sep)):
        found = _SEED_PART.fullmatch(part)
        if found:
            return int(found.group(1))
    return None


def _record_seed(record: dict[str, Any]) -> int | None:
    """The seed an ``event`` record of train.py carries, if any."""
    seed = record.get("seed")
    if record.get("kind") != "event" or not isinstance(seed, int) or isinstance(seed, bool):
        return None
    return seed


def _run_seed(path: str, logged: set[int], notes: list[str]) -> tuple[int | None, str]:
    """The run's seed and where it was read: its records' (one seed), else its path's; a run whose records
    name several seeds (resumed under another seed) has none, with a note."""
    if len(logged) == 1:
        return next(iter(logged)), "metrics.jsonl"
    if logged:
        notes.append(f"{path}: its records name several seeds ({', '.join(map(str, sorted(logged)))}): not paired")
        return None, ""
    seed = seed_in_path(path)
    return (seed, "folder name") if seed is not None else (None, "")


def with_seed(run: Series, seed: int, source: str) -> Series:
    """The run with a seed its caller knows (a study's own record of what it launched)."""
    return replace(run, seed=seed, seed_from=source)


def read_series(location: str, kind: str = "train", metric: str = "loss") -> Series:
    """``metric`` by step from the ``kind`` records of a run's metrics.jsonl, and the run's seed."""
    path = metrics_path(location)
    notes: list[str] = []
    by_step: dict[int, float] = {}
    kinds: set[str] = set()
    seeds: set[int] = set()
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                record = _parse_line(path, number, line, notes)
                if record is None:
                    continue
                kinds.add(str(record.get("kind")))
                seed = _record_seed(record)
                if seed is not None:
                    seeds.add(seed)
                if record.get("kind") == kind:
                    step, value = _value(path, number, record, metric)
                    by_step[step] = value  # a repeated step (a resumed run): the last record counts
    except UnicodeDecodeError:
        raise CompareError(f"{path}: not UTF-8 text") from None
    except OSError as e:
        raise CompareError(f"{path}: cannot read it ({e.strerror or e})") from None
    if not kinds:
        raise CompareError(f"{path}: empty (no records)")
    if not by_step:
        raise CompareError(f"{path}: no kind='{kind}' records (its kinds: {', '.join(sorted(kinds))})")
    steps = tuple(sorted(by_step))
    seed, seed_from = _run_seed(path, seeds, notes)
    return Series(path, steps, tuple(by_step[s] for s in steps), tuple(notes), seed=seed, seed_from=seed_from)


def expand_paths(spec: str) -> list[str]:
    """Comma-separated run locations, each a path or a glob (sorted); a glob matching nothing is an error."""
    out: list[str] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        if glob.has_magic(part):
            matched = sorted(glob.glob(part))
            if not matched:
                raise CompareError(f"{part}: the pattern matches no file or folder")
            out += matched
        else:
            out.append(part)
    if not out:
        raise CompareError(f"{spec!r}: no run named")
    return out


def parse_group(text: str) -> tuple[str, list[str]]:
    """``NAME=PATH[,PATH...]`` (paths or globs) -> (name, run locations)."""
    name, sep, spec = text.partition("=")
    if not sep or not name.strip():
        raise CompareError(f"--group {text}: expected NAME=PATH[,PATH...] (paths or globs)")
    return name.strip(), expand_paths(spec)


def short_labels(paths: Sequence[str]) -> list[str]:
    """Per run, the shortest trailing part of its folder that no other run's folder ends with
    (``bf16_seed1/tessera`` beside ``bf16_seed2/tessera``; ``moved`` beside both)."""
    folders = [os.path.normpath(os.path.dirname(os.path.abspath(p))).split(os.sep) for p in paths]
    labels = []
    for i, parts in enumerate(folders):
        others = [f for j, f in enumerate(folders) if j != i]
        depth = 1
        while depth < len(parts) and any(f[-depth:] == parts[-depth:] for f in others):
            depth += 1
        labels.append("/".join(parts[-depth:]))
    return labels


def same_bits(a: float, b: float) -> bool:
    """Bitwise equality of two doubles (NaN equals NaN of the same bits; -0.0 is not 0.0)."""
    return struct.pack("<d", a) == struct.pack("<d", b)


def _close(reference: float, value: float, rtol: float, atol: float) -> bool:
    if same_bits(reference, value):
        return True
    if not (math.isfinite(reference) and math.isfinite(value)):
        return False
    return abs(value - reference) <= atol + rtol * abs(reference)


class Difference(NamedTuple):
    """The first step where a run leaves its reference; a None value: the step is missing from that run."""

    step: int
    reference: float | None
    value: float | None


def first_difference(reference: Series, other: Series, rtol: float = 0.0, atol: float = 0.0) -> Difference | None:
    """The first step (in either run) that is missing from one, or whose values differ: bitwise when
    ``rtol == atol == 0``, else beyond ``atol + rtol * |reference|``. None: the runs agree at every step."""
    ref, val = reference.by_step(), other.by_step()
    for step in sorted(set(ref) | set(val)):
        r, v = ref.get(step), val.get(step)
        if r is None or v is None or not _close(r, v, rtol, atol):
            return Difference(step, r, v)
    return None


def largest_difference(reference: Series, other: Series) -> tuple[int, float] | None:
    """(step, |value - reference|) of the widest gap over the steps both runs have (NaN gaps count as inf)."""
    ref = reference.by_step()
    gaps = [(s, abs(v - ref[s]) if not math.isnan(v - ref[s]) else (0.0 if same_bits(v, ref[s]) else math.inf))
            for s, v in zip(other.steps, other.values) if s in ref]
    return max(gaps, key=lambda g: g[1]) if gaps else None


def shared_steps(runs: Sequence[Series]) -> list[int]:
    """The steps every run has."""
    common = set(runs[0].steps)
    for r in runs[1:]:
        common &= set(r.steps)
    return sorted(common)


def window_value(run: Series, window: int) -> float:
    """The mean of a run's last ``window`` logged values (its last value for 1)."""
    return mean(run.values[-window:])


class SeedPairs(NamedTuple):
    """A group against the baseline run by run of the same seed: the seeds paired (in the baseline's run
    order), the paired interval of their differences, or why there is none."""

    seeds: tuple[int, ...]
    interval: Paired | None
    why_not: str = ""  # one line, where there is no interval
    unpaired: int = 0  # runs of either group with no run of their seed in the other, left out


class GroupSummary(NamedTuple):
    """A group's figure per seed and over its seeds, and against the baseline (None: no interval possible)."""

    name: str
    values: tuple[float, ...]  # one per run: its last value or window mean
    mean: float
    std: float  # over seeds, n - 1 in the denominator
    steps: tuple[int, int]  # the first and last step of the window
    vs_baseline: Welch | None
    seeds: tuple[int | None, ...] = ()  # each run's seed (None: not known)
    paired: SeedPairs | None = None  # against the baseline by seed; None for the baseline itself


def _seed_problem(name: str, seeds: Sequence[int | None]) -> str:
    """Why the runs of a group cannot be paired by seed ('' when they can)."""
    if all(s is None for s in seeds):
        return (f"the seeds of {name}'s runs are not known (no seed in their metrics.jsonl records, no seed<N> in "
                "their folder names)")
    twice = sorted({s for s in seeds if s is not None and seeds.count(s) > 1})
    if twice:
        return f"seed {twice[0]} names {seeds.count(twice[0])} runs of {name}: which pairs with which is not known"
    return ""


def _seed_list(seeds: Sequence[int | None]) -> str:
    return ", ".join("?" if s is None else str(s) for s in seeds)


def pair_by_seed(name: str, values: Sequence[float], seeds: Sequence[int | None], baseline: str,
                 base_values: Sequence[float], base_seeds: Sequence[int | None],
                 confidence: float = 0.95) -> SeedPairs:
    """The group's runs against the baseline's runs of the same seed (same initial weights, same data order):
    the paired interval of the per-seed differences where 2 seeds or more are shared."""
    problem = _seed_problem(name, seeds) or _seed_problem(baseline, base_seeds)
    if problem:
        return SeedPairs((), None, f"not available: {problem}")
    mine = {s: v for s, v in zip(seeds, values) if s is not None}
    shared = tuple(s for s in base_seeds if s is not None and s in mine)
    unpaired = len(values) + len(base_values) - 2 * len(shared)
    if len(shared) < 2:
        which = "no seed" if not shared else f"one seed only ({shared[0]})"
        return SeedPairs(shared, None, f"not available: {name} and {baseline} share {which} (seeds "
                         f"{_seed_list(seeds)} against {_seed_list(base_seeds)}); a paired interval needs 2",
                         unpaired)
    theirs = {s: v for s, v in zip(base_seeds, base_values)}
    interval = paired_interval([mine[s] for s in shared], [theirs[s] for s in shared], confidence)
    return SeedPairs(shared, interval, "", unpaired)


def _window_steps(groups: Sequence[Group], window: int) -> tuple[int, int]:
    """The steps the window covers, the same in every run (else comparing them would mix steps)."""
    runs = [r for g in groups for r in g.runs]
    first = runs[0].steps[-window:]
    for r in runs[1:]:
        span = r.steps[-window:]
        if span != first:
            raise WindowMismatch(f"{r.path}: its last {window} logged steps ({span[0]}..{span[-1]}, {len(span)} "
                               f"logged) are not those of {runs[0].path} ({first[0]}..{first[-1]}, "
                               f"{len(first)} logged): compare runs of the same length and logging")
    return first[0], first[-1]


def summarize(groups: Sequence[Group], baseline: str, window: int = 1, confidence: float = 0.95) -> list[GroupSummary]:
    """Each group's last-value (or ``window``-mean) statistics over its seeds, and its difference from
    ``baseline`` with Welch's interval where both have 2 runs or more."""
    names = [g.name for g in groups]
    if baseline not in names:
        raise CompareError(f"--baseline {baseline}: no such group (the groups: {', '.join(names)})")
    span = _window_steps(groups, window)
    per_group = {g.name: tuple(window_value(r, window) for r in g.runs) for g in groups}
    seeds = {g.name: tuple(r.seed for r in g.runs) for g in groups}
    base = per_group[baseline]
    out = []
    for g in groups:
        values = per_group[g.name]
        welch = (welch_interval(values, base, confidence)
                 if g.name != baseline and len(values) >= 2 and len(base) >= 2 else None)
        pairs = (None if g.name == baseline else
                 pair_by_seed(g.name, values, seeds[g.name], baseline, base, seeds[baseline], confidence))
        out.append(GroupSummary(g.name, values, mean(values), sample_std(values), span, welch, seeds[g.name], pairs))
    return out


def verdict(interval: Welch | Paired | None) -> str:
    """'within seed noise' when the interval holds 0, else 'differs'; why not, when there is no interval."""
    if interval is None:
        return "no interval: needs 2 runs (seeds) or more in the group and the baseline"
    return WITHIN_NOISE if interval.contains_zero() else DIFFERS


def moving_average(values: Sequence[float], n: int) -> list[float]:
    """Trailing mean over the last ``n`` values (fewer at the start): the smoothed view of a curve."""
    return [math.fsum(values[max(0, i + 1 - n):i + 1]) / min(i + 1, n) for i in range(len(values))]
