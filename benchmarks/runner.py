"""Measurements behind ``python -m benchmarks``: every figure is taken side by side in one run.

Why interleaving: the CPU machines this runs on are shared and noisy (other test runs, a loaded
hypervisor). Each variant runs one step per round, the variants in a rotated order, and ratios are
the median over rounds of the per-round (paired) ratio, so a slow phase of the machine hits every
variant alike instead of whichever happened to run then.

Sections (keys of the result dict):

- ``single``: tessera's ``Trainer.train_step`` (NaiveAMPModel + HybridZeroOptimizer, TP=1) in
  bf16/fp16/fp32/tf32 and a plain PyTorch step of the same model (``benchmarks.plain``) in fp32
  and bf16 autocast with tessera's GEMM choice, on the main batch;
- ``native``: the same at a small batch with torch's native bf16 CPU kernels (slow on CPUs without
  avx512_bf16/AMX, hence the small batch): tessera with ``TESSERA_CPU_LOWP_MATMUL=native`` and plain
  ``torch.autocast``;
- ``peaks``: ``metrics.measure_matmul_tflops`` per dtype, the MFU denominator train.py uses on CPU;
- ``parallel``: 1 process x N threads (TP=1=DP=1) vs N processes x 1 thread as TP=N and as DP=N
  (ZeRO-1 over DP), same global batch, with the time spent inside torch.distributed collectives;
- ``memory``: persistent bytes per parameter from ``HybridZeroOptimizer.memory_bytes()`` after one
  real step, for DP=1 and DP=N with ZeRO-1 over 1 and N ranks, next to the closed form;
- ``gpu``: a bf16 step on configs/1B.py dims when CUDA is available.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import math
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from tessera.config import Config, apply_overrides, load_python_file
from tessera.config.precision import apply_precision, resolve_precision
from tessera.data import build_data
from tessera.model import ModelArgs, build_model, flops_per_token
from tessera.parallel import lowp
from tessera.parallel.comm import use_fast_collectives
from tessera.parallel.shm_comm import ShmCollectives
from tessera.train.builder import Groups, build_training_stack
from tessera.train.metrics import gpu_peak_tflops, measure_matmul_tflops
from tessera.train.precision_report import closed_form_bytes
from tessera.train.step import Trainer

__all__ = ["Mode", "MODES", "run_bench", "measure_gpu", "machine_info"]

DTYPES = ("bf16", "fp16", "fp32", "tf32")
_FULL_NAME = {d: f"torch.{resolve_precision(d).name}" for d in DTYPES}  # bf16 -> torch.bfloat16
_ENV = "TESSERA_CPU_LOWP_MATMUL"
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root


def _path(config: str) -> str:
    """Config paths are relative to the repository root, wherever the bench is started from."""
    return config if os.path.isabs(config) or os.path.exists(config) else os.path.join(_ROOT, config)


@dataclass(frozen=True)
class Mode:
    """How much to measure. ``overrides`` apply to ``config`` (the demo config unless tiny)."""

    name: str
    config: str = "configs/demo.py"
    overrides: tuple[str, ...] = ()
    micro_bsz: int = 16  # main batch (rows of seq_len) for the single-process and parallel sections
    threads: int = 1  # torch threads of the single-process sections
    min_rounds: int = 5
    max_rounds: int = 12
    budget_s: float = 120.0  # single-process rounds stop after this once min_rounds are done
    native_micro_bsz: int = 1
    native_seq_len: int | None = None  # None: the config's seq_len
    native_rounds: int = 3
    world: int = 2  # processes of the parallel section (= threads of its 1-process baseline)
    par_min_rounds: int = 5
    par_max_rounds: int = 12
    par_budget_s: float = 50.0
    gpu_config: str = "configs/1B.py"
    gpu_micro_bsz: int = 4
    gpu_steps: int = 8
    peak_seconds: float = 0.5
    # the config files as read once at the start (path -> raw dict), so every section and every worker
    # measures the same model even if a file changes on disk during the run
    snapshot: dict[str, Any] | None = field(default=None, compare=False, hash=False, repr=False)

    def frozen(self) -> Mode:
        """This mode with its config files read now."""
        return replace(self, snapshot={p: load_python_file(_path(p)) for p in {self.config, self.gpu_config}})


MODES: dict[str, Mode] = {
    "full": Mode("full"),
    "quick": Mode("quick", micro_bsz=4, min_rounds=3, max_rounds=3, budget_s=0.0, native_seq_len=64,
                  native_rounds=2, par_min_rounds=3, par_max_rounds=3, par_budget_s=0.0, gpu_steps=4,
                  peak_seconds=0.25),
    # the test mode: configs/tiny.py dims, seconds in all
    "tiny": Mode("tiny", config="configs/tiny.py", overrides=("data.seq_len=32",), micro_bsz=4, min_rounds=2,
                 max_rounds=2, budget_s=0.0, native_micro_bsz=1, native_rounds=1, par_min_rounds=2,
                 par_max_rounds=2, par_budget_s=0.0, gpu_config="configs/tiny.py", gpu_micro_bsz=2, gpu_steps=1,
                 peak_seconds=0.05),
}


# ---------------------------------------------------------------------------- helpers
def machine_info() -> dict[str, Any]:
    """CPU model, cores, the flags that decide bf16/fp16 kernels, torch version, load."""
    model, flags = platform.processor() or "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model in ("unknown", "x86_64", ""):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    relevant = ["avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16"]
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "flags": {f: f in flags for f in relevant},
        "torch": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "python": platform.python_version(),
        "lowp_env": os.environ.get(_ENV, "auto"),
        "bf16_upcast": lowp.upcast_on_cpu(torch.bfloat16),
        "fp16_upcast": lowp.upcast_on_cpu(torch.float16),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def _git_state(config: str) -> dict[str, Any]:
    """The commit measured, and whether the config file differs from it (others may be editing it)."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=_ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"commit": git("rev-parse", "--short", "HEAD") or "unknown",
            "config_modified": bool(git("status", "--porcelain", "--", config)),
            "tree_modified": bool(git("status", "--porcelain", "--untracked-files=no"))}


