"""Training metrics: throughput, achieved TFLOP/s and MFU, memory, and where they are written.

Rank 0 writes every logged step three ways: a concise line (under a tqdm bar), TensorBoard scalars,
and one JSON object per line in ``metrics.jsonl`` so scripts can read a run without parsing text.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import time
from collections.abc import Mapping
from typing import Any

import torch

from tessera.parallel.lowp import linear

logger = logging.getLogger("tessera")

# Dense peak TFLOP/s per device by name fragment: (bf16/fp16 tensor core, tf32 tensor core, fp32 IEEE).
# Vendor datasheet figures without sparsity; the first matching fragment wins, so longer names go first.
GPU_PEAK_TFLOPS: list[tuple[str, tuple[float, float, float]]] = [
    ("GH200", (989.0, 494.0, 67.0)),
    ("H200", (989.0, 494.0, 67.0)),
    ("H100 PCIe", (756.0, 378.0, 51.0)),
    ("H100", (989.0, 494.0, 67.0)),
    ("H800", (989.0, 494.0, 67.0)),
    ("H20", (148.0, 74.0, 44.0)),
    ("B200", (2250.0, 1100.0, 80.0)),
    ("A100", (312.0, 156.0, 19.5)),
    ("A800", (312.0, 156.0, 19.5)),
    ("L40S", (362.0, 183.0, 91.6)),
    ("A10", (125.0, 62.5, 31.2)),
    ("V100", (125.0, 15.7, 15.7)),
    ("4090", (165.0, 82.6, 82.6)),
]


def gpu_peak_tflops(device_name: str, precision_name: str) -> float | None:
    """Peak dense TFLOP/s of a GPU for a precision (float16/bfloat16/tf32/float32), or None if unknown."""
    column = {"float16": 0, "bfloat16": 0, "tf32": 1, "float32": 2}[precision_name]
    for fragment, peaks in GPU_PEAK_TFLOPS:
        if fragment.lower() in device_name.lower():
            return peaks[column]
    return None


def measure_matmul_tflops(dtype: torch.dtype, device: torch.device, size: int = 1024, seconds: float = 0.5) -> float:
    """Achieved TFLOP/s of a square matmul in ``dtype`` on this device with this process's threads.

    Used as the CPU "peak" for MFU: there is no datasheet figure for an arbitrary CPU, so the best a
    dense kernel reaches here is the honest denominator. It runs through ``tessera.parallel.lowp.linear``,
    the kernel the model's linears use, so numerator and denominator share one kernel choice.
    """
    # a private generator: drawing from the ambient one would shift the training RNG streams (dropout)
    # by however many numbers this takes, and a resumed run, which measures after restoring them,
    # would no longer continue the interrupted run's streams
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, generator=g).to(dtype)
    b = torch.randn(size, size, device=device, generator=g).to(dtype)
    for _ in range(2):
        linear(a, b)
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        linear(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        best = max(best, 2 * size**3 / dt / 1e12)
    return best


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocator peak on GPU, max resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


class MetricsWriter:
    """Writes metrics on rank 0 (no-op elsewhere): log line + tqdm, TensorBoard, metrics.jsonl."""

    def __init__(self, log_dir: str, enabled: bool, total_steps: int, start_step: int = 0,
                 tensorboard: bool = True, progress_bar: bool = True):
        self.enabled = enabled
        self.log_dir = log_dir
        self._bar = None
        self._tb = None
        self._jsonl = None
        if not enabled:
            return
        os.makedirs(log_dir, exist_ok=True)
        path = os.path.join(log_dir, "metrics.jsonl")
        torn = False
        if os.path.exists(path) and os.path.getsize(path) > 0:
            with open(path, "rb") as f:  # a run killed mid-write leaves half a line: start a fresh one
                f.seek(-1, os.SEEK_END)
                torn = f.read(1) != b"\n"
        self._jsonl = open(path, "a", buffering=1)
        if torn:
            self._jsonl.write("\n")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=os.path.join(log_dir, "tensorboard"))
        if progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def _write(self, kind: str, step: int, values: Mapping[str, Any]) -> None:
        record = {"kind": kind, "step": step, "time": time.time(), **values}
        assert self._jsonl is not None  # opened in __init__ when enabled; callers return early otherwise
        self._jsonl.write(json.dumps(record) + "\n")
        if self._tb is not None:
            prefix = "" if kind == "train" else f"{kind}/"
            for k, v in values.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(prefix + k, v, step)

    def _print(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line)
        else:
            print(line, flush=True)

    def log_train(self, step: int, values: Mapping[str, Any], line: bool = True) -> None:
        if not self.enabled:
            return
        self._write("train", step, values)
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
            self._bar.set_postfix(loss=f"{values['loss']:.4f}", tgs=f"{values.get('tgs', 0):.0f}", refresh=False)
        if line:
            self._print(format_train_line(step, values))

    def log_valid(self, step: int, values: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        self._write("valid", step, values)
        self._print(f"valid step {step} | " + " ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                                            for k, v in values.items()))

    def log_event(self, message: str, **values: Any) -> None:
        """A one-off event (resume, checkpoint, skip) in the log and in metrics.jsonl."""
        if not self.enabled:
            return
        assert self._jsonl is not None  # opened in __init__ when enabled
        self._jsonl.write(json.dumps({"kind": "event", "time": time.time(), "message": message, **values}) + "\n")
        self._print(message)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._jsonl is not None:
            self._jsonl.close()
        self.enabled = False


def format_train_line(step: int, v: Mapping[str, Any]) -> str:
    return (f"step {step} | loss {v['loss']:.4f} | lr {v['lr']:.3e} | grad_norm {v['grad_norm']:.3f} | "
            f"loss_scale {v['loss_scale']:g} | skipped {v['skipped_steps']} | tgs {v['tgs']:.0f} | "
            f"tflops {v['tflops']:.3f} | mfu {100 * v['mfu']:.2f}% | step_time {v['step_time']:.3f}s | "
            f"tokens {v['consumed_tokens']} | mem {v['peak_mem_gib']:.2f}GiB")


def setup_logging(rank: int) -> None:
    """INFO on rank 0, WARNING elsewhere, each line tagged with the rank."""
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[%(asctime)s rank{rank} %(levelname)s] %(message)s", datefmt="%H:%M:%S")
