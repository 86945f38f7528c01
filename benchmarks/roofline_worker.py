"""One side of ``python -m benchmarks roofline``: a process that builds tessera's training stack from
whichever checkout comes first on its ``PYTHONPATH``, steps it on command and decomposes a step.

Why a file that imports nothing of the measuring checkout: ``--against`` measures an older checkout
(its own ``tessera``) with the same instruments, so ``benchmarks.roofline`` runs this file by path
with ``PYTHONPATH`` set to the checkout measured. Everything here uses torch and the stack's public
surface only (``Trainer.train_step``, ``optimizer.step``), so a changed optimizer or model is
measured as it is, not as it was when this was written.

The decomposition of one step:
- GEMMs: every matmul operator of one real step (``GEMM_OPS``, seen by a ``TorchDispatchMode`` in
  forward, backward and optimizer) is recorded with its shapes, strides and dtypes, then the whole
  sequence is replayed alone on fresh tensors and timed (``replay``; the fastest pass counts: the work
  is fixed, so a slower pass measures interference from other processes, not the GEMMs);
- attention: the fused attention operators (SDPA kernels, flash_attn) timed in place during the
  recorded step (their backward needs the forward's real outputs, which a replay would not have);
- optimizer: ``optimizer.step()`` wrapped on the instance, minus the collectives inside it;
- collectives: seconds inside ``torch.distributed`` calls and ``Work.wait`` (outermost call only);
- other: the step minus the rest (computed by the caller).

Protocol (``main``): a pickled start message in ``argv[1]``; commands as JSON lines on stdin; replies
as JSON on stdout lines starting with ``REPLY`` (anything else a library prints there is ignored).
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

REPLY = "@@roofline "
# matmul operators as the dispatcher sees them (F.linear and matmul arrive decomposed into these); matrix-vector
# products (a norm's backward reduction) are bandwidth-bound reductions, not model FLOPs: they stay in "other"
# (the in-place forms: weight gradients accumulated into the fp32 main gradient, tessera.parallel.wgrad)
GEMM_OPS = frozenset({"mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_", "addbmm", "addbmm_", "_addmm_activation",
                      "linear", "matmul", "_int_mm", "_scaled_mm", "mkldnn_linear", "_linear_pointwise"})
_FIRST_OPERAND_SECOND = frozenset({"addmm", "addmm_", "baddbmm", "baddbmm_", "addbmm", "addbmm_",
                                   "_addmm_activation"})  # (input, a, b)
_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional", "_dtensor"})
_DIST_FNS = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
             "broadcast", "all_to_all", "all_to_all_single", "reduce", "gather", "scatter", "barrier",
             "all_gather_object", "broadcast_object_list", "send", "recv")


CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}
_clock: list[Callable[[], float]] = [time.perf_counter]


def now() -> float:
    """The clock every figure here is taken with: wall seconds, or with ``set_clock("cpu")`` this process's
    CPU seconds (a busy machine's descheduling left out; with one thread per process, what the step would
    take with the machine to itself, blocking waits for other ranks left out too)."""
    return _clock[0]()


def set_clock(name: str) -> None:
    if name not in CLOCKS:
        raise ValueError(f"clock {name!r}: one of {list(CLOCKS)}")
    _clock[0] = CLOCKS[name]


def op_kind(func: Any) -> str | None:
    """``"gemm"``, ``"attention"``, ``"collective"`` or None for an operator overload."""
    packet = getattr(func, "overloadpacket", None)
    name = getattr(packet, "__name__", "")
    namespace = getattr(func, "namespace", "")
    if "attention" in name or "flash_attn" in name or namespace == "flash_attn":
        return "attention"
    if name in GEMM_OPS:
        return "gemm"
    if namespace in _COLLECTIVE_NAMESPACES:
        return "collective"
    return None


def gemm_flops(name: str, args: tuple[Any, ...], out: Any) -> float:
    """Multiply-add FLOPs (2 per product) of one matmul operator call, from its operands' shapes."""
    if name in ("linear", "mkldnn_linear", "_linear_pointwise"):
        return 2.0 * args[0].numel() * args[1].shape[0]
    a = args[1] if name in _FIRST_OPERAND_SECOND else args[0]
    result = out[0] if isinstance(out, (tuple, list)) else out
    flops = 2.0 * result.numel() * a.shape[-1]
    return flops * a.shape[0] if name in ("addbmm", "addbmm_") else flops  # addbmm also sums over the batch