def _loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return [float("nan")] * 3


@contextlib.contextmanager
def _env(name: str, value: str | None) -> Iterator[None]:
    """Set an environment variable for a block (lowp's choice of TESSERA_CPU_LOWP_MATMUL is made again)."""
    old = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
        lowp.forget_cpu_kernels()
    try:
        yield
    finally:
        if value is not None:
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old
            lowp.forget_cpu_kernels()


@contextlib.contextmanager
def _restore_process_state() -> Iterator[None]:
    """The bench flips TF32 switches (apply_precision) and thread counts; give the caller its own back."""
    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
        torch.set_num_threads(threads)


def _config(mode: Mode, dtype: str, micro_bsz: int, seq_len: int | None = None, config: str | None = None,
            extra: tuple[str, ...] = ()) -> Config:
    """The mode's config at TP=1 on synthetic rows, one document per row (``is_causal`` attention in both
    tessera and the plain model, so both compute exactly the same attention)."""
    over = [*mode.overrides, f"model.dtype='{_FULL_NAME[dtype]}'", "parallel.tensor.size=1", "data.type='synthetic'",
            "data.pack_sample_into_one=True", f"data.micro_bsz={micro_bsz}", "data.micro_num=1", *extra]
    if seq_len is not None:
        over.append(f"data.seq_len={seq_len}")
    return _load(mode, config or mode.config, over)


def _load(mode: Mode, config: str, overrides: list[str]) -> Config:
    """``Config.from_file`` on the mode's snapshot of ``config`` (read from disk when there is none)."""
    raw = copy.deepcopy(mode.snapshot[config]) if mode.snapshot and config in mode.snapshot else \
        load_python_file(_path(config))
    apply_overrides(raw, overrides, source=config)
    return Config.from_dict(raw, source=config)


