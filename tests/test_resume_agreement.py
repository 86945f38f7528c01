"""Resuming when one rank's own file of a checkpoint is damaged or missing ("Ready for the cluster").

Each rank reads only some files of a step folder (its RNG file, its ZeRO rank's optimizer file, its TP
rank's model shard). Before any collective of a load, every rank checks those files and all ranks agree
on the verdict: either they fall back together to the newest step every rank can read, or they stop
together with one error line naming the step, the file and the rank that found it. Without that
agreement the healthy ranks wait in the optimizer's ZeRO all-gather while the damaged one waits in the
fallback agreement: a hang until the collective timeout (30 minutes by default).

Gloo jobs of 2 and 4 ranks (ZeRO over the whole DP group, over halves of it, and off) run through
``harness.distributed.run_distributed``; two ``train.py`` launches under torchrun (DP=2, ZeRO=2) check the
whole path a user sees. Every job is bounded by ``HANG_GUARD_S`` (a hang fails the test; how fast a resume
is, is not asserted: on a loaded machine that measures the machine).
"""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness.distributed import run_distributed, run_torchrun
from harness.failure import explain
from harness.state import HeldState
from tessera.checkpoint import (
    CheckpointError,
    Layout,
    Progress,
    TrainState,
    find_resumable_checkpoint,
    load_checkpoint,
    save_checkpoint,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a hang guard, not a speed requirement: a job (per resume scenario set, or a torchrun launch) neither finished nor
# stopped after this is hung, as the healthy ranks would be in the ZeRO all-gather without the agreement
HANG_GUARD_S = 180


# ------------------------------------------------------------------------------------------ gloo jobs
def _flip(path: str) -> None:
    data = bytearray(open(path, "rb").read())
    at = len(data) // 2
    data[at : at + 4] = bytes(b ^ 0xFF for b in data[at : at + 4])
    with open(path, "wb") as f:
        f.write(bytes(data))


def _truncate_listed(path: str) -> None:
    """Cut the file's data in half and list the result in meta.json: it passes the size and checksum
    verification, so only reading its tensors' bytes finds the damage (on the ranks that read them)."""
    import json

    from tessera.checkpoint.meta import file_entry, write_meta

    with open(path, "rb") as f:
        data = f.read()
    header = 8 + int.from_bytes(data[:8], "little")
    with open(path, "wb") as f:
        f.write(data[: header + (len(data) - header) // 2])
    meta_path = os.path.join(os.path.dirname(path), "meta.json")
    with open(meta_path) as f:
        meta = json.load(f)
    meta["files"][os.path.basename(path)] = file_entry(path)
    write_meta(os.path.dirname(path), meta)  # with a new self-digest


def _damage(path: str, how: str) -> None:
    if how == "flip":
        _flip(path)
    elif how == "truncate_listed":
        _truncate_listed(path)
    else:
        os.remove(path)


def _job(rank: int, world: int, zeros: list[int], folder: str) -> dict:
    """``_case`` for each ZeRO size in turn (one job: a spawn costs more than a case)."""
    # every rank creates every group, in the same order
    groups = {z: [dist.new_group(list(range(s, s + z))) for s in range(0, world, z)] for z in zeros if z < world}
    return {z: _case(rank, world, z, groups[z][rank // z] if z in groups else dist.group.WORLD, f"{folder}_zero{z}")
            for z in zeros}


def _case(rank: int, world: int, zero: int, zero_group, folder: str) -> dict:
    """Train and save steps 1 and 2, then resume from damaged copies of them; what each rank saw."""
    from tessera.core.naive_amp import NaiveAMPModel, unwrap_model
    from tessera.optim.hybrid_zero import HybridZeroOptimizer

    whole = dist.group.WORLD
    layout = Layout(global_rank=rank, world_size=world, dp_rank=rank, dp_size=world, zero1_size=zero)

    def build(seed):
        torch.manual_seed(seed)
        model = NaiveAMPModel(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)), dtype="bf16",
                              sync_buffer=False)
        opt = HybridZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=0.05), dp_group=whole,
                                  zero1_group=zero_group, global_group=whole)
        state = TrainState(unwrap_model(model), opt, progress=Progress())
        state.register("rng", HeldState({"t": torch.full((3,), float(rank))}), per_rank=True)
        return model, opt, state

    model, opt, state = build(0)
    saved = {}
    for step in (1, 2):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4 * world, 6, generator=g).chunk(world)[rank], torch.randn(4, 3, generator=g)
        opt.backward((model(x).float() - y).pow(2).mean())
        assert opt.step()[0]
        state.components["progress"].step = step
        save_checkpoint(folder, step, state, config=None, layout=layout)
        saved[step] = [p.detach().float().clone() for p in model.parameters()]

    last = world - 1
    # the last rank's own file, and the optimizer file of its ZeRO rank (checked by every rank of its TP rank)
    per_rank = {"rng": f"rng_rank{last}.safetensors", "optim": f"optim_tp0_zero{last % zero}.safetensors"}
    scenarios = {  # name -> damage per step: {step: (file, how)}
        "flip_rng": {2: (per_rank["rng"], "flip")},
        "missing_rng": {2: (per_rank["rng"], "delete")},
        "flip_optim": {2: (per_rank["optim"], "flip")},
        "truncated_listed_optim": {2: (per_rank["optim"], "truncate_listed")},
        "no_step_readable": {2: (per_rank["optim"], "delete"), 1: (per_rank["rng"], "flip")},
    }
    out = {}
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("tessera").addHandler(handler)
    for name, damage in scenarios.items():
        copy = f"{folder}_{name}"
        if rank == 0:
            shutil.copytree(folder, copy)
            for step, (file, how) in damage.items():
                _damage(os.path.join(copy, f"step_{step}", file), how)
        dist.barrier()
        records.clear()
        model2, _, state2 = build(7)
        try:
            path, _ = find_resumable_checkpoint(
                copy, layout, load=lambda p, s=state2: load_checkpoint(p, s, layout=layout))
            result = os.path.basename(path)
            error = None
        except CheckpointError as e:
            result, error = None, str(e)
        same = None
        if result:
            step = int(result.split("_")[1])
            same = all(torch.equal(p.detach().float(), q) for p, q in zip(model2.parameters(), saved[step]))
            same = same and torch.equal(state2.per_rank["rng"].state["t"], torch.full((3,), float(rank)))
        out[name] = {"resumed": result, "error": error, "weights_match": same,
                     "warnings": [r.getMessage() for r in records if r.levelno >= logging.WARNING],
                     "damage": {s: os.path.join(copy, f"step_{s}", f) for s, (f, _) in damage.items()}}
    logging.getLogger("tessera").removeHandler(handler)
    return out


