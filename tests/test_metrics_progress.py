"""Long waits are visible: validation runs under a bar of its own, and the training bar's clock leaves it out.

The demo's final validation reads its whole held-out set (minutes on a CPU); before, the training bar sat at
100% with its elapsed time running on through it and nothing said what was happening. Checked here on the
logger itself (the bars, their clocks) and on one real ``train.py`` run of synthetic data, whose validation
reports no bits per byte (random ids stand for no text).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tessera.train.metrics import MetricsWriter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VALUES = {"loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "loss_scale": 1, "skipped_steps": 0, "tgs": 10.0,
          "tflops": 0.0, "mfu": 0.0, "step_time": 0.1, "consumed_tokens": 8, "peak_mem_gib": 0.0}


def test_validation_gets_a_bar_and_the_training_clock_leaves_it_out(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # the bars are drawn only on a terminal
    log = MetricsWriter(str(tmp_path), True, total_steps=3, tensorboard=False, progress_bar=True)
    log.log_train(1, VALUES, line=False)
    now = [1000.0]  # the training bar's clock, advanced by hand: no wall-clock figure decides the verdict
    bar = log._bar
    bar._time = lambda: now[0]
    bar.start_t = bar.last_print_t = now[0]

    def batch(i):
        now[0] += 30.0  # each validation batch takes 30 s on that clock
        return i

    seen = list(log.progress((batch(i) for i in range(3)), 3, desc="validation"))
    assert seen == [0, 1, 2] and now[0] == 1090.0
    assert bar.start_t == 1090.0  # the bar's start moved by the 90 s of validation: they are not training time
    assert "validation" in capsys.readouterr().err
    log.log_train(3, VALUES, line=False)
    assert log._bar is None  # closed at its total: nothing redraws it during the final validation
    assert list(log.progress(iter("ab"), 2)) == ["a", "b"]  # the validation bar still shows after training
    assert "valid:" in capsys.readouterr().err
    log.close()


def test_output_to_a_file_or_pipe_gets_lines_and_no_bar(tmp_path, capsys):
    """stderr captured here is no terminal, as a log redirected to a file: a bar's redraws would run into the
    step lines there, so the lines come alone, and a validation pass is announced by a line of its own."""
    assert not sys.stderr.isatty()
    log = MetricsWriter(str(tmp_path), True, total_steps=2, tensorboard=False, progress_bar=True)
    assert log._bar is None
    log.log_train(1, VALUES)
    assert list(log.progress(iter("abc"), 3, desc="validation")) == ["a", "b", "c"]
    log.log_train(2, VALUES)
    log.close()
    out, err = capsys.readouterr()
    assert err == "" and "\r" not in out
    lines = out.splitlines()
    assert len(lines) == 3 and lines[0].startswith("step 1 |") and lines[2].startswith("step 2 |")
    assert lines[1] == "validation: 3 batches"


def test_without_bars_validation_batches_pass_through_untouched(tmp_path):
    items = [1, 2]
    assert MetricsWriter(str(tmp_path), True, 3, tensorboard=False, progress_bar=False).progress(items, 2) is items
    assert MetricsWriter(str(tmp_path), False, 3).progress(items, 2) is items  # other ranks


def test_a_synthetic_run_shows_validation_and_reports_no_bits_per_byte(tmp_path):
    log_folder = tmp_path / "logs"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--config", "configs/tiny.py",
                           "data.total_steps=2", f"log_folder='{log_folder}'", "job_name='t'"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "validation: 8 batches" in proc.stdout.splitlines()  # no bar into a pipe: a line says it
    assert "\r" not in proc.stdout + proc.stderr  # no bar redraws running into the lines
    rows = [json.loads(line) for line in (log_folder / "t" / "metrics.jsonl").read_text().splitlines()]
    valid = [r for r in rows if r["kind"] == "valid"]
    assert valid and "bits_per_token" in valid[-1] and "bits_per_byte" not in valid[-1]
    assert "bits_per_byte" not in proc.stdout + proc.stderr