def _batches(cfg: Config, dp_rank: int = 0, dp_size: int = 1) -> list[dict[str, torch.Tensor]]:
    data = build_data(cfg.data, vocab_size=cfg.model.vocab_size, max_seq_len=cfg.model.max_position_embeddings,
                      dp_rank=dp_rank, dp_size=dp_size, seed=cfg.seed)
    return data.train.next_step_batches()


def _tessera(cfg: Config, batches: list[dict[str, torch.Tensor]], device: torch.device | str = "cpu",
             **groups: Any) -> tuple[Trainer, Any]:
    """train.py's stack (``build_training_stack``) over the given groups (``tp_group``, ``dp_group``,
    ``zero1_group``, ``global_group``; default none), without the buffer sync a benchmark does not need."""
    apply_precision(cfg.model.dtype)
    stack = build_training_stack(cfg, Groups(tp=groups.get("tp_group"), dp=groups.get("dp_group"),
                                             zero1=groups.get("zero1_group"), world=groups.get("global_group")),
                                 device=device, sync_buffer=False)
    return stack.trainer, stack.optimizer


class _Variant:
    """A named step function; ``step()`` returns the loss, ``env`` is applied around it and ``before`` runs
    untimed before it (the process-wide TF32 switches of the variant's precision: variants of different
    precisions share one process)."""

    def __init__(self, name: str, fn: Callable[[], float], env: str | None = None,
                 skipped: Callable[[], int] | None = None, before: Callable[[], Any] | None = None):
        self.name, self.fn, self.env, self.skipped, self.before = name, fn, env, skipped, before

    def step(self) -> tuple[float, float, float]:
        """(wall seconds, CPU seconds of this process, loss). With one thread, the CPU time is what the
        step costs with the machine to itself: time spent descheduled by other processes is not in it."""
        if self.before is not None:
            self.before()
        with _env(_ENV, self.env):
            c0, t0 = time.process_time(), time.perf_counter()
            loss = self.fn()
            return time.perf_counter() - t0, time.process_time() - c0, loss


def _tessera_variant(name: str, cfg: Config, batches: list, env: str | None = None,
                     device: torch.device | str = "cpu") -> _Variant:
    trainer, opt = _tessera(cfg, batches, device=device)
    return _Variant(name, lambda: trainer.train_step(batches).loss, env, lambda: opt.skipped_steps,
                    before=lambda: apply_precision(cfg.model.dtype))


def _plain_variant(name: str, cfg: Config, batches: list, dtype: torch.dtype, gemm: str,
                   state: dict[str, torch.Tensor]) -> _Variant:
    from benchmarks.plain import PlainDecoder, PlainStep

    model = PlainDecoder(ModelArgs.from_config(cfg.model), dtype, gemm)
    model.load_state_dict(state)  # tessera's initial fp32 weights: the same model, the same first loss
    adam = cfg.adam
    step = PlainStep(model, dtype, adam.lr, (adam.adam_beta1, adam.adam_beta2), adam.adam_eps, adam.weight_decay,
                     cfg.hybrid_zero_optimizer.clip_grad_norm)
    x = torch.cat([b["input_ids"] for b in batches])
    y = torch.cat([b["labels"] for b in batches])
    return _Variant(name, lambda: step(x, y))


def _interleave(variants: list[_Variant], min_rounds: int, max_rounds: int, budget_s: float,
                log: Callable[[str], None]) -> dict[str, dict[str, Any]]:
    """One warm-up step each (its loss is the first-step loss), then rounds in rotated order."""
    out: dict[str, dict[str, Any]] = {v.name: {"times": [], "cpu": [], "first_loss": None} for v in variants}
    for v in variants:
        dt, cpu, loss = v.step()
        out[v.name]["first_loss"] = loss
        out[v.name]["warmup_s"] = dt
        log(f"  warm-up {v.name}: {dt:.3f}s loss {loss:.4f}")
    t_start = time.perf_counter()
    r = 0
    while r < max_rounds and (r < min_rounds or time.perf_counter() - t_start < budget_s):
        k = r % len(variants)
        for v in variants[k:] + variants[:k]:
            dt, cpu, loss = v.step()
            out[v.name]["times"].append(dt)
            out[v.name]["cpu"].append(cpu)
            out[v.name]["last_loss"] = loss
        r += 1
        log(f"  round {r}: " + ", ".join(f"{v.name} {out[v.name]['times'][-1]:.3f}s ({out[v.name]['cpu'][-1]:.3f} cpu)"
                                         for v in variants))
    for v in variants:
        out[v.name]["median_s"] = statistics.median(out[v.name]["times"])
        out[v.name]["median_cpu_s"] = statistics.median(out[v.name]["cpu"])
        out[v.name]["skipped_steps"] = v.skipped() if v.skipped else 0
    return out