def _readers(world: int, file: str) -> list[int]:
    """The ranks that check ``file`` (DP = world, TP = 1, same layout): its own rank for an RNG file,
    every rank for an optimizer file (each verifies all ZeRO files of its TP rank, reads its ranges)."""
    if file.startswith("rng_rank"):
        return [int(file[len("rng_rank"):].split(".")[0])]
    return list(range(world))


def _rank_tag(ranks: list[int], world: int) -> str:
    """How the error exchange names the ranks that reported a text (none when every rank did)."""
    if len(ranks) == world:
        return ""
    return f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}: "


@pytest.mark.parametrize("world,zeros", [(2, [2, 1]), (4, [4, 2, 1])], ids=["dp2", "dp4"])
def test_one_ranks_bad_file_makes_every_rank_fall_back_or_stop_together(tmp_path, world, zeros):
    """A damaged or missing file of the newest step (the last rank's own RNG file, or the optimizer file of
    its ZeRO rank), with ZeRO over all DP ranks, over halves of them and off: every rank resumes from step 1
    with its weights and RNG state, and every rank logs the file and the rank(s) that found it. With the
    other step unreadable too, every rank raises one error naming both steps and files. No resume hangs
    (without the agreement, the ZeRO cases wait in a collective until the hang guard ends the job)."""
    outs = run_distributed(_job, world, zeros, str(tmp_path / "ckpt"), timeout=HANG_GUARD_S * len(zeros))
    for rank, by_zero in enumerate(outs):
        for zero, scenarios in by_zero.items():
            for name, seen in scenarios.items():
                _check(seen, (rank, zero, name), world)


