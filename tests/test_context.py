"""Process groups, launchers and RNG streams of the parallel context (gloo, spawned CPU processes)."""

import os

import pytest
import torch
import torch.distributed as dist

from harness.distributed import WorkerError, free_port, run_distributed
from tessera.config import ConfigError
from tessera.core.launch import expand_slurm_nodelist


def cfg_dict(tp=1, zero1=-1, dtype="torch.float32"):
    return dict(
        model=dict(num_layers=1, hidden_size=64, num_attention_heads=8, vocab_size=64, dtype=dtype),
        parallel=dict(tensor=dict(size=tp), zero1=dict(size=zero1)),
        data=dict(type="synthetic", seq_len=16),
    )


def expected_layout(rank, world, tp, zero1):
    """Independent statement of the contract: contiguous TP, strided DP, ZERO1 = consecutive DP chunks."""
    dp = world // tp
    z = dp if zero1 == -1 else zero1
    tp_rank, dp_rank = rank % tp, rank // tp
    tensor = [dp_rank * tp + i for i in range(tp)]
    data = [tp_rank + j * tp for j in range(dp)]
    chunk = dp_rank // z
    zero = data[chunk * z:(chunk + 1) * z]
    return {"tensor": tensor, "data": data, "zero1": zero, "global": list(range(world))}


def combos(world):
    for tp in (1, 2, 4, 8):
        if world % tp:
            continue
        dp = world // tp
        for zero1 in (-1, 1, 2):
            if zero1 == -1 or dp % zero1 == 0:
                yield tp, zero1


def _groups_worker(rank, world):
    """Build every layout; read each group's membership by a real all_gather over that group."""
    from tessera.core.context import ParallelMode, gpc, launch_from_torch
    from tessera.core.job import Job
    from tessera.core.launch import new_groups
    from tessera.core.layout import Layout

    results = {}
    for i, (tp, zero1) in enumerate(combos(world)):
        if i == 0:
            launch_from_torch(cfg_dict(tp, zero1), seed=7)
        else:  # the same job relaid: new groups, and the run description that holds them
            gpc.job = Job.of(cfg_dict(tp, zero1), new_groups(tp, zero1), layout=Layout.of(world, tp, zero1, rank))
        seen = {}
        for mode in ParallelMode:
            group = gpc.get_group(mode)
            members = [None] * gpc.get_world_size(mode)
            dist.all_gather_object(members, rank, group=group)
            seen[mode.value] = (members, gpc.get_local_rank(mode), gpc.get_ranks_in_group(mode))
        results[(tp, zero1)] = seen
    gpc.destroy()
    return results


WORLDS = (1, 2, 4, 8)
LAYOUTS = sorted({(world, tp) for world in WORLDS for tp, _ in combos(world)})


@pytest.fixture(scope="module")
def group_runs():
    """``group_runs(world)``: every rank's observations of every layout of that world size (one spawn per world)."""
    cache = {}

    def get(world):
        if world not in cache:
            try:
                cache[world] = run_distributed(_groups_worker, world, init_process_group=False, timeout=300)
            except Exception as e:  # noqa: BLE001 - a failed spawn fails every test that reads it, once
                cache[world] = e
        if isinstance(cache[world], BaseException):
            raise cache[world]
        return cache[world]

    return get


@pytest.mark.parametrize("world,tp", [pytest.param(w, t, marks=[pytest.mark.slow] if w == 8 else [])  # 8 processes
                                      for w, t in LAYOUTS], ids=[f"world{w}-tp{t}" for w, t in LAYOUTS])
def test_group_membership(group_runs, world, tp):
    results = group_runs(world)
    checked = 0
    for rank, per_combo in enumerate(results):
        for (t, zero1), seen in per_combo.items():
            if t != tp:
                continue
            want = expected_layout(rank, world, tp, zero1)
            for mode, (members, local_rank, ranks) in seen.items():
                assert members == want[mode], (world, tp, zero1, rank, mode)
                assert ranks == want[mode]
                assert local_rank == want[mode].index(rank)
                checked += 1
    assert checked == world * sum(t == tp for t, _ in combos(world)) * 4


def test_the_rank_layout_type_gives_the_same_groups():
    """``tessera.core.layout.Layout`` (what the checkpoint code and the plan take) places each rank in the groups
    ``gpc`` builds, and checkpoint/plan use that one type."""
    from tessera.checkpoint import Layout as CheckpointLayout
    from tessera.core.layout import Layout, ParallelMode

    assert CheckpointLayout is Layout
    for world in (1, 2, 4, 8):
        for tp, zero1 in combos(world):
            for rank in range(world):
                lay = Layout.of(world, tp, zero1, rank)
                want = expected_layout(rank, world, tp, zero1)
                assert (lay.tp_rank, lay.dp_rank, lay.tp_size * lay.dp_size) == (rank % tp, rank // tp, world)
                assert lay.zero1_size == len(want["zero1"])
                mine = {mode.value: next(g for g in groups if rank in g) for mode, groups in lay.groups().items()}
                assert mine == want, (world, tp, zero1, rank)
                assert mine[ParallelMode.TENSOR.value].index(rank) == lay.tp_rank
                assert mine[ParallelMode.DATA.value].index(rank) == lay.dp_rank
    with pytest.raises(ConfigError):
        Layout.of(6, 4)


def _slurm_worker(rank, world, port):
    from tessera.core.context import ParallelMode, gpc, launch_from_slurm

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)
    os.environ.update(SLURM_PROCID=str(rank), SLURM_NPROCS=str(world), SLURM_LOCALID=str(rank),
                      SLURM_JOB_NODELIST="127.0.0.1")
    launch_from_slurm(cfg_dict(tp=2), port=port, seed=3)  # host taken from the nodelist
    out = {m.value: gpc.get_ranks_in_group(m) for m in ParallelMode}
    out["world"] = dist.get_world_size()
    gpc.destroy()
    return out