def paired(a: list[float], b: list[float]) -> dict[str, float]:
    """Median, min and max over rounds of ``a[i] / b[i]`` (time ratios taken in the same round)."""
    ratios = [x / y for x, y in zip(a, b)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "n": len(ratios)}


def _peaks(threads: int, seconds: float) -> dict[str, float]:
    torch.set_num_threads(threads)
    return {name: measure_matmul_tflops(dt, torch.device("cpu"), seconds=seconds)
            for name, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32))}


# ---------------------------------------------------------------------------- single process
def measure_single(mode: Mode, log: Callable[[str], None]) -> dict[str, Any]:
    """Sections 1, 2 and 5: tessera vs plain, precisions, peaks -- one process, ``mode.threads`` threads."""
    torch.set_num_threads(mode.threads)
    cfgs = {d: _config(mode, d, mode.micro_bsz) for d in DTYPES}
    batches = _batches(cfgs["fp32"])
    tokens = sum(b["input_ids"].numel() for b in batches)
    state = {k: v.clone() for k, v in build_model(cfgs["fp32"].model, seed=cfgs["fp32"].seed).state_dict().items()}
    peaks_before = _peaks(mode.threads, mode.peak_seconds)
    log(f"single process, {mode.threads} thread(s), {tokens} tokens per step; peaks {peaks_before}")
    variants = [_tessera_variant(f"tessera_{d}", cfgs[d], batches) for d in DTYPES]
    variants += [_plain_variant("plain_fp32", cfgs["fp32"], batches, torch.float32, "torch", state),
                 _plain_variant("plain_bf16_lowp", cfgs["bf16"], batches, torch.bfloat16, "lowp", state)]
    main = _interleave(variants, mode.min_rounds, mode.max_rounds, mode.budget_s, log)
    del variants

    # torch's native bf16 kernels: slow here, so a small batch, every variant at that same batch
    ncfgs = {d: _config(mode, d, mode.native_micro_bsz, mode.native_seq_len) for d in ("bf16", "fp32")}
    nbatches = _batches(ncfgs["fp32"])
    ntokens = sum(b["input_ids"].numel() for b in nbatches)
    log(f"native-kernel comparison at {ntokens} tokens per step")
    nvariants = [
        _tessera_variant("tessera_bf16", ncfgs["bf16"], nbatches),
        _tessera_variant("tessera_bf16_native", ncfgs["bf16"], nbatches, env="native"),
        _tessera_variant("tessera_fp32", ncfgs["fp32"], nbatches),
        _plain_variant("plain_bf16_autocast", ncfgs["bf16"], nbatches, torch.bfloat16, "torch", state),
        _plain_variant("plain_bf16_lowp", ncfgs["bf16"], nbatches, torch.bfloat16, "lowp", state),
    ]
    native = _interleave(nvariants, mode.native_rounds, mode.native_rounds, 0.0, log)
    del nvariants
    peaks_after = _peaks(mode.threads, mode.peak_seconds)
    log(f"peaks after: {peaks_after}")
    seq_len = cfgs["fp32"].data.seq_len
    return {
        "threads": mode.threads,
        "tokens": tokens,
        "seq_len": seq_len,
        "micro_bsz": mode.micro_bsz,
        "flops_per_token": flops_per_token(cfgs["fp32"].model, seq_len),
        "model": {k: cfgs["fp32"].model[k] for k in ("num_layers", "hidden_size", "num_attention_heads",
                                                      "num_kv_attention_heads", "vocab_size")},
        "num_params": sum(v.numel() for v in state.values()),
        "main": main,
        "native": native,
        "native_tokens": ntokens,
        "native_seq_len": ncfgs["fp32"].data.seq_len,
        "peaks_before": peaks_before,
        "peaks_after": peaks_after,
        "peaks": {k: max(peaks_before[k], peaks_after[k]) for k in peaks_before},
    }