def _check(seen: dict, where: tuple, world: int) -> None:
    bad = seen["damage"]
    if len(bad) == 2:  # no step readable: one error, naming every step and file
        assert seen["resumed"] is None and seen["error"], (where, seen)
        assert "\n" not in seen["error"] and "no usable checkpoint" in seen["error"], seen["error"]
        for step, path in bad.items():
            assert f"step_{step}" in seen["error"], seen["error"]
            assert _rank_tag(_readers(world, os.path.basename(path)), world) + path in seen["error"], seen["error"]
        return
    assert seen["resumed"] == "step_1" and seen["error"] is None, (where, seen)
    assert seen["weights_match"], where
    path = bad[2]
    tag = _rank_tag(_readers(world, os.path.basename(path)), world)
    assert any(tag + path in w and "falling back" in w for w in seen["warnings"]), (where, seen["warnings"])


# ------------------------------------------------------------------------------------------ agreement helper
def _exchange(rank: int, world: int, cases: list) -> list:
    from tessera.checkpoint.agreement import exchange_errors
    from tessera.parallel.coordination import agree_on_errors

    checkpoint = [exchange_errors(errors[rank]) for errors in cases]  # the checkpoint's own flag, then the texts
    general = [agree_on_errors(errors[rank]) for errors in cases]
    assert checkpoint == general, (checkpoint, general)
    return checkpoint


def test_error_texts_reach_every_rank_grouped_by_text():
    cases = [[None, "b é", None, "b é"],  # non-ASCII survives the byte exchange
             [None, None, "x" * 5000, None],  # cut to tessera.parallel.coordination._TEXT_BYTES
             [None] * 4, ["same"] * 4, ["", None, None, None]]
    outs = run_distributed(_exchange, 4, cases, timeout=HANG_GUARD_S)
    assert outs == [[["ranks 1,3: b é"], ["rank 2: " + "x" * 2000], [], ["same"],
                     ["rank 0: failed without a message"]]] * 4


