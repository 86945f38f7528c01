"""Command-line validation of the scripts under tools/: a bad flag value is a clear error, not a traceback.

Every numeric flag is range-checked by argparse (``tessera.cli_args``): an out-of-range value exits
with status 2 and a message naming the flag and the value, before any checkpoint is read. Flags whose
validity depends on the checkpoint or config (``--tp`` must divide the heads, ``--vocab-size`` must
fit the model) end in an ``error: ...`` line and a non-zero status, not a traceback. The tools run
in this process through their ``main(argv)`` (a Python + torch start per call would cost ~2 s); two
runs go through a real interpreter to check the command line end to end.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import subprocess
import sys
from types import ModuleType

import pytest
import torch

from tessera import cli_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.py")
MISSING = os.path.join(ROOT, "no_such_checkpoint")  # argparse rejects the flag before this path is opened


# ---------------------------------------------------------------------------------------- the type callables
@pytest.mark.parametrize("fn, good, bad", [
    (cli_args.positive_int, ["1", "7", "+3"], ["0", "-4", "1.5", "abc", ""]),
    (cli_args.nonnegative_int, ["0", "40"], ["-1", "0.0", "x"]),
    (cli_args.random_seed, ["0", str(2**64 - 1)], ["-1", str(2**64), "1e3"]),
    (cli_args.off_or_int_at_least(2), ["0", "2", "100"], ["1", "-1", "-2"]),
    (cli_args.positive_float, ["1e-9", "3"], ["0", "-0.0", "-1", "nan", "inf", "one"]),
    (cli_args.nonnegative_float, ["0", "0.0", "2.5"], ["-1e-9", "nan", "inf", "-inf"]),
    (cli_args.probability, ["1", "1.0", "1e-6", "0.95"], ["0", "1.0000001", "-0.5", "nan"]),
    (cli_args.fraction, ["0", "0.01", "0.999"], ["1", "-1e-9", "1.5", "nan"]),
])
def test_type_callables_accept_the_boundaries_and_reject_just_outside(fn, good, bad):
    for text in good:
        assert fn(text) == pytest.approx(float(text)), text
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError):
            fn(text)


def test_ints_stay_ints_and_floats_floats():
    assert type(cli_args.positive_int("3")) is int and type(cli_args.random_seed("3")) is int
    assert type(cli_args.probability("1")) is float and type(cli_args.nonnegative_float("0")) is float


@pytest.mark.parametrize("fn, text, message", [
    (cli_args.positive_int, "-4", "-4 is not a positive integer (must be >= 1)"),
    (cli_args.positive_int, "abc", "'abc' is not an integer"),
    (cli_args.nonnegative_int, "-1", "-1 is not a non-negative integer (must be >= 0)"),
    (cli_args.random_seed, "-1", "-1 is not a valid seed (must be in [0, 2**64 - 1])"),
    (cli_args.off_or_int_at_least(2), "1", "1 is not valid (must be 0 = off, or >= 2)"),
    (cli_args.nonnegative_float, "-0.5", "-0.5 is not a non-negative number (must be >= 0)"),
    (cli_args.nonnegative_float, "nan", "nan is not a finite number"),
    (cli_args.positive_float, "0", "0 is not a positive number (must be > 0)"),
    (cli_args.probability, "0", "0 is not in (0, 1]"),
    (cli_args.fraction, "1", "1 is not in [0, 1)"),
])
def test_messages_say_the_value_and_the_allowed_range(fn, text, message):
    with pytest.raises(argparse.ArgumentTypeError) as err:
        fn(text)
    assert str(err.value) == message


def test_cli_args_imports_nothing_from_tessera():
    """The tools import it before torch (``python -m benchmarks`` parses its flags before loading anything heavy)."""
    code = ("import sys, tessera.cli_args; "
            "print(sorted(m for m in sys.modules if m.startswith('tessera') or m == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['tessera', 'tessera.cli_args']"


# ---------------------------------------------------------------------------------------- tools, in process
@functools.cache
def _tool_module(name: str) -> ModuleType:
    if name == "benchmarks":  # ``python -m benchmarks``: its command line is benchmarks.cli.main
        return importlib.import_module("benchmarks.cli")
    spec = importlib.util.spec_from_file_location(f"_cli_tool_{name[:-3]}", os.path.join(ROOT, "tools", name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(capsys, name: str, *argv: str) -> tuple[int, str, str]:
    """``tools/<name>``'s ``main(argv)``: (exit status, stdout, stderr); argparse's SystemExit counts as a status."""
    capsys.readouterr()
    try:
        code = _tool_module(name).main(list(argv))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


BAD_FLAGS = [  # (tool, argv, the "argument --flag: value" that stderr must contain)
    ("generate.py", [MISSING, "--max-new-tokens", "-4"], "argument --max-new-tokens: -4 is not a positive integer"),
    ("generate.py", [MISSING, "--max-new-tokens", "0"], "argument --max-new-tokens: 0 "),
    ("generate.py", [MISSING, "--temperature", "-0.5"], "argument --temperature: -0.5 "),
    ("generate.py", [MISSING, "--temperature", "nan"], "argument --temperature: nan "),
    ("generate.py", [MISSING, "--top-k", "-1"], "argument --top-k: -1 "),
    ("generate.py", [MISSING, "--top-p", "0"], "argument --top-p: 0 is not in (0, 1]"),
    ("generate.py", [MISSING, "--top-p", "1.5"], "argument --top-p: 1.5 "),
    ("generate.py", [MISSING, "--seed", "-1"], "argument --seed: -1 "),
    ("generate.py", [MISSING, "--threads", "0"], "argument --threads: 0 "),
    ("convert_checkpoint.py", [MISSING, "out", "--tp", "0"], "argument --tp: 0 "),
    ("convert_checkpoint.py", [MISSING, "out", "--dp", "-2"], "argument --dp: -2 "),
    ("import_hf.py", [MISSING, "out", "--tp", "0"], "argument --tp: 0 "),
    ("export_hf.py", [MISSING, "out", "--vocab-size", "0"], "argument --vocab-size: 0 "),
    ("model_summary.py", [TINY, "--tp", "0"], "argument --tp: 0 "),
    ("model_summary.py", [TINY, "--seq-len", "-1"], "argument --seq-len: -1 "),
    ("precision_report.py", ["--config", TINY, "--zero1", "0"], "argument --zero1: 0 "),
    ("precision_report.py", ["--config", TINY, "--zero1", "-1"], "argument --zero1: -1 "),
    ("prepare_data.py", ["--input", MISSING, "--output", "out", "--valid-fraction", "1"],
     "argument --valid-fraction: 1 is not in [0, 1)"),
    ("prepare_data.py", ["--input", MISSING, "--output", "out", "--valid-fraction", "-0.1"],
     "argument --valid-fraction: -0.1 "),
    ("prepare_data.py", ["--input", MISSING, "--output", "out", "--valid-every-nth", "1"],
     "argument --valid-every-nth: 1 "),
    ("plan.py", [TINY, "--mfu", "2"], "argument --mfu: 2 is not in (0, 1]"),
    ("plan.py", [TINY, "--mfu", "0"], "argument --mfu: 0 "),
    ("plan.py", [TINY, "--world", "0"], "argument --world: 0 "),
    ("plan.py", [TINY, "--rank", "-1"], "argument --rank: -1 "),
    ("plan.py", [TINY, "--search", "--gpus", "0"], "argument --gpus: 0 "),
    ("plan.py", [TINY, "--search", "--memory", "-80"], "argument --gpu-memory/--memory: -80 "),
    ("plan.py", [TINY, "--search", "--top", "0"], "argument --top: 0 "),
    ("benchmarks", ["--threads", "0"], "argument --threads: 0 "),
    ("benchmarks", ["dp", "--rounds", "0"], "argument --rounds: 0 "),
    ("benchmarks", ["activations", "--tp", "0"], "argument --tp: 0 "),
]


@pytest.mark.parametrize("name, argv, message", BAD_FLAGS, ids=[f"{t}:{' '.join(a[-2:])}" for t, a, _ in BAD_FLAGS])
def test_out_of_range_flags_exit_2_naming_the_flag_and_value(capsys, name, argv, message):
    code, out, err = _run(capsys, name, *argv)
    assert code == 2, (code, err)
    assert message in err, err
    assert "Traceback" not in err and out == ""


def test_evaluate_names_an_include_path_that_is_not_a_folder(capsys, tmp_path):
    """lm-eval skips a missing task folder without a word and then knows no such task: the tool says why, as
    train.py does for eval.include_path, before lm-eval or the checkpoint is read."""
    (tmp_path / "tasks.yaml").write_text("task: my_task\n")
    for folder in (tmp_path / "no_such_folder", tmp_path / "tasks.yaml"):
        code, out, err = _run(capsys, "evaluate.py", MISSING, "--tasks", "my_task", "--include-path", str(folder))
        assert (code, out) == (1, "") and err.splitlines() == [f"error: --include-path {folder}: not a folder"], err


def test_convert_tp_without_dst_is_a_usage_error(capsys):
    code, _, err = _run(capsys, "convert_checkpoint.py", MISSING, "--consolidate", "x.safetensors", "--tp", "2")
    assert code == 2 and "--tp/--dp set the layout of DST" in err, err


# ---------------------------------------------------------------------------------------- a real checkpoint
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    """configs/tiny.py's model (4 heads, vocab 256) saved untrained at TP=1 by the training-time saver."""
    from tessera.checkpoint import Layout, Progress, TrainState, save_checkpoint
    from tessera.config import Config
    from tessera.model import build_model

    cfg = Config.from_file(TINY)
    model = build_model(cfg.model, seed=0)
    return save_checkpoint(str(tmp_path_factory.mktemp("cli") / "ckpt"), 1, TrainState(model, progress=Progress(1)),
                           config=cfg.to_dict(), layout=Layout())


