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

from tessera.files import os_error_text
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
    """Writes metrics on rank 0 (no-op elsewhere): log line + tqdm, TensorBoard, metrics.jsonl.

    A file that cannot be opened or written (a full disk, a lost mount, a path taken by a folder) does not
    raise here: the first failure is kept in ``problem`` (``cannot write the metrics: <path>: <reason>``)
    and nothing more is written, so the caller decides, with the other ranks, to stop (train.py
    agrees on it after every step: rank 0 alone must not leave the others waiting in a collective).
    """

    def __init__(self, log_dir: str, enabled: bool, total_steps: int, start_step: int = 0,
                 tensorboard: bool = True, progress_bar: bool = True):
        self.enabled = enabled
        self.log_dir = log_dir
        self.problem: str | None = None
        self._bar: Any = None
        self._tb: Any = None
        self._jsonl: Any = None
        if not enabled:
            return
        try:
            self._open(total_steps, start_step, tensorboard, progress_bar)
        except OSError as e:
            self._fail(e)

    def _open(self, total_steps: int, start_step: int, tensorboard: bool, progress_bar: bool) -> None:
        os.makedirs(self.log_dir, exist_ok=True)
        path = os.path.join(self.log_dir, "metrics.jsonl")
        torn = False
        if os.path.isfile(path) and os.path.getsize(path) > 0:
            with open(path, "rb") as f:  # a run killed mid-write leaves half a line: start a fresh one
                f.seek(-1, os.SEEK_END)
                torn = f.read(1) != b"\n"
        self._jsonl = open(path, "a", buffering=1)
        if torn:
            self._jsonl.write("\n")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=os.path.join(self.log_dir, "tensorboard"))
        if progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)

    def _fail(self, e: OSError) -> None:
        """Keep the first failure and stop writing files (the printed lines go on)."""
        if self.problem is None:  # (a FileExistsError comes from os.makedirs: a file where a folder goes)
            what = f"{e.filename} exists and is not a folder" if isinstance(e, FileExistsError) else os_error_text(e)
            self.problem = f"cannot write the metrics: {what}"
        jsonl, tb = self._jsonl, self._tb
        self._jsonl = self._tb = None
        for closing in (jsonl, tb):
            try:
                if closing is not None:
                    closing.close()
            except OSError:  # the buffered rest fails the same way: the first failure is the one reported
                pass

    def _record(self, record: Mapping[str, Any]) -> None:
        """One line of metrics.jsonl (line-buffered: a failed write raises here, naming the file)."""
        if self._jsonl is None:
            return
        try:
            self._jsonl.write(json.dumps(record) + "\n")
        except OSError as e:
            e.filename = e.filename or self._jsonl.name  # a write error names no file
            raise

    def _write(self, kind: str, step: int, values: Mapping[str, Any]) -> None:
        try:
            self._record({"kind": kind, "step": step, "time": time.time(), **values})
        except OSError as e:
            self._fail(e)
        if self._tb is None:
            return
        prefix = "" if kind == "train" else f"{kind}/"
        try:
            for k, v in values.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(prefix + k, v, step)
        except OSError as e:  # raised by the event writer's thread on a later call
            e.filename = e.filename or os.path.join(self.log_dir, "tensorboard")
            self._fail(e)

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
        try:
            self._record({"kind": "event", "time": time.time(), "message": message, **values})
        except OSError as e:
            self._fail(e)
        self._print(message)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        try:
            if self._tb is not None:
                self._tb.close()
            if self._jsonl is not None:
                self._jsonl.close()
        except OSError as e:
            self._fail(e)
        self._tb = self._jsonl = None
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
