"""Where one rank's memory goes in a training step, phase by phase, beside the memory check's parts.

    python tools/memory_phases.py [--config configs/1B.py] [--warmup 2] [--json phases.json] [key.sub=value ...]

The memory check (``tessera.train.memory_check``, summing the memory model's terms, ``tessera.memory``)
predicts a run's peak from closed forms: the persistent state (weights, fp32 main gradients, masters,
optimizer moments), the activations of one micro-batch (what a forward keeps, and the backward's working set
on top), SDPA's extra tensors and an allowance for the runtime's buffers. A prediction that misses the real
peak says only that it missed; this tool says where.
It builds the run's model and optimizer in this process (one rank: TP=1, DP=1; on CUDA when there is a GPU,
else on the CPU), takes ``--warmup`` ordinary steps (compilation, the optimizer's moments), then one step
split into its phases, each measured from the state it starts on:

- the state: what is allocated between steps;
- each micro-batch's forward: what it keeps at its end, and its peak;
- each micro-batch's backward: its peak (the loss's working set, the blocks' backward, the gradient hooks);
- the optimizer step: its peak (the DP reduction's and the update's temporaries);

and last the whole step's peak over what was allocated before the model was built, which is what the check
predicts (``need``). On CUDA the figures are the caching allocator's (``torch.cuda.memory_allocated`` and
``max_memory_allocated``: the blocks handed to tensors, rounded as the allocator rounds them); on the CPU,
the storages created while the tool runs (``tessera.plan.tracker.LiveBytes``). The exit status is 0 when
the tool ran (whatever the ratios), 1 on a bad config, 2 on a bad argument.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import torch

from tessera.cli_args import positive_int

if TYPE_CHECKING:  # the tool imports the package's heavier modules only once it runs
    from tessera.config import Config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GIB = 2**30


class Meter:
    """Bytes allocated now, and their peak since the last ``reset``, on one device."""

    def __init__(self, device: Any, stack: ExitStack) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.live = None
        else:
            from tessera.plan.tracker import LiveBytes

            self.live = stack.enter_context(LiveBytes(device_type=device.type))

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def current(self) -> int:
        self.sync()
        return torch.cuda.memory_allocated(self.device) if self.cuda else self.live.current  # type: ignore[union-attr]

    def peak(self) -> int:
        self.sync()
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else self.live.peak  # type: ignore[union-attr]

    def reset(self) -> None:
        self.sync()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.live.reset_peak()  # type: ignore[union-attr]


def measure(cfg: Config, device: Any, warmup: int, meter_factory: Callable[[Any, ExitStack], Meter] = Meter,
            ) -> dict[str, float]:
    """The phases of one step (bytes; see the module docstring), after ``warmup`` ordinary steps."""
    from tessera.core.job import Job
    from tessera.data.loader import build_data
    from tessera.train.batch import to_device
    from tessera.train.builder import build_training_stack

    with ExitStack() as stack:
        meter = meter_factory(device, stack)
        before = meter.current()
        built = build_training_stack(cfg, Job.of(cfg, seed=0, device=device), sync_buffer=False)
        run_cfg = cfg.typed  # the keys read here, checked by mypy
        data = build_data(run_cfg.data.as_dict(), vocab_size=run_cfg.model.vocab_size,
                          max_seq_len=run_cfg.model.max_position_embeddings)
        trainer, optimizer = built.trainer, built.optimizer
        for _ in range(warmup):
            trainer.train_step(data.train.next_step_batches())
        state = meter.current()
        out = {"state": float(state - before), "forward_kept": 0.0, "forward_peak": 0.0, "backward_peak": 0.0}
        micro = data.train.next_step_batches()
        tokens = max(sum(float((b["labels"] != -100).sum()) for b in micro), 1.0)
        optimizer.zero_grad()
        for i, batch in enumerate(micro):
            batch = to_device(batch, device, f"micro-batch {i}")
            start = meter.current()
            meter.reset()
            loss = trainer._loss(batch, reduction="sum")  # the step's own forward (tessera.train.step)
            out["forward_peak"] = max(out["forward_peak"], float(meter.peak() - start))
            out["forward_kept"] = max(out["forward_kept"], float(meter.current() - start))
            meter.reset()
            optimizer.backward(loss / tokens, overlap_reduction=i == len(micro) - 1)
            del loss
            out["backward_peak"] = max(out["backward_peak"], float(meter.peak() - start))
            del batch
        start = meter.current()
        meter.reset()
        optimizer.step()
        out["optimizer_step_peak"] = float(meter.peak() - start)
        # the whole step as train.py runs it, over what was allocated before the build (the check's ``need``)
        meter.reset()
        trainer.train_step(data.train.next_step_batches())
        out["step_peak"] = float(meter.peak() - before)
        if device.type == "cuda":
            stats = torch.cuda.memory_stats(device)
            out["reserved_peak"] = float(stats.get("reserved_bytes.all.peak", 0))
            out["alloc_retries"] = float(stats.get("num_alloc_retries", 0))
    return out


def compare(cfg: Config, phases: dict[str, float], device_type: str) -> list[tuple[str, float | None, float]]:
    """(part, the check's figure or None, measured) rows, bytes."""
    from tessera.memory.estimate import plan_persistent_state

    plan = plan_persistent_state(cfg, 1, 1, 1, device_type=device_type)
    extras = plan.attention_bytes + plan.runtime_bytes
    return [
        ("state: weights, main grads, masters, moments", plan.bytes_per_rank, phases["state"]),
        ("a forward keeps", plan.activation_kept, phases["forward_kept"]),
        ("a forward's peak", None, phases["forward_peak"]),
        ("a backward's peak (activations + SDPA extras + workspaces)", plan.activation_bytes + extras,
         phases["backward_peak"]),
        ("the optimizer step's peak", None, phases["optimizer_step_peak"]),
        ("the whole step's peak (the check's need)", plan.need, phases["step_peak"]),
    ]


def to_markdown(rows: list[tuple[str, float | None, float]], phases: dict[str, float], header: str) -> str:
    largest = max(max(got, want or 0.0) for _, want, got in rows)
    unit, size = ("GiB", GIB) if largest >= GIB else ("MiB", 2**20)
    lines = [header, "", f"| part | check ({unit}) | measured ({unit}) | measured / check |", "|---|---:|---:|---:|"]
    for name, want, got in rows:
        ratio = f"{got / want:.3f}" if want else ""
        lines.append(f"| {name} | {'' if want is None else f'{want / size:.3f}'} | {got / size:.3f} | {ratio} |")
    if "reserved_peak" in phases:
        lines += ["", f"allocator: reserved peak {phases['reserved_peak'] / GIB:.3f} GiB, "
                      f"{phases['alloc_retries']:.0f} allocation retries"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "1B.py"), help="the run's config")
    p.add_argument("--warmup", type=positive_int, default=2, help="ordinary steps before the measured one (default 2)")
    p.add_argument("--json", default=None, help="also write the phases and rows (bytes) here")
    p.add_argument("overrides", nargs="*", help="key.sub=value pairs")
    args = p.parse_intermixed_args(argv)
    from tessera.config import Config, ConfigError

    try:
        cfg = Config.from_file(args.config, args.overrides)
    except (ConfigError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    phases = measure(cfg, device, args.warmup)
    rows = compare(cfg, phases, device.type)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(to_markdown(rows, phases, f"memory phases of {os.path.relpath(args.config, ROOT)} on {where}, "
                                    f"torch {torch.__version__}"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": where, "torch": torch.__version__, "phases": phases,
                       "rows": [{"part": n, "check": w, "measured": g} for n, w, g in rows]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