def test_generate_accepts_the_boundary_values(capsys, ckpt):
    code, out, err = _run(capsys, "generate.py", ckpt, "--tokenizer", "byte", "--prompt", "ab", "--max-new-tokens",
                          "1", "--temperature", "0", "--top-k", "0", "--top-p", "1", "--seed", "0")
    assert code == 0, err
    assert out.startswith("ab") and "1 tokens in" in err


def test_generate_picks_one_thread_for_a_small_model_and_says_so(capsys, ckpt):
    """A decode step of a small model is too little work to split: threads only wait for each other."""
    gen = _tool_module("generate.py")
    assert gen.default_threads(900_000, 2) == 1 and gen.default_threads(10**6, 64) == 1
    assert gen.default_threads(7 * 10**9, 16) == 16 and gen.default_threads(100_000_000, 16) == 4
    before = torch.get_num_threads()
    code, _, err = _run(capsys, "generate.py", ckpt, "--tokenizer", "byte", "--max-new-tokens", "2")
    assert code == 0 and "threads: 1 (default for 0." in err, err
    code, _, err = _run(capsys, "generate.py", ckpt, "--tokenizer", "byte", "--max-new-tokens", "2", "--threads", "2")
    assert code == 0 and "threads: 2 (--threads)" in err, err
    assert torch.get_num_threads() == before  # the caller's setting is given back