# ---------------------------------------------------------------------------- memory
def _memory_row(cfg: Config, **groups: Any) -> dict[str, Any]:
    """Bytes per parameter after one real training step, from the allocated tensors."""
    batches = _batches(cfg, *((dist.get_rank(groups["dp_group"]), dist.get_world_size(groups["dp_group"]))
                              if groups.get("dp_group") is not None else ()))
    trainer, opt = _tessera(cfg, batches, **groups)
    trainer.train_step(batches)
    mem = opt.memory_bytes()
    n = mem["num_params"]
    roles = ("weights", "main_grads", "masters", "optimizer_states")
    measured = {r: mem[r] / n for r in roles}
    measured["total"] = sum(measured.values())
    params = list(trainer.model.parameters())
    low = sum(p.numel() for p in params if p.dtype != torch.float32)
    fp32 = sum(p.numel() for p in params if p.dtype == torch.float32)
    closed = closed_form_bytes(cfg.model.dtype, opt.zero1_size, low, fp32, cfg.hybrid_zero_optimizer.reduce_dtype)
    return {"measured": measured, "closed_form": closed, "num_params": n, "zero1": opt.zero1_size,
            "bytes": {r: mem[r] for r in roles}}


def measure_memory_single(mode: Mode) -> dict[str, Any]:
    """DP=1, ZeRO-1 over 1 rank, per dtype (tiny batch: memory per parameter does not depend on it)."""
    return {d: _memory_row(_config(mode, d, 1)) for d in DTYPES}


# ---------------------------------------------------------------------------- parallel (workers)
_COMM_FNS = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
             "broadcast", "all_to_all_single")


class _CommTimer:
    """Wraps torch.distributed collectives: seconds spent inside them (waiting for peers included)."""

    def __init__(self) -> None:
        self.enabled = False
        self.seconds = 0.0
        self.calls = 0
        for name in _COMM_FNS:
            fn = getattr(dist, name, None)
            if fn is not None and not getattr(fn, "_bench_timed", False):
                setattr(dist, name, self._wrap(fn))

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.enabled:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1

        timed._bench_timed = True  # type: ignore[attr-defined]
        return timed

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        self.seconds, self.calls, self.enabled = 0.0, 0, True
        try:
            yield
        finally:
            self.enabled = False


def _agree(flag: bool) -> bool:
    """Rank 0's decision, on every rank (outside any timed region)."""
    t = torch.tensor([1 if flag else 0])
    dist.broadcast(t, 0)
    return bool(t.item())


