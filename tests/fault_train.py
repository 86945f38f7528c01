"""``train.py`` with faults injected from environment variables — for tests/test_reliability.py only.

Run it exactly like train.py (``torchrun ... tests/fault_train.py --config ... key=value``). Production
code stays free of fault switches: everything here is a monkeypatch applied before ``train.run()``.

Faults fire only in the torchrun attempt ``TESSERA_FAULT_ATTEMPT`` (default 0, the first launch;
torchrun's ``TORCHELASTIC_RESTART_COUNT`` counts attempts), so a restarted attempt runs clean.
``RANK`` below is the global rank, ``STEP`` the 1-based optimizer step being computed.

  TESSERA_FAULT_KILL="RANK:STEP"        SIGKILL this rank mid-step (after the forward pass)
  TESSERA_FAULT_RAISE="RANK:STEP"       raise RuntimeError mid-step
  TESSERA_FAULT_HANG="RANK:STEP"        sleep forever mid-step (peers must time out, not hang); SIGTERM
                                        kills it at once (train.py's handler only sets a flag, so a
                                        sleeping rank would wait for torchrun's SIGKILL 30 s later,
                                        as one stuck outside Python does)
  TESSERA_FAULT_NAN="RANK:S1,S2,..."    make the loss NaN at those steps on RANK ("*" = every rank)
  TESSERA_FAULT_SAVE="RANK:STEP:POINT"  SIGKILL RANK while saving the checkpoint of STEP, at POINT:
                                        "mid_write" (its model shard written, its optimizer shard not)
                                        or "before_commit" (rank 0: all files + meta.json written,
                                        folder not yet renamed into place)
  TESSERA_FAULT_READY="STEP:PATH"       rank 0 creates PATH once STEP is done; then every rank holds at
                                        the end of STEP until a stop request has reached it (a signal,
                                        through train.py's handler, or the --stop-file exists), so the
                                        run stops after exactly STEP however late the test signals; a
                                        rank still holding after HOLD_GUARD_S raises (a hang guard)
  TESSERA_FAULT_TRACE=FOLDER            every rank appends one JSON line per step to
                                        FOLDER/trace_rank<R>.jsonl: attempt, step, the global sample
                                        ids it trained on, a digest of its RNG states at step start,
                                        success, and a digest of its parameters after the step
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import random
import signal
import sys
import time

import numpy as np
import torch

from tessera.data.loader import TrainLoader
from tessera.train.step import Trainer
from tessera.train.stop import StopRequest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_train_script():
    """The repository's train.py as module ``train``: a script at the root, not part of the installed package,
    so it is loaded from its path (no ``sys.path`` edit; torchrun puts only tests/ on this script's path)."""
    spec = importlib.util.spec_from_file_location("train", os.path.join(ROOT, "train.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["train"] = module
    spec.loader.exec_module(module)
    return module


train = _load_train_script()
# the module whose ``write_tree`` and ``commit_folder`` train.py's save_checkpoint calls (patched below),
# wherever the checkpoint package keeps it
ckpt_mod = sys.modules[train.save_checkpoint.__module__]

RANK = int(os.environ.get("RANK", "0"))
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
ARMED = ATTEMPT == int(os.environ.get("TESSERA_FAULT_ATTEMPT", "0"))
STEP = {"n": 0}  # the step being computed (set when its batches are drawn)


def _rank_step(name: str) -> int | None:
    """The step at which fault ``name`` fires on this rank, or None."""
    value = os.environ.get(name)
    if not value or not ARMED:
        return None
    rank, step = value.split(":")[:2]
    return int(step) if rank in ("*", str(RANK)) else None


def _nan_steps() -> set[int]:
    value = os.environ.get("TESSERA_FAULT_NAN")
    if not value or not ARMED:
        return set()
    rank, steps = value.split(":")
    return {int(s) for s in steps.split(",")} if rank in ("*", str(RANK)) else set()


KILL_AT, RAISE_AT, HANG_AT = (_rank_step(n) for n in ("TESSERA_FAULT_KILL", "TESSERA_FAULT_RAISE", "TESSERA_FAULT_HANG"))
NAN_AT = _nan_steps()
SAVE = os.environ.get("TESSERA_FAULT_SAVE", "").split(":") if ARMED and os.environ.get("TESSERA_FAULT_SAVE") else None
READY = os.environ.get("TESSERA_FAULT_READY", "").split(":") if os.environ.get("TESSERA_FAULT_READY") else None
TRACE = os.environ.get("TESSERA_FAULT_TRACE")
_trace_file = None
HOLD_GUARD_S = 300  # TESSERA_FAULT_READY: a test that never sends its stop request fails instead of hanging


def _say(msg: str) -> None:
    print(f"[fault_train rank {RANK} attempt {ATTEMPT}] {msg}", file=sys.stderr, flush=True)


def _die(why: str) -> None:
    _say(f"SIGKILL: {why}")
    os.kill(os.getpid(), signal.SIGKILL)


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def _rng_digest() -> str:
    h = hashlib.sha256(torch.get_rng_state().numpy().tobytes())
    h.update(repr(random.getstate()).encode())
    h.update(np.random.get_state()[1].tobytes())
    return h.hexdigest()[:16]


def _trace(record: dict) -> None:
    global _trace_file
    if not TRACE:
        return
    if _trace_file is None:
        os.makedirs(TRACE, exist_ok=True)
        _trace_file = open(os.path.join(TRACE, f"trace_rank{RANK}.jsonl"), "a", buffering=1)
    _trace_file.write(json.dumps({"rank": RANK, "attempt": ATTEMPT, **record}) + "\n")


# ---------------------------------------------------------------------------- data: which step, which rows
_orig_next = TrainLoader.next_step_batches


def _next_step_batches(self: TrainLoader):
    STEP["n"] = self.sampler.consumed_rows // self.rows_per_step + 1
    STEP["rng"] = _rng_digest()
    batches = _orig_next(self)
    STEP["samples"] = [int(i) for b in batches for i in b["sample_ids"].tolist()]
    return batches


TrainLoader.next_step_batches = _next_step_batches


# ---------------------------------------------------------------------------- the step
class FaultTrainer(Trainer):
    """The production Trainer with faults injected into the training loss (validation is left alone)."""

    def _loss(self, batch, reduction="mean", label_smoothing=None):
        loss = super()._loss(batch, reduction, label_smoothing)
        return self._fault_hook(loss) if self.model.training else loss

    def _fault_hook(self, loss: torch.Tensor) -> torch.Tensor:
        step = STEP["n"]
        if step == KILL_AT:
            _die(f"killed mid-step {step}")
        if step == RAISE_AT:
            raise RuntimeError(f"injected fault: rank {RANK} raises mid-step {step}")
        if step == HANG_AT:
            _say(f"hanging mid-step {step}")
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            while True:
                time.sleep(3600)
        if step in NAN_AT:
            _say(f"NaN loss at step {step}")
            return loss * float("nan")
        return loss

    def train_step(self, micro_batches, step=None):
        result = super().train_step(micro_batches, step)
        step = STEP["n"]
        _trace({"step": step, "samples": STEP["samples"], "rng": STEP["rng"], "success": result.success,
                "loss": result.loss, "params": _digest(p for p in self.model.parameters())})
        if READY and step == int(READY[0]):
            if RANK == 0:
                with open(READY[1], "w") as f:
                    f.write(str(step))
            _hold_until_stop_requested(step)
        return result


train.build_training_stack = functools.partial(train.build_training_stack, trainer_cls=FaultTrainer)


# ---------------------------------------------------------------------------- holding for a stop request
_STOPS: list[StopRequest] = []  # the StopRequest train.py's loop installed (its handler records signals)
_orig_install = StopRequest.install


def _install(self: StopRequest) -> None:
    _STOPS.append(self)
    _orig_install(self)


StopRequest.install = _install


def _hold_until_stop_requested(step: int) -> None:
    """Wait until this rank's stop request is pending: the signal handler has run (it sets ``reason``), or the
    stop file exists. The step boundary that follows agrees on it, so the run stops after ``step``."""
    stop = _STOPS[-1]
    deadline = time.monotonic() + HOLD_GUARD_S
    while stop.reason is None and not (stop.stop_file and os.path.exists(stop.stop_file)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"fault_train: no stop request reached rank {RANK} within {HOLD_GUARD_S} s "
                               f"after step {step} (TESSERA_FAULT_READY)")
        time.sleep(0.01)
    _say(f"stop request seen after step {step}")


# ---------------------------------------------------------------------------- checkpoint saving
if SAVE is not None:
    save_rank, save_step, point = int(SAVE[0]), int(SAVE[1]), SAVE[2]
    if point not in ("mid_write", "before_commit"):
        raise SystemExit(f"TESSERA_FAULT_SAVE: unknown point {point!r}")
    if point == "before_commit" and save_rank != 0:
        raise SystemExit("TESSERA_FAULT_SAVE: before_commit runs on rank 0 only")

    _orig_write_tree, _orig_commit_folder = ckpt_mod.write_tree, ckpt_mod.commit_folder

    def _write_tree(path, obj):
        in_save = f".step_{save_step}.partial" in path
        if point == "mid_write" and RANK == save_rank and in_save and os.path.basename(path).startswith("optim_"):
            _die(f"killed while writing {path}")
        return _orig_write_tree(path, obj)

    def _commit_folder(partial, final):  # the rename that publishes the checkpoint: meta.json is written
        if point == "before_commit" and RANK == save_rank and f".step_{save_step}.partial" in partial:
            _die(f"killed before committing {partial}")
        return _orig_commit_folder(partial, final)

    ckpt_mod.write_tree, ckpt_mod.commit_folder = _write_tree, _commit_folder


# ---------------------------------------------------------------------------- how main() ended
_orig_main = train.main


def _main(*args, **kwargs):
    rc = _orig_main(*args, **kwargs)
    _say(f"main returned {rc}")
    return rc


train.main = _main

if __name__ == "__main__":
    train.run()