def test_the_agreement_and_the_error_exchange_follow_nccls_device_rule(tmp_path, monkeypatch):
    """On a default group that serves CUDA tensors only (torch's fake backend, as tests/test_nccl_rule.py
    sets it up), a failing load's agreement and error exchange run: no CPU tensor in any of them.

    The fake backend itself refuses only some CPU tensors under FakeTensorMode (``torch.tensor([x])``, not
    a fake CPU tensor of several elements), so every all-reduce is also checked for its device here."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from harness.fake_cuda import fake_cuda_mode
    from tessera.checkpoint.agreement import exchange_errors

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    (tmp_path / "step_3").mkdir()
    (tmp_path / "step_3" / "meta.json").write_text("{}")  # unreadable: every phase of the exchange runs
    state = TrainState(nn.Linear(2, 2))
    dist.init_process_group("cuda:fake", store=FakeStore(), rank=0, world_size=4)
    try:
        with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
            dist.all_reduce(torch.ones(1))  # the premise: a CPU tensor fails as on NCCL
        layout = Layout.of(4, 1, 4, 0)
        devices = []
        real_all_reduce = dist.all_reduce

        def nccl_all_reduce(t, *args, **kwargs):
            devices.append(t.device.type)
            if t.device.type != "cuda":
                raise RuntimeError("No backend type associated with device type cpu")
            return real_all_reduce(t, *args, **kwargs)

        monkeypatch.setattr(dist, "all_reduce", nccl_all_reduce)
        with fake_cuda_mode():
            assert exchange_errors("bad") == ["rank 0: bad"]  # a fake reduction answers with this rank's values
            with pytest.raises(CheckpointError, match="no usable checkpoint.*unsupported checkpoint format"):
                find_resumable_checkpoint(str(tmp_path), layout,
                                          load=lambda p: load_checkpoint(p, state, layout=layout))
        # the exchange (flag, lengths, bytes) three times: above, in the load, after the attempt
        assert devices == ["cuda"] * 9, devices
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ train.py
COMMON = ["data.type='synthetic'", "metrics.progress_bar=False", "metrics.tensorboard=False", "data.seq_len=32",
          "data.micro_bsz=1", "parallel.zero1.size=2", "ckpt.enable_save_ckpt=True", "ckpt.checkpoint_every=1",
          "generate.max_new_tokens=0", "lr_scheduler.total_steps=4"]


def _train(tmp, ckpt, steps, timeout=HANG_GUARD_S):
    return run_torchrun([os.path.join(ROOT, "train.py"), "--config", os.path.join(ROOT, "configs", "tiny.py"),
                         *COMMON, f"log_folder='{tmp}/logs'", f"ckpt.save_ckpt_folder='{ckpt}'",
                         f"data.total_steps={steps}"], nproc_per_node=2, timeout=timeout, cwd=str(tmp))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints of steps 1 and 2 of the tiny model at DP=2, ZeRO=2 (one optimizer file per rank)."""
    tmp = tmp_path_factory.mktemp("saved")
    proc = _train(tmp, str(tmp / "ckpt"), 2)
    assert proc.returncode == 0, explain(proc)
    assert os.path.isfile(tmp / "ckpt" / "step_2" / "optim_tp0_zero1.safetensors")
    return str(tmp / "ckpt")


def _copy(saved, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(saved, ckpt)
    return ckpt


@pytest.mark.slow
def test_train_py_falls_back_when_rank1s_rng_file_is_damaged(saved, tmp_path):
    ckpt = _copy(saved, tmp_path)
    bad = os.path.join(ckpt, "step_2", "rng_rank1.safetensors")
    _flip(bad)
    proc = _train(tmp_path, ckpt, 3)
    assert proc.returncode == 0, explain(proc)  # 124: a hang (HANG_GUARD_S)
    for rank in (0, 1):
        assert any(f"rank{rank} WARNING" in line and f"rank 1: {bad}" in line and "falling back" in line
                   for line in proc.stderr.splitlines()), explain(proc)
    assert f"resumed from {os.path.join(ckpt, 'step_1')} at step 1" in proc.stderr


def test_train_py_stops_with_one_error_line_when_no_step_is_readable_by_rank1(saved, tmp_path):
    ckpt = _copy(saved, tmp_path)
    os.remove(os.path.join(ckpt, "step_2", "rng_rank1.safetensors"))
    _flip(os.path.join(ckpt, "step_1", "optim_tp0_zero1.safetensors"))
    proc = _train(tmp_path, ckpt, 3)
    assert proc.returncode not in (0, 124), explain(proc)  # 124: a hang (HANG_GUARD_S)
    for rank in (0, 1):
        lines = [line for line in proc.stderr.splitlines() if line.startswith(f"[rank {rank}] error:")]
        assert len(lines) == 1, explain(proc)
        assert "no usable checkpoint" in lines[0] and "step_2" in lines[0] and "step_1" in lines[0], lines[0]
        assert "rank 1: " + os.path.join(ckpt, "step_2", "rng_rank1.safetensors") + " is missing" in lines[0]
        assert os.path.join(ckpt, "step_1", "optim_tp0_zero1.safetensors") + " is damaged" in lines[0]
    assert "training failed" not in proc.stderr, explain(proc)