# ---------------------------------------------------------------------------------------- recording
@dataclass(frozen=True)
class TensorSpec:
    """What a replay needs to make an equivalent fresh tensor."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: str


def _map(fn: Callable[[Any], Any], x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return type(x)(_map(fn, v) for v in x)
    if isinstance(x, dict):
        return {k: _map(fn, v) for k, v in x.items()}
    return fn(x)


def _spec(x: Any) -> Any:
    return TensorSpec(tuple(x.shape), tuple(x.stride()), x.dtype, str(x.device)) if isinstance(x, torch.Tensor) else x


@dataclass
class OpCall:
    kind: str
    name: str
    func: Any
    args: Any  # tensors replaced by TensorSpec
    kwargs: Any
    seconds: float  # in place, during the recorded step
    flops: float


class Recorder(TorchDispatchMode):
    """Records every GEMM, attention and collective operator and times each one in place."""

    def __init__(self, sync: Callable[[], None]):
        super().__init__()
        self.sync = sync
        self.calls: list[OpCall] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        kind = op_kind(func)
        if kind is None:
            return func(*args, **kwargs)
        self.sync()
        t0 = now()
        out = func(*args, **kwargs)
        self.sync()
        dt = now() - t0
        name = func.overloadpacket.__name__
        flops = gemm_flops(name, args, out) if kind == "gemm" else 0.0
        self.calls.append(OpCall(kind, name, func, _map(_spec, args), _map(_spec, kwargs), dt, flops))
        return out


def _fresh(spec: TensorSpec, generator: torch.Generator) -> torch.Tensor:
    """A tensor of ``spec``'s shape, strides and dtype on random storage (overlapping strides allowed)."""
    size = 1 + sum((n - 1) * s for n, s in zip(spec.shape, spec.stride)) if all(spec.shape) else 0
    if spec.dtype.is_floating_point or spec.dtype.is_complex:
        base = torch.randn(size, generator=generator, device=spec.device).to(spec.dtype)
    elif spec.dtype == torch.bool:
        base = torch.zeros(size, dtype=torch.bool, device=spec.device)
    else:
        base = torch.randint(0, 8, (size,), generator=generator, device=spec.device).to(spec.dtype)
    return base.as_strided(spec.shape, spec.stride)


def replay(calls: list[OpCall], reps: int, sync: Callable[[], None]) -> list[float]:
    """Seconds of each of ``reps`` passes over ``calls`` in recorded order, on fresh tensors (one per
    spec and argument position, made once), after one untimed pass."""
    if not calls:
        return [0.0] * reps
    made: dict[tuple[Any, ...], torch.Tensor] = {}
    gens: dict[str, torch.Generator] = {}

    def materialize(x: Any, where: tuple[Any, ...]) -> Any:
        if isinstance(x, TensorSpec):
            key = (x, where)
            if key not in made:
                gen = gens.setdefault(x.device, torch.Generator(device=x.device).manual_seed(0))
                made[key] = _fresh(x, gen)
            return made[key]
        if isinstance(x, (list, tuple)):
            return type(x)(materialize(v, (*where, i)) for i, v in enumerate(x))
        if isinstance(x, dict):
            return {k: materialize(v, (*where, k)) for k, v in x.items()}
        return x

    prepared = [(c.func, materialize(c.args, (c.name,)), materialize(c.kwargs, (c.name, "kw"))) for c in calls]
    times = []
    with torch.no_grad():
        for i in range(reps + 1):
            sync()
            t0 = now()
            for func, args, kwargs in prepared:
                func(*args, **kwargs)
            sync()
            if i:
                times.append(now() - t0)
    return times


