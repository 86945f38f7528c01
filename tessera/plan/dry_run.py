"""One training iteration at real size without a GPU: the dry run behind ``tools/plan.py`` and
``train.py --dry-run``.

The model, optimizer and trainer are train.py's own, built on the ``meta`` device (shapes and dtypes,
no storage) in a process group of the real world size whose backend is torch's fake one registered
for ``meta`` only. Like NCCL for CPU tensors, that group refuses any collective on a CPU tensor
("No backend type associated with device type cpu"), so a host tensor reaching a collective anywhere
in the step fails the dry run. One rank of the job is simulated; the fake backend answers for the
others.

Why meta and not fake CUDA tensors: a CPU-only torch cannot record an autograd graph on fake CUDA
tensors (the graph asks for a CUDA stream: "PyTorch is not linked with support for cuda devices"),
so the backward could not run. Meta tensors run forward, backward and the optimizer; attention on
meta uses a flash kernel's shape function (``tessera.model.sdpa``), which keeps what flash_attn
keeps on a GPU. Barriers and object collectives (``all_gather_object``...) carry only Python objects
and torch moves them to the right device itself, so they are answered locally in a dry run.

The iteration is the loop body of train.py: the configured micro-batches (synthetic tokens of the
configured shape), forward, loss, backward with the DP reduction, the optimizer step (masters, ZeRO,
clipping, overflow agreement), the stop agreement, then a checkpoint save up to the file writes and
the checkpoint agreement of a resume. It runs twice: the first creates the optimizer's states, the
second is the steady state and gives the figures.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from tessera.checkpoint import Progress, RngStreams, TrainState, find_resumable_checkpoint, save_checkpoint
from tessera.checkpoint.tree import prepare_tree
from tessera.config import Config
from tessera.core.context import gpc, launch
from tessera.core.job import Job
from tessera.core.layout import ParallelMode
from tessera.data import build_data
from tessera.plan.tracker import CollectiveTraffic, LiveBytes
from tessera.train.builder import build_training_stack
from tessera.train.stop import StopRequest

__all__ = ["StepTrace", "trace_iteration", "dry_run", "fake_job"]

logger = logging.getLogger("tessera")


@dataclass
class StepTrace:
    """What one rank held during one iteration, in bytes of live tensors on the training device."""

    persistent: dict[str, int]  # by role after the step (weights, main grads, masters, ...), each storage once
    persistent_total: int  # every live tensor between steps (what each step starts from)
    built: int  # live after building model + optimizer, before the first step
    step_peak: int  # peak during the step (persistent + activations + the backward's working set + buffers)
    backward_peak: int  # peak of the micro-batches' forward and backward (activations, logits, loss)
    optimizer_peak: int  # peak of the optimizer step (its temporaries: norms, Adam's math, gathers)
    save_peak: int  # peak during the checkpoint save (persistent + what the save adds on the device)
    comm: dict[str, dict[str, float]] = field(default_factory=dict)  # group -> kind -> bytes per rank
    comm_buffer: int = 0  # the largest collective's buffers outside the persistent state (within step_peak)
    tokens: int = 0  # tokens this rank processed in the step
    num_params: int = 0  # parameters on this rank

    @property
    def peak(self) -> int:
        return max(self.step_peak, self.save_peak)

    @property
    def backward_extra(self) -> int:
        """Activations, logits, loss and the backward's working set at their peak."""
        return self.backward_peak - self.persistent_total

    @property
    def optimizer_extra(self) -> int:
        """The optimizer step's temporaries at their peak."""
        return self.optimizer_peak - self.persistent_total

    @property
    def save_extra(self) -> int:
        return max(0, self.save_peak - self.persistent_total)


def _group_names(job: Job) -> dict[str, str]:
    """Process-group name -> the parallel mode(s) it serves (TENSOR, DATA, ZERO1, GLOBAL)."""
    names: dict[str, list[str]] = {}
    for mode in ParallelMode:
        g = job.groups.of(mode)
        if g is not None:
            names.setdefault(g.group_name, []).append(mode.name)
    return {k: "+".join(v) for k, v in names.items()}


def _synthetic_batches(cfg: Config, job: Job) -> list[dict[str, torch.Tensor]]:
    """This rank's micro-batches of one step, from synthetic tokens in the configured shape."""
    data_cfg = copy.deepcopy(cfg.to_dict()["data"])
    data_cfg.update(type="synthetic", valid_every=0)
    data = build_data(data_cfg, vocab_size=cfg.model.vocab_size, max_seq_len=cfg.model.max_position_embeddings,
                      dp_rank=job.layout.dp_rank, dp_size=job.layout.dp_size,
                      seed=job.seed, barrier=None, is_main=False, progress=False)
    return data.train.next_step_batches()


def _plan_write(path: str, tree: Any) -> dict[str, Any]:
    """A checkpoint file planned, not written: what ``write_tree`` prepares on the device, then nothing."""
    unique, _ = prepare_tree(tree)
    return {"size": sum(t.numel() * t.element_size() for t in unique.values()), "sha256": "dry-run"}


