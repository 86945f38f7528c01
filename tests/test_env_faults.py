"""Environment faults ("Ready for the cluster"): one error line each, on every rank, a non-zero exit, and
nothing already saved lost.

- No space left while saving a checkpoint: every rank stops with one line naming the folder, the bytes
  the checkpoint needs and the bytes free, and the last complete checkpoint; the partial folder is
  removed and every step folder left behind loads. Run on a small tmpfs where this machine can mount one
  (root), and with safetensors' own "No space left on device" injected into one rank's write otherwise.
- A log, checkpoint or data-cache folder that cannot be created or written: found before training
  starts, one line naming the key and the path.
- Preparing data whose documents all tokenize to nothing: an error naming the inputs, no token folder.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness.distributed import run_distributed, run_torchrun
from harness.failure import explain
from tessera.checkpoint import (
    CheckpointError,
    Layout,
    Progress,
    TrainState,
    find_resumable_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_meta,
    read_tree,
    save_checkpoint,
    verify_files,
)
from tessera.files import folder_write_problem

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 2**20
# a hang guard, not a speed requirement: a job (gloo processes or a torchrun launch) still running after this is
# hung, and fails; generous, as a loaded 2-core machine can take minutes
HANG_GUARD_S = 150


# ------------------------------------------------------------------------------------------ tmpfs
@contextlib.contextmanager
def small_tmpfs(path, size_bytes: int, read_only: bool = False):
    """A tmpfs of ``size_bytes`` mounted at ``path`` (skips the test where mounting is not allowed)."""
    os.makedirs(path, exist_ok=True)
    opts = f"size={size_bytes}" + (",ro" if read_only else "")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield str(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


# ------------------------------------------------------------------------------------------ save: gloo job
def _build(rank: int, seed: int):
    from tessera.core.naive_amp import NaiveAMPModel, unwrap_model
    from tessera.optim.hybrid_zero import HybridZeroOptimizer

    torch.manual_seed(seed)
    # ~66k parameters: a checkpoint of ~0.9 MiB (bf16 weights, fp32 masters and Adam moments in 2 ZeRO files)
    model = NaiveAMPModel(nn.Sequential(nn.Linear(64, 512), nn.Tanh(), nn.Linear(512, 64)), dtype="bf16",
                          sync_buffer=False)
    opt = HybridZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01), dp_group=dist.group.WORLD,
                              zero1_group=dist.group.WORLD, global_group=dist.group.WORLD)
    state = TrainState(unwrap_model(model), opt, progress=Progress())
    return model, opt, state


def _train_step(model, opt, rank, world, step):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(4 * world, 64, generator=g).chunk(world)[rank], torch.randn(4, 64, generator=g)
    opt.backward((model(x).float() - y).pow(2).mean())
    assert opt.step()[0]


def _save_job(rank: int, world: int, folder: str, inject: bool) -> dict:
    """Save step 1, then step 2 into a folder that runs out of space (a small tmpfs, or an injected
    ENOSPC in rank 1's optimizer file); then resume and load every step folder left behind."""
    from safetensors import SafetensorError

    from tessera.checkpoint import tree as ckpt_tree

    layout = Layout(global_rank=rank, world_size=world, dp_rank=rank, dp_size=world, zero1_size=world)
    model, opt, state = _build(rank, 0)
    out: dict = {}
    for step in (1, 2):
        _train_step(model, opt, rank, world, step)
        state.components["progress"].step = step
        real = ckpt_tree.save_file
        if inject and step == 2 and rank == 1:
            def full(tensors, path, metadata=None):
                if "optim_" in os.path.basename(path):
                    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
                return real(tensors, path, metadata=metadata)
            ckpt_tree.save_file = full
        try:
            save_checkpoint(folder, step, state, config=None, layout=layout)
            out[step] = None
        except CheckpointError as e:
            out[step] = (str(e), e.every_rank)
        finally:
            ckpt_tree.save_file = real
    dist.barrier()
    out["listing"] = sorted(os.listdir(folder))
    _, _, state2 = _build(rank, 5)
    path, _ = find_resumable_checkpoint(folder, layout, load=lambda p: load_checkpoint(p, state2, layout=layout))
    out["resumed"] = os.path.basename(path)
    for p in list_checkpoints(folder):  # every step folder left behind loads
        load_checkpoint(p, _build(rank, 6)[2], layout=layout)
    return out


_SPACE = r"the checkpoint needs at least (\d+) bytes \([^)]*\), (\d+) bytes \([^)]*\) free"


def _check_no_space(outs, folder):
    for rank, out in enumerate(outs):
        assert out[1] is None, out[1]
        assert out[2] is not None, f"rank {rank}: the save of step 2 did not fail"
        message, every_rank = out[2]
        assert every_rank and "\n" not in message, message
        assert message.startswith(f"cannot save step 2 in {folder}: "), message
        assert "No space left on device" in message, message
        assert re.search(_SPACE, message), message
        assert message.endswith(f"the last complete checkpoint is {os.path.join(folder, 'step_1')}"), message
        assert out["listing"] == ["step_1"], out["listing"]  # the partial step_2 removed
        assert out["resumed"] == "step_1"
    assert outs[0][2] == outs[1][2]  # the same line on every rank


def test_no_space_injected_into_one_ranks_write(tmp_path):
    """safetensors' ENOSPC on rank 1 only (rank 0 wrote its files): both ranks stop together, nothing hangs."""
    folder = str(tmp_path / "ckpt")
    outs = run_distributed(_save_job, 2, folder, True, timeout=HANG_GUARD_S)
    _check_no_space(outs, folder)
    assert "rank 1: " in outs[0][2][0] and "rank 0: " not in outs[0][2][0]


def test_no_space_on_a_small_tmpfs(tmp_path):
    with small_tmpfs(tmp_path / "small", int(1.5 * MIB)) as mnt:
        folder = os.path.join(mnt, "ckpt")
        outs = run_distributed(_save_job, 2, folder, False, timeout=HANG_GUARD_S)
        _check_no_space(outs, folder)
        found = re.search(_SPACE, outs[0][2][0])
        needed, free = int(found.group(1)), int(found.group(2))
        assert 0.5 * MIB < needed < 1.5 * MIB and free < needed, (needed, free)  # step 1's ~0.9 MiB left < 0.6 MiB


# ------------------------------------------------------------------------------------------ save: train.py
COMMON = ["data.type='synthetic'", "metrics.progress_bar=False", "metrics.tensorboard=False", "data.seq_len=32",
          "data.micro_bsz=1", "parallel.zero1.size=2", "generate.max_new_tokens=0", "lr_scheduler.total_steps=4"]


def _train(tmp, *overrides, timeout=HANG_GUARD_S):
    return run_torchrun([os.path.join(ROOT, "train.py"), "--config", os.path.join(ROOT, "configs", "tiny.py"),
                         *COMMON, f"log_folder='{tmp}/logs'", *overrides], nproc_per_node=2, timeout=timeout,
                        cwd=str(tmp))


def _error_lines(proc, rank):
    return [line for line in proc.stderr.splitlines() if line.startswith(f"[rank {rank}] error:")]


@pytest.mark.slow
def test_train_py_stops_on_every_rank_when_the_checkpoint_disk_fills(tmp_path):
    """The tiny model's checkpoint is ~1.7 MiB: a 3 MiB tmpfs holds step 1, not step 2 next to it."""
    with small_tmpfs(tmp_path / "small", 3 * MIB) as mnt:
        ckpt = os.path.join(mnt, "ckpt")
        proc = _train(tmp_path, "ckpt.enable_save_ckpt=True", f"ckpt.save_ckpt_folder='{ckpt}'",
                      "ckpt.checkpoint_every=1", "data.total_steps=3")
        assert proc.returncode not in (0, 124), explain(proc)
        for rank in (0, 1):
            lines = _error_lines(proc, rank)
            assert len(lines) == 1, explain(proc)
            line = lines[0]
            assert f"cannot save step 2 in {ckpt}" in line and "No space left on device" in line, line
            assert "needs at least" in line and "free" in line, line
            assert line.endswith(f"the last complete checkpoint is {ckpt}/step_1"), line
        assert "training failed" not in proc.stderr, explain(proc)
        assert sorted(os.listdir(ckpt)) == ["step_1"]
        step1 = os.path.join(ckpt, "step_1")
        meta = read_meta(step1)
        verify_files(step1, list(meta["files"]), meta)
        for name in meta["files"]:
            read_tree(os.path.join(step1, name))


# ------------------------------------------------------------------------------------------ folders
def _train_module():
    """The repository's train.py as a module (a script at the root, not part of the package)."""
    spec = importlib.util.spec_from_file_location("_train_for_env_faults", os.path.join(ROOT, "train.py"))
    module = importlib.util.module_from_spec(spec)
    # registered before it runs: its dataclasses resolve their (string) annotations through sys.modules
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_folder_write_problem_names_what_failed(tmp_path):
    assert folder_write_problem(tmp_path / "new" / "deep") is None and os.path.isdir(tmp_path / "new" / "deep")
    assert folder_write_problem("/proc/x") == "cannot create /proc/x: No such file or directory"
    (tmp_path / "file").write_text("x")
    assert folder_write_problem(tmp_path / "file") == f"{tmp_path / 'file'} exists and is not a folder"
    assert folder_write_problem(tmp_path / "file" / "sub").startswith(f"cannot create {tmp_path / 'file' / 'sub'}: ")
    assert os.listdir(tmp_path / "new" / "deep") == []  # the write probe is gone


def test_folder_write_problem_on_a_read_only_filesystem(tmp_path):
    with small_tmpfs(tmp_path / "ro", MIB, read_only=True) as ro:
        assert folder_write_problem(ro) == f"cannot write in {ro}: Read-only file system"
        assert folder_write_problem(os.path.join(ro, "sub")) == f"cannot create {ro}/sub: Read-only file system"


@pytest.mark.parametrize("key", ["log_folder", "ckpt.save_ckpt_folder", "data.cache_folder"])
def test_every_output_folder_is_checked_naming_its_key(tmp_path, key):
    from tessera.config import Config

    train = _train_module()
    base = {"model": {"num_layers": 1, "hidden_size": 8, "num_attention_heads": 2, "vocab_size": 258},
            "data": {"type": "stdlib", "cache_folder": str(tmp_path / "cache")}, "log_folder": str(tmp_path / "logs"),
            "ckpt": {"enable_save_ckpt": True, "save_ckpt_folder": str(tmp_path / "ckpt")}}
    assert train.output_folder_problem(Config.from_dict(base)) is None
    section, _, name = key.rpartition(".")
    bad = dict(base)
    if section:
        bad[section] = {**base[section], name: "/proc/x"}
    else:
        bad[name] = "/proc/x"
    assert train.output_folder_problem(Config.from_dict(bad)) == f"{key}=/proc/x: cannot create /proc/x: " \
                                                                 "No such file or directory"


def test_train_py_reports_an_unwritable_checkpoint_folder_on_every_rank_before_training(tmp_path):
    proc = _train(tmp_path, "ckpt.enable_save_ckpt=True", "ckpt.save_ckpt_folder='/proc/x'", "data.total_steps=2")
    assert proc.returncode not in (0, 124), explain(proc)  # 124: a hang (HANG_GUARD_S)
    for rank in (0, 1):
        assert _error_lines(proc, rank) == [f"[rank {rank}] error: ckpt.save_ckpt_folder=/proc/x: cannot create "
                                            "/proc/x: No such file or directory"], explain(proc)
    assert "step 1 |" not in proc.stdout + proc.stderr  # nothing trained


# ------------------------------------------------------------------------------------------ data preparation
def _prepare(*args):
    spec = importlib.util.spec_from_file_location("_prepare_data_tool", os.path.join(ROOT, "tools", "prepare_data.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = module.main(list(args))
    return code, out.getvalue(), err.getvalue()


def test_inputs_that_tokenize_to_nothing_are_an_error_naming_them(tmp_path):
    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / "a.txt").write_text("")
    (inputs / "b.jsonl").write_text('{"text": ""}\n{"text": ""}\n')
    out = tmp_path / "out"
    code, stdout, stderr = _prepare("--input", str(inputs), "--output", str(out), "--quiet")
    assert code == 2, (stdout, stderr)
    assert stderr.startswith("error: every train document tokenizes to nothing (3 documents from "), stderr
    assert str(inputs / "a.txt") in stderr and str(inputs / "b.jsonl") in stderr and ".jsonl:" not in stderr
    assert not out.exists() and os.listdir(tmp_path) == ["in"]  # no token folder, no temporary leftovers


def test_a_held_out_split_of_empty_documents_is_an_error_too(tmp_path):
    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / "docs.jsonl").write_text('{"text": "some text"}\n{"text": ""}\n' * 3)
    code, _, stderr = _prepare("--input", str(inputs), "--output", str(tmp_path / "out"), "--valid-every-nth", "2",
                               "--quiet")
    assert code == 2 and "every valid document tokenizes to nothing (3 documents" in stderr, stderr
    code, stdout, stderr = _prepare("--input", str(inputs), "--output", str(tmp_path / "out"), "--quiet")
    assert code == 0 and "train: 6 documents" in stdout, (stdout, stderr)  # some empty documents are fine