# ---------------------------------------------------------------------------------------- timers
class CommClock:
    """Seconds inside ``torch.distributed`` collectives and ``Work.wait`` while ``on`` (outermost call only:
    ``all_gather_object`` calling ``all_gather`` counts once). On CUDA each call is synchronized, so the
    figure is the collective's time, not its launch."""

    def __init__(self, sync: Callable[[], None]):
        self.on, self.seconds, self.calls, self._depth, self._sync = False, 0.0, 0, 0, sync
        for name in _DIST_FNS:
            fn = getattr(dist, name, None)
            if fn is not None:
                setattr(dist, name, self._wrap(fn))
        work = getattr(dist, "Work", None)
        if work is not None and hasattr(work, "wait"):
            work.wait = self._wrap(work.wait)

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on or self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            self._sync()
            t0 = now()
            try:
                return fn(*args, **kwargs)
            finally:
                self._sync()
                self.seconds += now() - t0
                self.calls += 1
                self._depth -= 1

        return timed


@dataclass
class Stack:
    """One built training stack of the checkout this process imports, and its batches."""

    name: str
    trainer: Any
    optimizer: Any
    batches: list[Any]
    cfg: Any
    before: Callable[[], Any]  # untimed, before each step: the precision's process-wide switches
    opt_s: float = 0.0
    opt_comm_s: float = 0.0


def _build_stack(name: str, raw: dict[str, Any], overrides: list[str], source: str, group: Any,
                 device: torch.device) -> Stack:
    """The stack through the checkout's ``build_training_stack``; the tensor mode the model reports is checked
    against the config's."""
    from tessera.config import Config, apply_overrides
    from tessera.data import build_data

    raw = copy.deepcopy(raw)
    apply_overrides(raw, overrides, source=source)
    cfg = Config.from_dict(raw, source=source)
    data = build_data(cfg.data, vocab_size=cfg.model.vocab_size, max_seq_len=cfg.model.max_position_embeddings,
                      dp_rank=0, dp_size=1, seed=cfg.seed)
    batches = data.train.next_step_batches()
    mode = cfg.parallel.tensor.mode
    stack, switches = _checkout_stack(cfg, group, device)
    modes = {m.tensor_mode for m in stack.trainer.model.modules() if isinstance(getattr(m, "tensor_mode", None), str)}
    if group is not None and modes and modes != {mode}:
        raise RuntimeError(f"{name}: parallel.tensor.mode={mode!r} asked, the model was built with {sorted(modes)}")
    return Stack(name, stack.trainer, stack.optimizer, batches, cfg, switches)


def _checkout_stack(cfg: Any, group: Any, device: torch.device) -> tuple[Any, Callable[[], Any]]:
    """``build_training_stack`` of the checkout this worker runs in, and its precision switches: through the run
    description where the checkout has one, else (a base checkout from before it) through its groups."""
    try:
        from tessera.core.job import Job, JobGroups
    except ImportError:
        from tessera.config.precision import apply_precision  # type: ignore[attr-defined]
        from tessera.train.builder import Groups, build_training_stack  # type: ignore[attr-defined]

        apply_precision(cfg.model.dtype)
        stack = build_training_stack(cfg, Groups(tp=group, world=group), device=device, sync_buffer=False)
        return stack, lambda: apply_precision(cfg.model.dtype)
    from tessera.train.builder import build_training_stack

    job = Job.of(cfg, JobGroups(tp=group, world=group), device=device)
    job.precision.apply()
    return build_training_stack(cfg, job, sync_buffer=False), job.precision.apply


def _time_optimizer(stack: Stack, clock: CommClock) -> None:
    """Wrap ``stack.optimizer.step`` on the instance: its seconds, and the collectives' inside it."""
    inner = stack.optimizer.step

    def step(*args: Any, **kwargs: Any) -> Any:
        c0, t0 = clock.seconds, now()
        try:
            return inner(*args, **kwargs)
        finally:
            stack.opt_s += now() - t0
            stack.opt_comm_s += clock.seconds - c0

    stack.optimizer.step = step