def trace_iteration(cfg: Config, job: Job, save_dir: str | None = None) -> StepTrace:
    """Build train.py's model, optimizer and trainer for ``job`` and run one iteration of its loop, counting
    live tensor bytes on the job's device. With ``save_dir`` the checkpoint save runs there (files planned,
    not written, on meta)."""
    device = job.device
    batches = _synthetic_batches(cfg, job)  # host tensors, made before counting (the loader's own memory)
    live = LiveBytes(device_type=device.type)
    # (a name missing from _group_names() would map to None: every group a dry run uses is one of the job's)
    traffic = CollectiveTraffic(_group_names(job).get)  # type: ignore[arg-type]
    with live:
        stack = build_training_stack(cfg, job)
        optimizer, trainer = stack.optimizer, stack.trainer
        built = live.current
        # two iterations: the first creates the optimizer's lazily allocated states; the second is the
        # steady state every later step repeats, and its figures are the ones reported
        phases: dict[str, int] = {}
        inner_step = optimizer.step

        def step_in_phases(*args: Any, **kwargs: Any) -> Any:  # the step's peak, split at the optimizer
            phases["backward"] = live.peak
            live.reset_peak()
            out = inner_step(*args, **kwargs)
            phases["optimizer"] = live.peak
            return out

        optimizer.step = step_in_phases  # type: ignore[method-assign]  # restored after the two iterations
        for i in range(2):
            live.reset_peak()
            traffic.persistent = live.live_storages()
            with traffic if i == 1 else contextlib.nullcontext():
                # the first only has to create the states: one micro-batch does
                result = trainer.train_step(batches if i == 1 else batches[:1])
                StopRequest().should_stop()  # the stop agreement, as the loop runs it after every step
        optimizer.step = inner_step  # type: ignore[method-assign]
        step_peak = max(live.peak, *phases.values())
        after = live.current
        persistent = {k: int(v) for k, v in optimizer.memory_bytes().items() if k != "num_params"}
        save_peak = after
        if save_dir is not None:
            live.reset_peak()
            state = TrainState(stack.inner_model, optimizer, progress=Progress(1, result.tokens),
                               lr_scheduler=stack.scheduler)
            state.register("rng", RngStreams(gpc), per_rank=True)
            save_checkpoint(save_dir, 1, state, config=None, layout=job.layout,
                            writer=_plan_write if device.type == "meta" else None)
            save_peak = live.peak
            # the resume agreement train.py runs at launch: every rank must accept the same checkpoint
            with traffic:
                find_resumable_checkpoint(save_dir, job.layout, load=lambda path: path)
    return StepTrace(persistent=persistent, persistent_total=after, built=built, step_peak=step_peak,
                     backward_peak=phases["backward"], optimizer_peak=phases["optimizer"],
                     save_peak=save_peak, comm=traffic.sent, comm_buffer=traffic.largest_buffer,
                     tokens=result.tokens // max(1, job.layout.dp_size),
                     num_params=sum(p.numel() for p in optimizer.params))


@contextlib.contextmanager
def _object_collectives_answered_locally() -> Iterator[None]:
    """Barriers and object collectives of a simulated rank: answered from this rank's own object."""
    saved = {n: getattr(dist, n) for n in ("barrier", "all_gather_object", "gather_object", "broadcast_object_list")}

    # torch's parameter names, so a call by keyword works as with the real ones
    def all_gather_object(object_list: list, obj: Any, group: dist.ProcessGroup | None = None) -> None:
        object_list[:] = [obj] * len(object_list)

    def gather_object(obj: Any, object_gather_list: list | None = None, dst: int | None = 0,
                      group: dist.ProcessGroup | None = None, group_dst: int | None = None, **_: Any) -> None:
        if object_gather_list is not None:
            object_gather_list[:] = [obj] * len(object_gather_list)

    dist.barrier = lambda *a, **k: None
    dist.all_gather_object = all_gather_object
    dist.gather_object = gather_object
    dist.broadcast_object_list = lambda objs, *a, **k: None
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


@contextlib.contextmanager
def fake_job(cfg: Config, world_size: int, rank: int = 0, seed: int | None = None) -> Iterator[Job]:
    """``gpc`` launched as rank ``rank`` of a ``world_size`` job on the meta device, whose groups serve
    meta tensors only (a CPU tensor in a collective fails as under NCCL); yields that job."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a dry run needs a process without a process group; run it in its own process")
    with _object_collectives_answered_locally():
        launch(cfg, rank=rank, world_size=world_size, init_method=FakeStore(), backend="meta:fake", seed=seed)
        assert gpc.job is not None
        gpc.job = gpc.job.replace(device=torch.device("meta"))
        try:
            yield gpc.job
        finally:
            gpc.destroy()


def dry_run(cfg: Config, world_size: int, rank: int = 0, seed: int | None = None) -> StepTrace:
    """One iteration of ``cfg`` as rank ``rank`` of ``world_size`` ranks, on meta tensors (see the module doc)."""
    with fake_job(cfg, world_size, rank, seed) as job, tempfile.TemporaryDirectory(prefix="tessera-dry-run-") as tmp:
        return trace_iteration(cfg, job, save_dir=os.path.join(tmp, "ckpt"))