def _parallel_worker(rank: int, world: int, mode: Mode) -> dict[str, Any]:
    """1 x ``world`` threads (on rank 0, the others idle in a barrier) vs ``world`` x 1 thread as TP and as
    DP (ZeRO-1 over DP), bf16, same global batch; then memory per parameter under DP=world."""
    torch.set_num_threads(1)
    t_worker = time.perf_counter()
    phases: dict[str, float] = {}
    timer = _CommTimer()
    group = dist.new_group(list(range(world)))
    cfg = _config(mode, "bf16", mode.micro_bsz)
    full = _batches(cfg)
    cfg_dp = _config(mode, "bf16", mode.micro_bsz // world)
    shard = _batches(cfg_dp, rank, world)
    tokens = sum(b["input_ids"].numel() for b in full)
    steps: dict[str, Callable[[], Any]] = {}
    if rank == 0:
        t1, _ = _tessera(cfg, full)
        steps["tp1"] = steps["tp1_1thread"] = lambda: t1.train_step(full)
    t2, _ = _tessera(cfg, full, tp_group=group, global_group=group)
    steps["tp2"] = lambda: t2.train_step(full)
    d2, _ = _tessera(cfg_dp, shard, dp_group=group, zero1_group=group, global_group=group)
    steps["dp2"] = lambda: d2.train_step(shard)
    names = ["tp1", "tp1_1thread", "tp2", "dp2"]
    # the same TP=2 model with its all-reduces routed through shared memory (what launch does on CPU)
    shm, _why = ShmCollectives.create(group)
    if shm is not None:
        shm.all_reduce = timer._wrap(shm.all_reduce)  # type: ignore[method-assign]
        steps["tp2_shm"] = steps["tp2"]
        names.insert(3, "tp2_shm")
    phases["build"] = time.perf_counter() - t_worker
    times: dict[str, list[float]] = {n: [] for n in names}
    comm: dict[str, list[float]] = {n: [] for n in names}
    calls: dict[str, int] = {n: 0 for n in names}

    def run(name: str) -> None:
        dist.barrier()
        if name.startswith("tp1"):
            dt = math.nan
            if rank == 0:
                torch.set_num_threads(1 if name == "tp1_1thread" else world)
                t0 = time.perf_counter()
                steps[name]()
                dt = time.perf_counter() - t0
                torch.set_num_threads(1)
            dist.barrier()  # the other ranks wait here, blocked (no CPU), while rank 0 runs
            times[name].append(dt)
            comm[name].append(0.0)
            return
        if name == "tp2_shm":
            use_fast_collectives(group, shm)
        try:
            with timer.measure():
                t0 = time.perf_counter()
                steps[name]()
                dt = time.perf_counter() - t0
        finally:
            use_fast_collectives(group, None)
        times[name].append(dt)
        comm[name].append(timer.seconds)
        calls[name] = timer.calls

    for n in names:  # warm-up
        run(n)
    for n in names:
        times[n].clear()
        comm[n].clear()
    t_start = time.perf_counter()
    r = 0
    def more() -> bool:
        return r < mode.par_max_rounds and (r < mode.par_min_rounds
                                            or time.perf_counter() - t_start < mode.par_budget_s)

    while _agree(more()):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            run(n)
        r += 1

    phases["timed"] = time.perf_counter() - t_worker
    if shm is not None:
        shm.close()
    memory = {}
    for d in DTYPES:
        mcfg = _config(mode, d, 1)
        memory[f"{d}_z1"] = _memory_row(mcfg, dp_group=group, global_group=group)
        memory[f"{d}_z{world}"] = _memory_row(mcfg, dp_group=group, zero1_group=group, global_group=group)
    phases["memory"] = time.perf_counter() - t_worker
    return {"rank": rank, "tokens": tokens, "times": times, "comm": comm, "calls": calls, "memory": memory,
            "phases": phases}


def measure_parallel(mode: Mode, log: Callable[[str], None]) -> dict[str, Any]:
    """Run ``_parallel_worker`` on ``mode.world`` spawned gloo processes and combine their timings."""
    from harness.distributed import run_distributed

    world = mode.world
    res = run_distributed(_parallel_worker, world, mode, timeout=1800.0, env={_ENV: os.environ.get(_ENV, "auto")})
    # a step of the job lasts as long as its slowest rank
    job = {n: [max(r["times"][n][i] for r in res if not math.isnan(r["times"][n][i]))
               for i in range(len(res[0]["times"][n]))] for n in res[0]["times"]}
    layouts = [n for n in ("tp2", "tp2_shm", "dp2") if n in job]
    share = {n: [statistics.median([c / t for c, t in zip(r["comm"][n], r["times"][n])]) for r in res]
             for n in layouts}
    out = {
        "world": world,
        "tokens": res[0]["tokens"],
        "rounds": len(job["tp1"]),
        "median_s": {n: statistics.median(v) for n, v in job.items()},
        # t_base / t_layout = throughput of the layout relative to the base
        "throughput_ratio": {n: paired(job["tp1"], job[n]) for n in (*layouts, "tp1_1thread")},
        "vs_one_core": {n: paired(job["tp1_1thread"], job[n]) for n in ("tp1", *layouts)},
        "comm_share": share,  # per rank
        "comm_s": {n: [statistics.median(r["comm"][n]) for r in res] for n in layouts},
        "comm_calls": {n: res[0]["calls"][n] for n in layouts},
        "memory": res[0]["memory"],
    }
    if "tp2_shm" in job:  # > 1: the shared-memory route is faster than gloo for the same TP step
        out["shm_vs_gloo"] = paired(job["tp2"], job["tp2_shm"])
    log(f"parallel: {out['median_s']}, comm share {share}; worker phases (s since start) {res[0]['phases']}")
    return out


# ---------------------------------------------------------------------------- GPU
def measure_gpu(mode: Mode, device: torch.device | str = "cuda", log: Callable[[str], None] = print) -> dict[str, Any]:
    """bf16 tessera step (and a plain autocast step) on ``mode.gpu_config`` dims; MFU vs the datasheet peak
    and vs a measured matmul. Runs on any device (the tests exercise it on the CPU at tiny dims)."""
    with _restore_process_state():
        return _measure_gpu(mode, device, log)


def _measure_gpu(mode: Mode, device: torch.device | str, log: Callable[[str], None]) -> dict[str, Any]:
    from benchmarks.plain import PlainDecoder, PlainStep
    from tessera.model.attention import select_backend

    device = torch.device(device)
    cuda = device.type == "cuda"

    def gpu_cfg(dtype: str, micro_bsz: int) -> Config:
        return _load(mode, mode.gpu_config, [
            f"model.dtype='{_FULL_NAME[dtype]}'", "parallel.tensor.size=1", "data.type='synthetic'",
            "data.pack_sample_into_one=True", f"data.micro_bsz={micro_bsz}", "data.micro_num=1"])

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    # A: tessera bf16 vs plain bf16 autocast (fp32 parameters + AdamW), same batch
    cfg = gpu_cfg("bf16", mode.gpu_micro_bsz)
    batches = _batches(cfg)
    tokens = sum(b["input_ids"].numel() for b in batches)
    backend, why = select_backend(device, torch.bfloat16, cfg.model.use_flash_attn)
    with torch.device(device):
        plain_model = PlainDecoder(ModelArgs.from_config(cfg.model), torch.bfloat16, "torch")
    adam = cfg.adam
    plain = PlainStep(plain_model, torch.bfloat16, adam.lr, (adam.adam_beta1, adam.adam_beta2), adam.adam_eps,
                      adam.weight_decay, cfg.hybrid_zero_optimizer.clip_grad_norm)
    x = torch.cat([b["input_ids"] for b in batches]).to(device)
    y = torch.cat([b["labels"] for b in batches]).to(device)

    def plain_step(step: PlainStep = plain) -> float:  # bound now: `plain` is deleted below to free it
        loss = step(x, y)
        sync()
        return loss

    variants = [_tessera_variant("tessera_bf16", cfg, batches, device=device),
                _Variant("plain_bf16_autocast", plain_step, before=lambda: apply_precision("bf16"))]
    log(f"GPU A: tessera bf16 vs plain bf16 autocast, {tokens} tokens per step")
    timed = _interleave(variants, mode.gpu_steps, mode.gpu_steps, 0.0, log)
    peak_mem_a = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    del variants, plain_step, plain, plain_model
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)

    # B: tessera bf16 vs tf32 vs fp32. Three 1B-parameter optimizers must fit at once (about 52 GB), hence
    # half the batch of A.
    mbs_b = max(1, mode.gpu_micro_bsz // 2)
    cfgs_b = {d: gpu_cfg(d, mbs_b) for d in ("bf16", "tf32", "fp32")}
    batches_b = _batches(cfgs_b["bf16"])
    tokens_b = sum(b["input_ids"].numel() for b in batches_b)
    log(f"GPU B: tessera bf16 / tf32 / fp32, {tokens_b} tokens per step")
    variants_b = [_tessera_variant(f"tessera_{d}", c, batches_b, device=device) for d, c in cfgs_b.items()]
    timed_b = _interleave(variants_b, mode.gpu_steps, mode.gpu_steps, 0.0, log)
    peak_mem_b = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    del variants_b
    if cuda:
        torch.cuda.empty_cache()

    fpt = flops_per_token(cfg.model, cfg.data.seq_len)
    name = torch.cuda.get_device_name(device) if cuda else f"{device.type} ({machine_info()['cpu']})"
    size, secs = (8192, 1.0) if cuda else (256, 0.05)
    measured_peak = {}
    for d, dt in (("bf16", torch.bfloat16), ("tf32", torch.float32), ("fp32", torch.float32)):
        apply_precision(d)
        measured_peak[d] = measure_matmul_tflops(dt, device, size=size, seconds=secs)
    return {
        "device": name,
        "attention_backend": backend if backend == "flash_attn" else f"sdpa ({why})",
        "tokens": tokens,
        "tokens_b": tokens_b,
        "seq_len": cfg.data.seq_len,
        "flops_per_token": fpt,
        "timed": timed,
        "timed_b": timed_b,
        "tflops": {k: fpt * tokens / v["median_s"] / 1e12 for k, v in timed.items()},
        "tflops_b": {k: fpt * tokens_b / v["median_s"] / 1e12 for k, v in timed_b.items()},
        "datasheet_peak": {d: gpu_peak_tflops(name, "bfloat16" if d == "bf16" else "tf32" if d == "tf32" else "float32")
                           for d in ("bf16", "tf32", "fp32")} if cuda else None,
        "measured_peak": measured_peak,
        "overhead": paired(timed["tessera_bf16"]["times"], timed["plain_bf16_autocast"]["times"]),
        "bf16_speedup": {d: paired(timed_b[f"tessera_{d}"]["times"], timed_b["tessera_bf16"]["times"])
                         for d in ("tf32", "fp32")},
        "peak_mem_gib": peak_mem_a,
        "peak_mem_gib_b": peak_mem_b,
        "config": mode.gpu_config,
        "micro_bsz": mode.gpu_micro_bsz,
        "micro_bsz_b": mbs_b,
    }


# ---------------------------------------------------------------------------- all
def run_bench(mode: Mode, log: Callable[[str], None] = print, gpu: bool | None = None) -> dict[str, Any]:
    """Every section; returns a JSON-able dict (``benchmarks.report.to_markdown`` renders it)."""
    with _restore_process_state():
        return _run_bench(mode, log, gpu)


def _run_bench(mode: Mode, log: Callable[[str], None], gpu: bool | None) -> dict[str, Any]:
    t0 = time.perf_counter()
    mode = mode.frozen()
    result: dict[str, Any] = {
        "mode": {k: v for k, v in asdict(mode).items() if k != "snapshot"},
        "git": _git_state(mode.config),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_info(),
        "loadavg_start": _loadavg(),
    }
    log(f"machine: {result['machine']}; load {result['loadavg_start']}")
    result["single"] = measure_single(mode, log)
    log(f"[{time.perf_counter() - t0:.0f}s] single-process sections done")
    result["memory_single"] = measure_memory_single(mode)
    result["loadavg_mid"] = _loadavg()
    log(f"[{time.perf_counter() - t0:.0f}s] memory (1 process) done")
    result["parallel"] = measure_parallel(mode, log)
    log(f"[{time.perf_counter() - t0:.0f}s] parallel section done")
    if gpu is None:
        gpu = torch.cuda.is_available()
    result["gpu"] = measure_gpu(mode, "cuda", log) if gpu else None
    result["loadavg_end"] = _loadavg()
    result["elapsed_s"] = time.perf_counter() - t0
    return result