# ---------------------------------------------------------------------------------------- commands
class Worker:
    """The stacks of one process and the commands the parent sends."""

    def __init__(self, start: dict[str, Any]):
        set_clock(start.get("clock", "wall"))
        self.device = torch.device(start.get("device", "cpu"))
        self.world = int(start.get("world", 1))
        self.group = dist.group.WORLD if self.world > 1 else None
        self.clock = CommClock(self.sync)
        self.stacks: dict[str, Stack] = {}
        for name, overrides in start["variants"].items():
            stack = _build_stack(name, start["raw"], overrides, start["source"], self.group, self.device)
            _time_optimizer(stack, self.clock)
            self.stacks[name] = stack

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _start(self, stack: Stack) -> None:
        stack.before()
        if self.group is not None:
            dist.barrier(self.group)
        self.sync()

    def info(self) -> dict[str, Any]:
        import tessera

        return {"tessera": os.path.dirname(os.path.abspath(tessera.__file__)), "threads": torch.get_num_threads(),
                "torch": torch.__version__,
                "stacks": {n: {"tokens": sum(int(b["input_ids"].numel()) for b in s.batches),
                               "params": sum(p.numel() for p in s.trainer.model.parameters())}
                           for n, s in self.stacks.items()}}

    def step(self, name: str) -> dict[str, Any]:
        """One timed ``train_step``: wall seconds, optimizer seconds (collectives inside it apart) and
        collective seconds."""
        stack = self.stacks[name]
        self._start(stack)
        stack.opt_s = stack.opt_comm_s = 0.0
        self.clock.seconds, self.clock.calls, self.clock.on = 0.0, 0, True
        try:
            t0 = now()
            result = stack.trainer.train_step(stack.batches)
            self.sync()
            dt = now() - t0
        finally:
            self.clock.on = False
        return {"step_s": dt, "opt_s": stack.opt_s, "opt_comm_s": stack.opt_comm_s, "comm_s": self.clock.seconds,
                "comm_calls": self.clock.calls, "loss": float(result.loss)}

    def decompose(self, name: str, recorded_steps: int, replays: int) -> dict[str, Any]:
        """``recorded_steps`` steps under the ``Recorder`` (GEMMs and attention timed in place; the last
        one's GEMMs are replayed ``replays`` times alone)."""
        stack = self.stacks[name]
        per_step: list[dict[str, float]] = []
        calls: list[OpCall] = []
        for _ in range(recorded_steps):
            self._start(stack)
            with Recorder(self.sync) as rec:
                stack.trainer.train_step(stack.batches)
            calls = rec.calls
            per_step.append({k: sum(c.seconds for c in calls if c.kind == k) for k in ("gemm", "attention",
                                                                                      "collective")})
        gemms = [c for c in calls if c.kind == "gemm"]
        if self.group is not None:
            dist.barrier(self.group)
        passes = replay(gemms, replays, self.sync)
        return {
            "gemm_replay_s": min(passes),
            "gemm_replay_passes": passes,
            "gemm_in_place_s": statistics.median(s["gemm"] for s in per_step),
            "attention_s": statistics.median(s["attention"] for s in per_step),
            "collective_ops_in_place_s": statistics.median(s["collective"] for s in per_step),
            "gemm_flops": sum(c.flops for c in gemms),
            "gemm_calls": len(gemms),
            "attention_calls": sum(1 for c in calls if c.kind == "attention"),
        }


def _reply(obj: Any) -> None:
    sys.stdout.write(REPLY + json.dumps(obj) + "\n")
    sys.stdout.flush()


@contextmanager
def _replying() -> Iterator[None]:
    """Any exception becomes an error reply (with its traceback) instead of a silent death."""
    try:
        yield
    except Exception:  # noqa: BLE001 - the parent reports it with the rank's traceback
        _reply({"error": traceback.format_exc()})


def main(argv: list[str]) -> int:
    with open(argv[0], "rb") as f:
        start = pickle.load(f)
    torch.set_num_threads(int(start["threads"]))
    world, rank = int(start.get("world", 1)), int(start.get("rank", 0))
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{start['init_file']}", rank=rank, world_size=world)
    worker = None
    with _replying():
        worker = Worker(start)
        _reply({"ready": True, **worker.info()})
    if worker is None:
        return 1
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "exit":
            break
        with _replying():
            if cmd["cmd"] == "step":
                _reply(worker.step(cmd["variant"]))
            elif cmd["cmd"] == "decompose":
                _reply(worker.decompose(cmd["variant"], int(cmd["recorded_steps"]), int(cmd["replays"])))
            else:
                raise ValueError(f"unknown command {cmd['cmd']!r}")
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
