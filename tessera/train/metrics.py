"""Training metrics: throughput, achieved TFLOP/s and MFU, memory, and where they are written.

Rank 0 writes every logged step three ways: a concise line (under a tqdm bar when stderr is a terminal: in a
file or a pipe a bar's redraws would run into the lines), TensorBoard scalars,
and one JSON object per line in ``metrics.jsonl`` so scripts can read a run without parsing text; the
precision telemetry's steps (``log_precision``) and lm-eval's scores (``log_eval``) go to the same two
files. With ``metrics.wandb`` the TensorBoard scalars also go to Weights & Biases (``tessera.train.wandb_log``).
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from tessera.files import os_error_text
from tessera.hardware import GPUS, PeakTFLOPS
from tessera.parallel.gemm import linear
from tessera.train.wandb_log import WandbError, WandbRun, wanted

logger = logging.getLogger("tessera")

# the datasheet peaks are the hardware table's (``tessera.hardware``): a name missing there gets a peak measured on
# the device instead (``measure_matmul_tflops``) rather than another variant's
GPU_PEAK_TFLOPS: dict[str, PeakTFLOPS] = {name: spec.peaks for name, spec in GPUS.items()}


def gpu_peak_tflops(device_name: str, precision_name: str) -> float | None:
    """Peak dense TFLOP/s of a GPU (its exact ``torch.cuda.get_device_name``) for a precision
    (float16/bfloat16/tf32/float32), or None if the name is not in the table or has no such unit."""
    peaks = GPU_PEAK_TFLOPS.get(device_name.strip())
    if peaks is None:
        return None
    return {"bfloat16": peaks.bf16, "float16": peaks.fp16, "tf32": peaks.tf32, "float32": peaks.fp32}[precision_name]


def probe_shape(device_type: str) -> tuple[int, int]:
    """(matrix size, matmuls per synchronize) of ``measure_matmul_tflops`` on a device type.

    A GPU needs large matmuls to fill its SMs and reach its tensor-core rate (8192^3: about 1 ms on an
    H100 at its datasheet peak), and many of them between synchronizations so the launch and sync
    latency is spread out; a CPU runs each call to completion, and a 1024^3 matmul already takes its
    threads to their dense rate.
    """
    return (8192, 20) if device_type == "cuda" else (1024, 2)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_matmul_tflops(dtype: torch.dtype, device: torch.device, size: int | None = None, seconds: float = 0.5,
                          *, iterations: int | None = None, warmup: int = 3,
                          timer: Callable[[], float] = time.perf_counter) -> float:
    """Achieved TFLOP/s of square matmuls in ``dtype`` on this device with this process's threads.

    The MFU denominator where no datasheet figure applies: a CPU, or a GPU missing from
    ``GPU_PEAK_TFLOPS``; the best a dense kernel reaches here is the honest figure. ``warmup`` matmuls
    first (kernel selection, clocks), then windows of ``iterations`` back-to-back matmuls with one
    synchronize at the end of each, timed as a whole; windows repeat for ``seconds`` (three at least) and
    the best window's rate is returned. Sizes and iterations default to ``probe_shape``. It runs through
    ``tessera.parallel.gemm.linear``, the kernel the model's linears use, so numerator and denominator
    share one kernel choice; on CUDA the cache allocator's blocks are released after.
    """
    default_size, default_iterations = probe_shape(device.type)
    size, iterations = size or default_size, iterations or default_iterations
    # a private generator: drawing from the ambient one would shift the training RNG streams (dropout)
    # by however many numbers this takes, and a resumed run, which measures after restoring them,
    # would no longer continue the interrupted run's streams
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, generator=g).to(dtype)
    b = torch.randn(size, size, device=device, generator=g).to(dtype)
    for _ in range(warmup):
        linear(a, b)
    _synchronize(device)
    best, windows = 0.0, 0
    deadline = timer() + seconds
    while windows < 3 or timer() < deadline:
        t0 = timer()
        for _ in range(iterations):
            linear(a, b)
        _synchronize(device)
        dt = max(timer() - t0, 1e-12)
        windows += 1
        best = max(best, 2 * size**3 * iterations / dt / 1e12)
    del a, b
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the probe's blocks back to the device before the run allocates
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
                 tensorboard: bool = True, progress_bar: bool = True, wandb: Mapping[str, Any] | None = None,
                 run_config: Mapping[str, Any] | None = None):
        self.enabled = enabled
        self.log_dir = log_dir
        self.problem: str | None = None
        self._bar: Any = None
        self._show_progress = False  # bars on (rank 0, metrics.progress_bar, a terminal): training's, validation's
        self._say_progress = False  # bars wanted but stderr is no terminal: a line says a validation starts
        self._tb: Any = None
        self._jsonl: Any = None
        self._wandb: WandbRun | None = None
        if not enabled:
            return
        try:
            self._open(total_steps, start_step, tensorboard, progress_bar)
            if wanted(wandb):  # ``metrics.wandb``; the run's id is kept in log_dir (see wandb_log)
                assert wandb is not None
                self._wandb = WandbRun(wandb, log_dir, os.path.basename(log_dir), start_step, run_config or {})
        except OSError as e:
            self._fail(e)
        except WandbError as e:
            self.problem = str(e)

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
        self._say_progress = progress_bar and not stderr_is_terminal()
        if progress_bar and not self._say_progress:
            from tqdm import tqdm

            self._show_progress = True
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
        prefix = "" if kind == "train" else f"{kind}/"
        self._scalars(step, {prefix + k: v for k, v in values.items()
                             if isinstance(v, (int, float)) and not isinstance(v, bool)})

    def _scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        """One step's scalars to TensorBoard and, with ``metrics.wandb``, to W&B: the same tags and values."""
        if self._wandb is not None:
            self._wandb.log(step, scalars)
        if self._tb is None:
            return
        try:
            for tag, v in scalars.items():
                self._tb.add_scalar(tag, v, step)
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
        if self._bar is not None and self._bar.total is not None and self._bar.n >= self._bar.total:
            self._bar.close()  # training is over: its clock must not run on through the final validation
            self._bar = None

    def progress(self, items: Iterable[Any], total: int | None, desc: str = "valid") -> Iterable[Any]:
        """``items`` under a bar of their own while the bars are on (a validation pass can take minutes); the
        training bar's clock leaves that time out. Where bars were asked for but stderr is no terminal, one line
        says the pass starts. Elsewhere (other ranks, bars off) ``items`` as they are."""
        if self.enabled and self._say_progress:
            self._print(f"{desc}: {'?' if total is None else total} batches")
        if not (self.enabled and self._show_progress):
            return items
        return self._progress(items, total, desc)

    def _progress(self, items: Iterable[Any], total: int | None, desc: str) -> Iterator[Any]:
        from tqdm import tqdm

        try:
            with tqdm(items, total=total, desc=desc, unit="batch", leave=False, dynamic_ncols=True) as bar:
                yield from bar
        finally:
            if self._bar is not None:
                self._bar.unpause()  # its rate and elapsed time count training only
                self._bar.refresh()

    def log_valid(self, step: int, values: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        self._write("valid", step, values)
        self._print(f"valid step {step} | " + " ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                                            for k, v in values.items()))

    def log_precision(self, step: int, record: Mapping[str, Any]) -> None:
        """A step of the precision telemetry (``PrecisionTelemetry.finish``): one metrics.jsonl line of kind
        ``precision`` and TensorBoard scalars ``precision/<measure>/<row>``, plus the loss scale and skips."""
        if not self.enabled:
            return
        try:
            self._record({"kind": "precision", "step": step, "time": time.time(), **record})
        except OSError as e:
            self._fail(e)
        scalars = {"precision/loss_scale": record["loss_scale"], "precision/skipped_steps": record["skipped_steps"]}
        scalars.update({f"precision/{measure}/{row}": v for measure, rows in record["measures"].items()
                        for row, v in rows.items()})
        self._scalars(step, scalars)

    def log_eval(self, step: int, scores: Mapping[str, Mapping[str, float]], seconds: float | None = None) -> None:
        """lm-eval's scores after ``step`` (``{task: {metric: value}}``, train.py's ``eval`` section): one
        metrics.jsonl line of kind ``eval`` with a key ``<task>/<metric>`` per score (and ``seconds``, the
        evaluation's time), the same numbers as TensorBoard and W&B scalars ``eval/<task>/<metric>``, and a line."""
        if not self.enabled:
            return
        values: dict[str, float] = {f"{task}/{metric}": v for task, row in scores.items() for metric, v in row.items()}
        if seconds is not None:
            values["seconds"] = seconds
        self._write("eval", step, values)
        self._print(f"eval step {step} | " + " | ".join(
            f"{task} " + " ".join(f"{m} {v:.4f}" for m, v in row.items()
                                  if not m.endswith("_stderr") and m != "sample_len")  # the scores alone
            for task, row in scores.items()))

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
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None
        try:
            if self._tb is not None:
                self._tb.close()
            if self._jsonl is not None:
                self._jsonl.close()
        except OSError as e:
            self._fail(e)
        self._tb = self._jsonl = None
        self.enabled = False


def stderr_is_terminal() -> bool:
    """Whether tqdm's bars (drawn on stderr) reach a terminal; redirected to a file or a pipe, their redraws
    would run into the printed lines, so they are left out there, as most tools leave theirs."""
    isatty = getattr(sys.stderr, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (OSError, ValueError):  # a closed or detached stream
        return False


def format_train_line(step: int, v: Mapping[str, Any]) -> str:
    return (f"step {step} | loss {v['loss']:.4f} | lr {v['lr']:.3e} | grad_norm {v['grad_norm']:.3f} | "
            f"loss_scale {v['loss_scale']:g} | skipped {v['skipped_steps']} | tgs {v['tgs']:.0f} | "
            f"tflops {v['tflops']:.3f} | mfu {100 * v['mfu']:.2f}% | step_time {v['step_time']:.3f}s | "
            f"tokens {v['consumed_tokens']} | mem {v['peak_mem_gib']:.2f}GiB")


def setup_logging(rank: int) -> None:
    """INFO on rank 0, WARNING elsewhere, each line tagged with the rank. ``TESSERA_LOG_LEVEL=DEBUG`` (or any
    level name) sets tessera's own logger on every rank: e.g. the traceback behind a one-line error."""
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[%(asctime)s rank{rank} %(levelname)s] %(message)s", datefmt="%H:%M:%S")
    name = os.environ.get("TESSERA_LOG_LEVEL", "").upper()
    level = logging.getLevelName(name) if name else None
    if isinstance(level, int):
        logging.getLogger("tessera").setLevel(level)
    elif name:
        logging.getLogger("tessera").warning("TESSERA_LOG_LEVEL=%s is not a logging level (DEBUG, INFO, WARNING, "
                                             "ERROR): ignored", name)
