"""``model.compile.enabled='auto'`` (the default): compiled blocks on CUDA, eager on the CPU, overridable.

Measured (docs/compile.md, BENCHMARKS.md section 11): on an H200 the compiled 1B step took 0.76x the eager one;
on 2 CPU cores the compiled step is 0.80-0.95x but its compilation costs 8-25 s, more than a short run saves.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from tessera import logs
from tessera.config import Config, ConfigError
from tessera.core.job import Job
from tessera.train import builder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.py")


@pytest.mark.parametrize("device,setting,hooks,expected", [
    ("cuda", "auto", False, True),
    ("cpu", "auto", False, False),
    ("meta", "auto", False, False),  # a dry run: the blocks stay eager (compile_blocks skips meta anyway)
    ("cuda", "auto", True, False),  # the precision telemetry hooks module outputs inside the blocks
    ("cpu", True, False, True),
    ("cuda", False, False, False),
])
def test_auto_compiles_on_cuda_only(device, setting, hooks, expected, monkeypatch, caplog):
    monkeypatch.setattr(logs, "_LOGGED", set())
    over = [f"model.compile.enabled={setting!r}"]
    if hooks:
        over += ["metrics.precision_every=5", "metrics.precision_activations=True"]
    cfg = Config.from_file(TINY, over)
    with caplog.at_level(logging.INFO, logger="tessera"):
        assert builder.compile_enabled(cfg, Job.of(cfg, device=torch.device(device))) is expected
    lines = [r.getMessage() for r in caplog.records if "model.compile.enabled='auto'" in r.getMessage()]
    assert len(lines) == (setting == "auto")
    if lines:
        assert ("compiled blocks on" if expected else "compiled blocks off") in lines[0]


def test_the_default_is_auto_and_other_values_are_refused():
    assert Config.from_file(TINY).model.compile.enabled == "auto"
    with pytest.raises(ConfigError, match="model.compile.enabled"):
        Config.from_file(TINY, ["model.compile.enabled='yes'"])
