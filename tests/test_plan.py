"""The dry run and the plan: calibrated against real CPU steps, checked against closed forms, run at the
real 7B size, and failing on a CPU-tensor collective as NCCL would.

The reference for every traced figure is independent of the dry run: a real step of the same config on
gloo processes (live tensor bytes counted the same way), ``optimizer.memory_bytes()`` of real tensors,
and closed forms: the persistent bytes and the communication derived in the tests below from the
config's dims, and ``tessera.memory.activations`` for the activations.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from harness.distributed import run_distributed
from harness.failure import explain
from harness.peak_rss import run_measured
from tessera.config import Config
from tessera.plan import dry_run, make_plan, search_layouts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.py")
CPU_RULE = "No backend type associated with device type cpu"


def _tiny(*overrides: str) -> Config:
    return Config.from_file(TINY, ["data.micro_num=2", *overrides])


def _real_step_worker(rank: int, world: int, overrides: list[str], save_dir: str):
    """One real iteration on CPU gloo processes, traced exactly as the dry run traces its meta one."""
    from tessera.core.context import gpc, launch
    from tessera.plan import trace_iteration

    cfg = _tiny(*overrides, "dist.cpu_shm_allreduce='off'")  # its shared-memory buffers are a CPU-only path
    launch(cfg, rank=rank, world_size=world, init_method=None, backend="gloo")
    try:
        assert gpc.job is not None
        return trace_iteration(cfg, gpc.job, save_dir=save_dir)
    finally:
        gpc.destroy()


CALIBRATION = [  # (world, overrides): TP 1 and 2, DP 2, ZeRO 1 and 2, checkpointing on and off, bf16 and fp32
    (2, ["parallel.zero1.size=1", "model.checkpoint=False", "model.dtype='torch.float32'"]),
    (2, ["parallel.zero1.size=2", "model.checkpoint=True", "model.dtype='torch.bfloat16'"]),
    (2, ["parallel.tensor.size=2", "model.checkpoint='selective'", "model.dtype='torch.bfloat16'",
         "parallel.tensor.mode='msp'"]),
    pytest.param(4, ["parallel.tensor.size=2", "parallel.zero1.size=2", "model.checkpoint=False",
                     "model.dtype='torch.bfloat16'"], marks=pytest.mark.slow),
    pytest.param(4, ["parallel.tensor.size=2", "parallel.zero1.size=1", "model.checkpoint=True",
                     "model.dtype='torch.float32'"], marks=pytest.mark.slow),
]


@pytest.mark.parametrize("world,overrides", CALIBRATION, ids=lambda v: "-".join(v) if isinstance(v, list) else str(v))
def test_traced_peak_equals_a_real_cpu_step(world, overrides, tmp_path):
    """Rank 0's peak of live tensor bytes in a real CPU step (gloo) and in the dry run agree within 10%.

    The real step runs bf16 through torch's native CPU kernels: the fp32-upcast GEMMs some CPUs get
    (``tessera.parallel.gemm``'s cpu-upcast route) are a CPU kernel choice with other temporaries, not what a GPU runs.
    """
    real = run_distributed(_real_step_worker, world, overrides, str(tmp_path / "ckpt"), init_process_group=True,
                           env={"TESSERA_CPU_LOWP_MATMUL": "native"}, timeout=300)[0]
    planned = dry_run(_tiny(*overrides), world)
    for field in ("persistent_total", "backward_peak", "optimizer_peak", "step_peak"):
        assert getattr(planned, field) == pytest.approx(getattr(real, field), rel=0.10), field
    assert planned.persistent == real.persistent  # by role, exactly
    # the same collectives on the same groups, byte for byte (the loss scalars included)
    assert {g: {k: v for k, v in kinds.items()} for g, kinds in planned.comm.items()} == real.comm


def test_live_bytes_count_allocations_not_views_of_storages_made_elsewhere():
    import torch

    from tessera.plan.tracker import LiveBytes

    before = torch.ones(1000)
    live = LiveBytes()
    with live:
        view, made = before[:10], before.clone()
        made.mul_(2)
    assert (live.current, live.peak) == (4000, 4000)
    del view, made
    assert live.current == 0


def _gloo_reduce_scatter_worker(rank: int, world: int) -> tuple[int, int]:
    import torch
    import torch.distributed as dist

    from tessera.optim.groups import GroupComm
    from tessera.plan.tracker import LiveBytes

    flat = torch.ones(4096)
    live = LiveBytes()
    with live:
        GroupComm(dist.group.WORLD, world, rank).reduce_scatter_flat(flat, async_op=True).wait()
        GroupComm(dist.group.WORLD, world, rank).all_gather_flat(flat)
    return live.peak, int(flat.sum())


def test_gloo_private_copies_are_not_counted_as_the_step_s_memory():
    """gloo's reduce-scatter splits its own full-size copy of the input on the waiting thread; NCCL has
    none, and ZeRO's collectives work in place, so a real CPU step must count nothing for them."""
    for peak, total in run_distributed(_gloo_reduce_scatter_worker, 2):
        assert peak == 0 and total == 2 * 4096


# ---------------------------------------------------------------------------- closed forms derived here
# configs/tiny.py's dims: hidden 64, 4 query heads and 2 KV heads of 16, SwiGLU width 2.0 x 64 = 128 (a multiple
# of 16 already), vocab 256, no biases, an untied head; the batch of _tiny: micro_bsz 2 x seq 64, micro_num 2
HIDDEN, HEADS, KV_HEADS, FFN, VOCAB = 64, 4, 2, 128, 256
TOKENS, MICRO_NUM = 2 * 64, 2
ROLES = ("weights", "main_grads", "masters", "compensation", "optimizer_states")


def _params_per_tp_rank(layers: int, tp: int) -> dict[str, int]:
    """Parameters one TP rank holds, by part: the projections split over TP (column: wq, wk, wv, w1, w3; row:
    wo, w2), the embedding and the head split over the vocabulary, the RMSNorm weights replicated."""
    head_dim = HIDDEN // HEADS
    attention = (HEADS * head_dim + 2 * KV_HEADS * head_dim) * HIDDEN + HIDDEN * HEADS * head_dim
    mlp = 3 * FFN * HIDDEN
    return {"embedding": VOCAB * HIDDEN // tp, "layers": layers * (attention + mlp) // tp,
            "norms": layers * 2 * HIDDEN + HIDDEN, "output": VOCAB * HIDDEN // tp}


_D = 2  # ZeRO over the 2 DP ranks of world 4 at TP 2: masters, compensation and moments are sharded over it
# bytes per parameter by role: (a model-dtype parameter, an fp32 one). fp32 parameters are their own masters;
# the gradients are reduced in fp32 (hybrid_zero_optimizer.reduce_dtype's default); Adam keeps two moments
_FP32 = {"weights": 4, "main_grads": 4, "masters": 0, "compensation": 0, "optimizer_states": 2 * 4 / _D}
PERSISTENT_CASES = [  # (overrides, the parts kept fp32, bytes per model-dtype parameter)
    ([], ("embedding", "layers", "norms", "output"), _FP32),
    (["model.dtype='torch.bfloat16'"], (),
     {"weights": 2, "main_grads": 4, "masters": 4 / _D, "compensation": 0, "optimizer_states": 2 * 4 / _D}),
    # bf16 masters are the bf16 weights themselves; Kahan keeps a bf16 compensation per shard element
    (["model.dtype='torch.bfloat16'", "hybrid_zero_optimizer.master_dtype='bf16'",
      "hybrid_zero_optimizer.master_compensation='kahan'", "hybrid_zero_optimizer.optimizer_state_dtype='bf16'"], (),
     {"weights": 2, "main_grads": 4, "masters": 0, "compensation": 2 / _D, "optimizer_states": 2 * 2 / _D}),
    (["model.dtype='torch.float16'", "model.fp32_modules=['output']"], ("output",),
     {"weights": 2, "main_grads": 4, "masters": 4 / _D, "compensation": 0, "optimizer_states": 2 * 4 / _D}),
]


@pytest.mark.parametrize("overrides,fp32_parts,per_low", PERSISTENT_CASES, ids=["fp32", "bf16", "bf16-kahan", "fp16"])
def test_persistent_bytes_equal_the_closed_form(overrides, fp32_parts, per_low):
    """Rank 0's persistent bytes by role, derived above from the dims and the precision settings, against both
    columns of the plan: its closed form exactly, the dry run's traced tensors within ZeRO's shard padding."""
    plan = make_plan(_tiny("parallel.tensor.size=2", *overrides), 4)
    parts = _params_per_tp_rank(layers=2, tp=2)
    fp32 = sum(parts[p] for p in fp32_parts)
    low = sum(parts.values()) - fp32
    expected = {role: low * per_low[role] + fp32 * _FP32[role] for role in ROLES}
    for role in ROLES:
        assert plan.closed_form[role] == pytest.approx(expected[role]), role
        assert plan.traced[role] == pytest.approx(expected[role], rel=0.01, abs=64), role
    total = sum(expected.values())
    assert plan.closed_form["persistent"] == pytest.approx(total)
    assert plan.traced["persistent"] == pytest.approx(total, rel=0.01)
    # the activations: the dry run's live tensors against tessera.memory.activations (two computations)
    assert plan.traced["backward_extra"] == pytest.approx(plan.closed_form["backward_extra"], rel=0.25)


# TP collectives per layer, in units of one all-gather (or reduce-scatter) of the [tokens, hidden] activations over
# TP; an all-reduce is two. mtp: the row-parallel outputs (wo, w2) are all-reduced forward, the inputs' gradients
# of the column-parallel GEMMs (wq/wk/wv, w1/w3) backward. msp: each all-reduce is a gather before the column-
# parallel GEMM and a reduce-scatter after the row-parallel one, forward and (transposed) backward, and backward
# gathers again the sequence chunks the two column-parallel GEMMs kept for their weight gradients.
_FORWARD = {"mtp": {"attention output all-reduce": 2, "MLP output all-reduce": 2},
            "msp": {"attention input gather": 1, "attention output reduce-scatter": 1, "MLP input gather": 1,
                    "MLP output reduce-scatter": 1}}
_BACKWARD = {"mtp": {"attention input gradient all-reduce": 2, "MLP input gradient all-reduce": 2},
             "msp": {"attention input gradient reduce-scatter": 1, "attention output gradient gather": 1,
                     "MLP input gradient reduce-scatter": 1, "MLP output gradient gather": 1,
                     "attention input re-gather": 1, "MLP input re-gather": 1}}
# recomputation repeats what it re-runs: selective the two norms (under msp with the gathers after them); full the
# block up to its last saved tensor (torch's non-reentrant checkpoint stops before the MLP's output reduction)
_RECOMPUTED = {("mtp", False): 0, ("mtp", "selective"): 0, ("mtp", True): 2,
               ("msp", False): 0, ("msp", "selective"): 2, ("msp", True): 3}
# per micro-batch outside the blocks: the vocab-parallel embedding's all-reduce, the head input's gradient
# all-reduce; under msp the gather of the sequence before the head and the reduce-scatter of its input's
# gradient instead (the head fused with the loss, loss.chunk_tokens > 0 as by default, keeps the gathered
# input for its backward: no re-gather there)
_OUTSIDE = {"mtp": 2 + 2, "msp": 2 + 1 + 1}


@pytest.mark.parametrize("mode", ["mtp", "msp"])
@pytest.mark.parametrize("checkpoint", [False, "selective", True])
def test_communication_equals_the_closed_form(mode, checkpoint):
    """TP bytes per step of every mode x checkpointing (3 layers, so per-layer and fixed terms are both
    tested), and ZeRO's reduce-scatter + all-gather, counted above collective by collective from the dims,
    against the plan's closed form (exactly) and the dry run's traced collectives (which add the loss's few
    scalar all-reduces)."""
    cfg = _tiny("parallel.tensor.size=2", "model.num_layers=3", f"parallel.tensor.mode={mode!r}",
                f"model.checkpoint={checkpoint!r}")
    plan = make_plan(cfg, 4)
    tp, layers, fp32_bytes = 2, 3, 4
    unit = (tp - 1) / tp * TOKENS * HIDDEN * fp32_bytes  # ring all-gather: each rank sends all but its share
    per_layer = sum(_FORWARD[mode].values()) + sum(_BACKWARD[mode].values()) + _RECOMPUTED[(mode, checkpoint)]
    tensor = MICRO_NUM * (layers * per_layer + _OUTSIDE[mode]) * unit
    # ZeRO over 2 DP ranks: the fp32 gradients reduce-scattered, the fp32 weights all-gathered (ring: half each)
    n = sum(_params_per_tp_rank(layers, tp).values())
    zero = (_D - 1) / _D * 4 * n + (_D - 1) / _D * 4 * n
    for group, expected in (("TENSOR", tensor), ("ZERO1", zero)):
        assert plan.comm_closed_form[group] == pytest.approx(expected), group
        assert plan.comm_traced[group] == pytest.approx(expected, rel=0.01), group
    # the largest collective's buffer outside the persistent state: the TP activations in fp32 (mtp reduces
    # them in place; msp gathers the full tensor beside this rank's chunk); ZeRO works in place
    full = TOKENS * HIDDEN * fp32_bytes
    expected_buffer = full * (1 + 1 / tp) if mode == "msp" else full
    assert plan.traced["comm_buffer"] == plan.closed_form["comm_buffer"] == expected_buffer


def test_zero_collectives_need_no_buffer_of_their_own():
    """ZeRO's reduce-scatter and weight all-gather run in place in the persistent buffers: without TP,
    the only collective buffers of a step are the loss's and the agreements' scalars."""
    plan = make_plan(_tiny("parallel.zero1.size=2"), 2)
    assert plan.comm_traced["ZERO1"] > 0 and plan.closed_form["comm_buffer"] == 0
    assert plan.traced["comm_buffer"] <= 64


def _rejects_cpu(monkeypatch, module: str) -> None:
    """``module``'s agreements reduce a CPU tensor, as a framework that forgot NCCL's rule would."""
    import importlib

    from tessera.parallel import coordination

    mod = importlib.import_module(module)
    real = coordination.reduce_scalars

    def on_cpu(values, group, op=None, device=None, dtype=None):
        kwargs = {k: v for k, v in (("op", op), ("dtype", dtype)) if v is not None}
        return real(values, group, device=__import__("torch").device("cpu"), **kwargs)

    if hasattr(mod, "reduce_scalars"):
        monkeypatch.setattr(mod, "reduce_scalars", on_cpu)
        return

    def agree_on_cpu(ok, group=None):  # the module agrees through coordination.all_agree: the same flag, on the CPU
        return bool(on_cpu([1 if ok else 0], group, op=__import__("torch.distributed").distributed.ReduceOp.MIN)[0])

    monkeypatch.setattr(mod, "all_agree", agree_on_cpu)


@pytest.mark.parametrize("module", ["tessera.train.stop", "tessera.checkpoint.agreement", "tessera.train.step"])
def test_a_cpu_tensor_collective_anywhere_fails_the_dry_run(monkeypatch, module):
    """The stop agreement (train.stop), the checkpoint agreement (checkpoint.agreement) and the trainer's
    token sums run in the dry run on a group that serves no CPU tensors: moving any of them to the CPU
    fails it with NCCL's error. Unpatched, the same dry run passes (the other tests)."""
    _rejects_cpu(monkeypatch, module)
    with pytest.raises(RuntimeError, match=CPU_RULE):
        dry_run(_tiny("parallel.tensor.size=2"), 4)


def test_plan_counts_sdpa_masks_gqa_copies_and_the_runtime_allowance(monkeypatch):
    """A GPU without flash_attn, under a torch without its own varlen kernel, runs packed rows through SDPA:
    the plan counts its masks and expanded K/V in both columns (derived here from the dims: 3 layers, 3 rows
    of 60 tokens, 2 query heads of 16 per TP rank over 1 KV head, bf16), and both columns carry 1 GiB per
    NCCL communicator (world and TP group here) and 64 MiB of cuBLAS workspaces. With torch's varlen kernel
    the SDPA columns are empty as with flash_attn."""
    from tessera.memory import extras as memory_extras

    with_varlen = make_plan(_tiny("model.use_flash_attn=True", "model.dtype='torch.bfloat16'", "model.num_layers=3",
                                  "data.seq_len=60", "data.micro_bsz=3", "parallel.tensor.size=2"), 2, flash_attn=False,
                            trace=False)
    if memory_extras.torch_varlen()[0] is not None:
        assert (with_varlen.closed_form["sdpa_mask"], with_varlen.closed_form["gqa_kv"]) == (0, 0)
    monkeypatch.setattr(memory_extras, "torch_varlen", lambda: (None, "an older torch"))
    cfg = _tiny("model.use_flash_attn=True", "model.dtype='torch.bfloat16'", "model.num_layers=3",
                "data.seq_len=60", "data.micro_bsz=3", "parallel.tensor.size=2")
    sdpa, flash = make_plan(cfg, 2, flash_attn=False), make_plan(cfg, 2, flash_attn=True)
    mask = 3 * 60 * 60 + 3 * (3 * 60 * 64 * 2)  # the bool mask once, a bf16 copy per layer, rows padded to 64
    gqa = 3 * (2 * 3 * 60 * 2 * 16 * 2)  # K and V expanded to the query heads, per layer
    for column in ("traced", "closed_form"):
        a, b = getattr(sdpa, column), getattr(flash, column)
        assert (a["sdpa_mask"], a["gqa_kv"], b["sdpa_mask"], b["gqa_kv"]) == (mask, gqa, 0, 0), column
        assert a["total_peak"] - b["total_peak"] == mask + gqa, column  # they sit at the backward's peak
        assert (a["nccl"], a["cublas"]) == (2 * 2**30, 64 * 2**20), column
    t = flash.traced
    assert t["total_peak"] >= t["persistent"] + t["backward_extra"] + 2 * 2**30 + 64 * 2**20
    assert "SDPA" in sdpa.format() and "NCCL communicators (allowance)" in sdpa.format()


def test_plan_headroom_is_the_config_s():
    cfg = _tiny("memory.headroom=0.25")
    plan = make_plan(cfg, 1, trace=False, gpu="h100")
    assert plan.headroom == 0.25 and make_plan(cfg, 1, trace=False, headroom=0.05).headroom == 0.05
    assert plan.fits is (plan.peak <= 80 * 2**30 * 0.75)


def test_7b_plan_is_small_and_exact():
    """The acceptance run: configs/7B.py on its 8 ranks, in a fresh process of its own (harness.peak_rss) whose
    peak RSS stays under 2 GiB, persistent within 1%. Its duration is not asserted (on a loaded machine it says
    nothing about the planner): the timeout only stops a hang."""
    hang_guard_s = 600
    run = run_measured(os.path.join(ROOT, "tools", "plan.py"), [os.path.join(ROOT, "configs", "7B.py"), "--json"],
                       preload=("torch",), timeout=hang_guard_s, cwd=ROOT)
    assert run.returncode == 0, explain(run)
    plan = json.loads(run.stdout)
    assert run.peak_bytes < 2 * 2**30, f"peak RSS {run.peak_bytes / 2**30:.2f} GiB"
    assert plan["layout"]["world_size"] == 8 and plan["layout"]["tp_size"] == 8
    assert plan["traced"]["persistent"] == pytest.approx(plan["closed_form"]["persistent"], rel=0.01)
    assert plan["traced"]["total_peak"] == pytest.approx(plan["closed_form"]["total_peak"], rel=0.10)
    assert plan["comm_traced"]["TENSOR"] == pytest.approx(plan["comm_closed_form"]["TENSOR"], rel=0.01)
    assert plan["fits"] is True and plan["step_time_s"] > 0
    # no flash_attn on this machine: packed rows of 2 x 2048 tokens keep the bool mask and a bf16 copy per layer,
    # unless this torch has its own varlen kernel (then nothing, as with flash_attn)
    from tessera.memory.extras import torch_varlen

    mask = 0 if torch_varlen()[0] is not None else 2 * 2048**2 * (1 + 32 * 2)
    assert plan["traced"]["sdpa_mask"] == plan["closed_form"]["sdpa_mask"] == mask
    assert plan["closed_form"]["nccl"] == 2 * 2**30  # world and TP group (TP 8 = world 8)


def test_search_ranks_layouts_that_fit():
    cfg = Config.from_file(os.path.join(ROOT, "configs", "7B.py"))
    found = search_layouts(cfg, 8, 40.0, gpu="h100")
    assert found and all(c.peak <= 40 * 2**30 * 0.9 for c in found)
    assert search_layouts(cfg, 8, 40.0, gpu="h100", headroom=0.5) != found  # the headroom is honoured
    assert [c.tokens_per_gpu_per_s for c in found] == sorted((c.tokens_per_gpu_per_s for c in found), reverse=True)
    # the same global batch everywhere: dp * micro_bsz * micro_num rows
    rows = {(8 // c.tp) * c.micro_bsz * c.micro_num for c in found}
    assert rows == {cfg.data.micro_bsz * cfg.data.micro_num}
    assert not search_layouts(cfg, 8, 4.0, gpu="h100")  # 7B in 4 GiB per GPU: nothing fits


def _dry_run(*args: str) -> subprocess.CompletedProcess:
    """``train.py --config tiny --dry-run parallel.tensor.size=2 ARGS`` in a process without CUDA (as on a laptop)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--config", TINY, "--dry-run",
                           "parallel.tensor.size=2", *args], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=env)


def _table_peak_gib(stdout: str) -> float:
    """The traced ``= total peak`` of the printed plan table, in GiB."""
    row = next(line for line in stdout.splitlines() if line.startswith("= total peak"))
    return float(row.split()[3])


def test_train_py_dry_run_prints_the_plan_and_a_verdict_on_any_machine():
    """Without a target memory it says it compared against nothing (exit 0); with --gpu-memory the last line is
    the verdict against that memory less memory.headroom (10% by default): exit 0 when the table's peak is
    within it, 1 when it is not, even where the memory itself exceeds the peak (the headroom is kept)."""
    plain = _dry_run()
    assert plain.returncode == 0, explain(plain)
    assert "world 2 = tp 2 x dp 1" in plain.stdout and "= persistent state" in plain.stdout
    last = plain.stdout.splitlines()[-1]
    assert last.startswith("fit not checked: compared against no GPU memory") and "--gpu-memory" in last, last
    peak = _table_peak_gib(plain.stdout)  # rounded to 0.01 GiB: the margins below are 1% and 5%
    roomy, tight = f"{peak / 0.9 * 1.01:.3f}", f"{peak * 1.05:.3f}"
    fits, does_not = _dry_run("--gpu-memory", roomy), _dry_run("--gpu-memory", tight)
    assert fits.returncode == 0, explain(fits)
    assert does_not.returncode == 1, explain(does_not)
    for proc, memory in ((fits, roomy), (does_not, tight)):
        verdict = proc.stdout.splitlines()[-1]
        assert _table_peak_gib(proc.stdout) == peak
        usable = float(memory) * 0.9
        word, relation = ("fits", "within") if proc is fits else ("does NOT fit", "exceeds")
        assert verdict == (f"{word}: peak {peak:.2f} GiB per rank {relation} {usable:.2f} GiB usable of "
                           f"{float(memory):g} GiB per GPU (--gpu-memory; 10% kept free for the CUDA context and "
                           "allocator fragmentation)"), verdict
        assert sum(line.startswith(("fits:", "does NOT fit:")) for line in proc.stdout.splitlines()) == 1


def test_plan_tool_verdict_against_gpu_memory(capsys):
    """tools/plan.py: the --gpu's datasheet memory by default, --gpu-memory when given; the verdict is the last
    line and the exit status follows it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_plan_tool", os.path.join(ROOT, "tools", "plan.py"))
    assert spec is not None and spec.loader is not None
    plan_tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan_tool)
    args = [TINY, "parallel.tensor.size=2", "--flash-attn"]
    assert plan_tool.main(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("fits: peak ") and "of 80 GiB per GPU (h100 datasheet;" in out[-1], out[-1]
    assert plan_tool.main([*args, "--gpu-memory", "1"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("does NOT fit: peak ") and "exceeds 0.90 GiB usable of 1 GiB per GPU" in out[-1]