def _torch_worker(rank, world):
    from tessera.core.context import ParallelMode, gpc, launch_from_torch

    launch_from_torch(cfg_dict(tp=2), seed=3)
    out = {m.value: gpc.get_ranks_in_group(m) for m in ParallelMode}
    out["world"] = dist.get_world_size()
    gpc.destroy()
    return out


def test_slurm_launch_matches_torchrun():
    slurm = run_distributed(_slurm_worker, 2, free_port(), init_process_group=False)
    torchrun = run_distributed(_torch_worker, 2, init_process_group=False)
    assert slurm == torchrun
    assert slurm[0]["tensor"] == [0, 1] and slurm[0]["world"] == 2


def test_slurm_nodelist_expansion():
    assert expand_slurm_nodelist("gpu[01-03,07],cpu5") == ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]
    assert expand_slurm_nodelist("node7") == ["node7"]


def _bad_world_worker(rank, world):
    from tessera.core.context import launch_from_torch

    try:
        launch_from_torch(cfg_dict(tp=4), seed=1)
    except ConfigError as e:
        return str(e)
    return "no error"


def test_world_size_not_tp_times_dp_fails_on_every_rank():
    # world 2 with tp 4: each rank raises before any rendezvous, so nothing can hang
    msgs = run_distributed(_bad_world_worker, 2, init_process_group=False, timeout=300)
    for m in msgs:
        assert "world size 2 is not a multiple of parallel.tensor.size=4" in m


def _dropout_worker(rank, world):
    from tessera.core.context import ParallelMode, gpc, launch_from_torch

    launch_from_torch(cfg_dict(tp=2), seed=11)
    x = torch.ones(256)
    outside = torch.nn.functional.dropout(x, 0.5)
    with gpc.seed(ParallelMode.TENSOR):
        inside = torch.nn.functional.dropout(x, 0.5)
    outside_after = torch.nn.functional.dropout(x, 0.5)

    # entering the TENSOR stream must not advance the ambient (DATA) stream: replay without it
    gpc.set_seed(11)
    replay_first = torch.nn.functional.dropout(x, 0.5)
    replay_second = torch.nn.functional.dropout(x, 0.5)

    # RNG states round-trip (as a checkpoint would save and restore them)
    states = gpc.get_rng_states()
    a = (torch.rand(4), __import__("random").random(), __import__("numpy").random.rand())
    with gpc.seed(ParallelMode.TENSOR):
        a_tensor = torch.rand(4)
    gpc.set_seed(999)
    gpc.set_rng_states(states)
    b = (torch.rand(4), __import__("random").random(), __import__("numpy").random.rand())
    with gpc.seed(ParallelMode.TENSOR):
        b_tensor = torch.rand(4)
    gpc.destroy()
    return dict(outside=outside, inside=inside, outside_after=outside_after, replay=(replay_first, replay_second),
                roundtrip=(torch.equal(a[0], b[0]) and a[1] == b[1] and a[2] == b[2] and torch.equal(a_tensor, b_tensor)))


def test_dropout_masks_follow_rng_contract():
    r = run_distributed(_dropout_worker, 4, init_process_group=False)  # tp=2 x dp=2: TP groups {0,1},{2,3}
    # outside TP regions: identical within a TP group, different across DP ranks
    assert torch.equal(r[0]["outside"], r[1]["outside"]) and torch.equal(r[2]["outside"], r[3]["outside"])
    assert not torch.equal(r[0]["outside"], r[2]["outside"])
    # inside the TENSOR stream: different on every rank, TP peers included
    for i in range(4):
        for j in range(i + 1, 4):
            assert not torch.equal(r[i]["inside"], r[j]["inside"])
    for x in r:
        assert torch.equal(x["outside"], x["replay"][0]) and torch.equal(x["outside_after"], x["replay"][1])
        assert x["roundtrip"]


def _raising_worker(rank, world):
    if rank == 1:
        raise RuntimeError("boom on rank 1")
    dist.barrier()  # rank 0 would wait forever for rank 1: the helper must not hang


def test_helper_propagates_failure_without_hanging():
    with pytest.raises(WorkerError, match="boom on rank 1"):
        run_distributed(_raising_worker, 2, timeout=300)