def test_flags_the_checkpoint_rules_out_give_an_error_line(capsys, ckpt, tmp_path):
    code, _, err = _run(capsys, "convert_checkpoint.py", ckpt, str(tmp_path / "tp3"), "--tp", "3")
    assert code == 1 and err.startswith("error: ") and "TP=3" in err and "Traceback" not in err, err
    code, _, err = _run(capsys, "export_hf.py", ckpt, str(tmp_path / "hf"), "--vocab-size", "257")
    assert code == 1 and err.startswith("error: --vocab-size 257 must be in [1, model.vocab_size=256]"), err


def test_flags_the_config_rules_out_give_an_error_line(capsys, tmp_path):
    code, _, err = _run(capsys, "model_summary.py", TINY, "--tp", "3")
    assert code == 2 and err.startswith("error: ") and "not divisible by tensor-parallel size 3" in err, err
    code, _, err = _run(capsys, "benchmarks", "--tiny", "--out", str(tmp_path / "b.md"),
                        "model.hidden_size=-1")
    assert code == 2 and "error: override model.hidden_size=-1: model.hidden_size: must be > 0, got -1" in err \
        and "Traceback" not in err, err
    assert not (tmp_path / "b.md").exists()


# ---------------------------------------------------------------------------------------- real command lines
@pytest.mark.parametrize("argv, message", [
    (["tools/generate.py", MISSING, "--max-new-tokens", "-4"],
     "generate.py: error: argument --max-new-tokens: -4 is not a positive integer (must be >= 1)"),
    (["-m", "benchmarks", "--threads", "-2"],
     "python -m benchmarks: error: argument --threads: -2 is not a positive integer"),
])
def test_command_line_exits_2_with_the_argparse_message(argv, message):
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and proc.stdout == ""


def test_python_m_benchmarks_lists_every_measurement():
    """The benchmarks live in benchmarks/ only and run as ``python -m benchmarks`` from the repository root."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "python -m benchmarks precision-study" in proc.stdout and "python -m benchmarks activations" in proc.stdout
    assert not [f for f in os.listdir(os.path.join(ROOT, "tools")) if "bench" in f or "study" in f]


def test_model_summary_counts_in_a_readable_unit(capsys):
    summary = _tool_module("model_summary.py")
    assert [summary.short_count(n) for n in (512, 919_168, 915_410_944, 7_321_423_872)] == [
        "512", "919.17 K", "915.41 M", "7.32 B"]
    code, out, _ = _run(capsys, "model_summary.py", os.path.join(ROOT, "configs", "demo.py"))
    assert code == 0 and "parameters: 919,168 (919.17 K)" in out and " B)" not in out
