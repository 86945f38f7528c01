"""Train a tessera decoder: ``torchrun --nproc_per_node=N train.py --config configs/7B.py [key.sub=value ...]``.

``main`` reads top to bottom: config -> launch (the run description: groups, seeds, precision) -> writable
folders and the save folder's lock -> the ``eval`` section's lm-eval tasks -> will it fit -> data -> the training
stack -> resume -> metrics -> the loop (step, log, validate, checkpoint, evaluate, stop) -> final validation,
checkpoint, evaluation and sample. Each step is a function below it, in that order.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
import torch.distributed as dist

from tessera.checkpoint import (
    CheckpointError,
    Progress,
    RngStreams,
    TrainState,
    find_resumable_checkpoint,
    hold_folder,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from tessera.checkpoint.lock import release_held_folders
from tessera.cli_args import positive_float
from tessera.config import Config, ConfigError, RunConfig
from tessera.config.loading import blame_overrides
from tessera.core.context import gpc, launch_from_slurm, launch_from_torch
from tessera.core.job import Job
from tessera.core.rendezvous import LaunchError, wait_for_peers_to_report
from tessera.data import DataBundle, build_data
from tessera.data.errors import DataError
from tessera.data.stdlib_corpus import prepare_stdlib_corpus
from tessera.data.text_corpus import text_corpus_folders
from tessera.error_file import write_error_file
from tessera.files import os_error_text
from tessera.model import flops_per_token
from tessera.model.kv_cache import generate_ids_cached
from tessera.optim.skips import TooManySkippedSteps
from tessera.parallel.coordination import agree_on_errors, on_rank0_while_others_wait
from tessera.precision.linears import ForwardSchedule, RecipeStates
from tessera.train.builder import TrainingStack, build_training_stack
from tessera.train.live_eval import LiveEval, prepare_live_eval
from tessera.train.lm_eval_adapter import EvalSetupError
from tessera.train.lr_scheduler import WarmupCosineLR
from tessera.train.memory_check import check_memory
from tessera.train.metrics import MetricsWriter, gpu_peak_tflops, measure_matmul_tflops, peak_memory_gib, setup_logging
from tessera.train.stop import StopRequest

logger = logging.getLogger("tessera")
T = TypeVar("T")
# a failure before the job is joined: how long a rank under torchrun waits for the others to report theirs
PEER_REPORT_WAIT_S = 10.0


class TrainingStopped(RuntimeError):
    """The run cannot go on (e.g. it diverged); the message names the step and where to resume from.
    ``every_rank``: every rank raises it together (after an agreement), so each reports before any exits."""

    def __init__(self, message: str, every_rank: bool = False) -> None:
        super().__init__(message)
        self.every_rank = every_rank


@contextlib.contextmanager
def doing(what: str) -> Iterator[None]:
    """Name what the run was doing on a file error raised inside (``run`` reports it in one line); the
    innermost name wins."""
    try:
        yield
    except OSError as e:
        if not hasattr(e, "tessera_doing"):
            e.tessera_doing = what  # type: ignore[attr-defined]
        raise


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="Python config file (runs as code, like any training script)")
    p.add_argument("--launcher", choices=["torch", "slurm"], default="torch")
    p.add_argument("--seed", type=int, default=None, help="overrides the config's seed")
    p.add_argument("--host", default=None, help="slurm: rendezvous host (default: first node of the job)")
    p.add_argument("--port", type=int, default=29500, help="slurm: rendezvous port")
    p.add_argument("--stop-file", default=None, help="touch this file to save a checkpoint and stop")
    p.add_argument("--skip-memory-check", action="store_true",
                   help="start even when the persistent training state exceeds the memory available")
    p.add_argument("--dry-run", action="store_true",
                   help="plan instead of training, on any machine (no GPU needed): one iteration at real size on meta "
                        "tensors, as tools/plan.py (world size: this launch's, else parallel.tensor.size); prints the "
                        "plan, then one verdict line comparing the peak per rank with --gpu-memory, else this "
                        "machine's CUDA device, less memory.headroom: 'fits: ...' exits 0, 'does NOT fit: ...' "
                        "exits 1; with neither it says 'fit not checked: ...' and exits 0")
    p.add_argument("--gpu-memory", type=positive_float, default=None, metavar="GIB",
                   help="--dry-run: GiB per GPU to plan for (default: this machine's CUDA device, if any)")
    p.add_argument("overrides", nargs="*", help="key.sub=value pairs (Python literals) overriding the config")
    return p.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(int(os.environ.get("RANK" if args.launcher == "torch" else "SLURM_PROCID", "0")))
    with doing(f"reading the config {args.config}"):  # every config mistake is reported before any group exists
        config = Config.from_file(args.config, args.overrides)
    cfg = config.typed  # what this script reads: mypy checks every key (Config hands whole sections down)
    if args.dry_run:
        return dry_run_report(config, args.config, args.gpu_memory)
    with doing("launching"):
        job = launch_job(config, args)
    with doing("checking the output folders"):
        check_output_folders(cfg)
        hold_save_folder(cfg, job)
    with doing("checking the eval section"):  # lm-eval and every task named, before any step
        evals = prepare_live_eval(cfg, job)
    peak = mfu_peak(cfg, job)
    if not args.skip_memory_check:
        check_it_fits(config, job)
    with doing(f"reading the data ({_data_keys(cfg)})"):
        data = load_data(cfg, job)
    with doing("building the model and optimizer"):
        stack = build_training_stack(cfg, job, before_cast=lambda model: weights_only_start(cfg, job, model))
    run = Run(config, job, stack, data, peak, evals)
    with doing(f"resuming from ckpt.save_ckpt_folder={cfg.ckpt.save_ckpt_folder}"):
        resume(run)
    open_metrics(run)
    with doing("training"):
        train_loop(run, args.stop_file)
    with doing("finishing"):
        finish(run)
    gpc.destroy()
    return 0


def launch_job(config: Config, args: argparse.Namespace) -> Job:
    """Join the job (process groups, RNG streams, precision switches); its description, built once."""
    seed = config.typed.seed if args.seed is None else args.seed
    try:
        if args.launcher == "slurm":
            launch_from_slurm(config, host=args.host, port=args.port, seed=seed)
        else:
            launch_from_torch(config, seed=seed)
    except ConfigError as e:  # the layout against the world size: name the override that set it, if one did
        raise blame_overrides(e, args.overrides, args.config) from None
    job = gpc.job
    assert job is not None
    lay = job.layout
    logger.info("launched: world %d = tp %d x dp %d, zero1 %d, dtype %s, device %s", lay.world_size, lay.tp_size,
                lay.dp_size, lay.zero1_size, job.precision.name, job.device)
    return job


def check_output_folders(cfg: RunConfig) -> None:
    """The folders the run writes (logs, checkpoints, data cache): a problem on any rank stops every rank now,
    not at the first save."""
    _exit_on(agree_on_errors(output_folder_problem(cfg)))


def hold_save_folder(cfg: RunConfig, job: Job) -> None:
    """One run per save folder: rank 0 takes ``ckpt.save_ckpt_folder``'s lock for the whole run (it saves there, or
    tidies up interrupted saves when resuming) and every rank stops when another run holds it. The OS drops the
    lock when rank 0 exits, however it exits, so a requeued run takes it at once. A run that only resumes takes it
    where the folder exists and can be written (a read-only folder gets no tidying either)."""
    folder, saves = cfg.ckpt.save_ckpt_folder, cfg.ckpt.enable_save_ckpt
    if not folder or not (saves or cfg.ckpt.auto_resume):
        return
    problem = None
    if job.is_rank0 and (saves or os.path.isdir(folder)):
        try:
            hold_folder(folder)
        except CheckpointError as e:
            problem = f"ckpt.save_ckpt_folder={e}"
        except OSError as e:
            if saves:
                problem = f"ckpt.save_ckpt_folder={folder}: cannot take its lock: {os_error_text(e)}"
            else:
                logger.info("resuming from %s without its lock (%s)", folder, os_error_text(e))
    _exit_on(agree_on_errors(problem))


def mfu_peak(cfg: RunConfig, job: Job) -> tuple[float, str]:
    """The MFU denominator, found before the model takes its memory (the run's peak memory leaves the probe out)."""
    peak = peak_tflops_per_device(cfg, job)
    if job.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(job.device)
    return peak


def peak_tflops_per_device(cfg: RunConfig, job: Job) -> tuple[float, str]:
    """The config's override, the GPU table (exact device name), or matmuls measured here in the run's dtype (a
    CPU, or a GPU the table does not list)."""
    device = job.device
    if cfg.metrics.peak_tflops:
        return cfg.metrics.peak_tflops, "config"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        table = gpu_peak_tflops(name, job.precision.name)
        if table:
            return table, name
        logger.warning("no peak TFLOP/s known for %s; measuring a matmul instead (set metrics.peak_tflops)", name)
    return measure_matmul_tflops(job.dtype, device), f"measured {job.dtype} matmul"


def check_it_fits(config: Config, job: Job) -> None:
    """The persistent state of this layout (counted on the meta device) against this rank's memory; every rank
    reaches the same verdict and each says so before any exits (torchrun stops the rest at the first exit)."""
    problem = check_memory(config, job)
    if problem:
        _exit_together(problem)


def load_data(cfg: RunConfig, job: Job) -> DataBundle:
    """The loaders of this DP rank; a problem on any rank (missing, unreadable, a disk full while preparing)
    stops every rank. The stdlib corpus and raw text (``data.type='text'``) are tokenized by rank 0 while the
    others wait in the agreement, so a bad file or record is every rank's one error line before any step."""
    if cfg.data.type == "stdlib":
        problem = on_rank0_while_others_wait(job.is_rank0, lambda: _data_step(
            cfg, lambda: prepare_stdlib_corpus(cfg.data.cache_folder, progress=True))[1])
        _exit_on(agree_on_errors(problem))
    if cfg.data.type == "text":
        problem = on_rank0_while_others_wait(
            job.is_rank0, lambda: _data_step(cfg, lambda: text_corpus_folders(cfg.data.as_dict(), progress=True))[1])
        _exit_on(agree_on_errors(problem))
    lay = job.layout
    data, problem = _data_step(cfg, lambda: build_data(
        cfg.data.as_dict(), vocab_size=cfg.model.vocab_size, max_seq_len=cfg.model.max_position_embeddings,
        dp_rank=lay.dp_rank, dp_size=lay.dp_size, seed=job.seed, barrier=dist.barrier, is_main=job.is_rank0,
        progress=job.is_rank0))
    _exit_on(agree_on_errors(problem))
    assert data is not None  # no rank had a problem
    logger.info("data: %s", data.info)
    return data


def weights_only_start(cfg: RunConfig, job: Job, model: torch.nn.Module) -> None:
    """``ckpt.load_ckpt_folder``: the fp32, TP-sharded decoder starts from those weights (before the precision
    cast), unless the run already saved checkpoints of its own to resume from."""
    folder = cfg.ckpt.load_ckpt_folder
    if not folder or _has_checkpoint(cfg):
        return
    with doing(f"loading ckpt.load_ckpt_folder={folder}"):
        try:
            load_checkpoint(folder, TrainState(model), layout=job.layout, load_optimizer=False,
                            load_components=False)
        except CheckpointError as e:  # name the key the path came from
            raise CheckpointError(f"ckpt.load_ckpt_folder={folder}: {e}", every_rank=e.every_rank) from None
    logger.info("initialized weights from %s", folder)


class Run:
    """What the loop works on: the config (``cfg``, its typed view, is what the loop reads), the job, the stack,
    the data, and what a checkpoint holds (one registry: saving and resuming iterate it). A plain class, not a
    dataclass: tests load this script from its path without registering it as a module, which a dataclass's
    annotations need."""

    def __init__(self, config: Config, job: Job, stack: TrainingStack, data: DataBundle,
                 peak: tuple[float, str], evals: LiveEval) -> None:
        self.config, self.cfg = config, config.typed
        self.job, self.stack, self.data, self.evals = job, stack, data, evals
        cfg = self.cfg
        self.peak = peak  # MFU denominator (TFLOP/s per device) and where it came from
        self.last_ckpt: str | None = None
        self.metrics: MetricsWriter | None = None
        self.progress = Progress()
        self.state = TrainState(stack.inner_model, stack.optimizer, progress=self.progress,
                                lr_scheduler=stack.scheduler, sampler=data.train)
        self.rng = RngStreams(gpc)
        self.state.register("rng", self.rng, per_rank=True)
        self.forward_schedule = ForwardSchedule(stack.inner_model, job.precision.gemms)
        recipes = RecipeStates(stack.inner_model)  # GEMM recipes that own state (an RNG stream...): per rank
        if recipes:
            self.state.register("gemm_recipes", recipes, per_rank=True)
        self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len)

    @property
    def log(self) -> MetricsWriter:
        assert self.metrics is not None, "open_metrics(run) first"
        return self.metrics

    def metrics_problem(self) -> str | None:
        """Rank 0's metrics files: a failure stops every rank (agreed)."""
        problem = self.metrics.problem if self.metrics is not None else None
        if problem and problem.startswith("metrics.wandb"):  # names its own key
            return problem
        return f"log_folder={self.cfg.log_folder}: {problem}" if problem else None

    def save(self) -> str:
        """A checkpoint of this step (none written twice for the same step)."""
        folder, step = self.cfg.ckpt.save_ckpt_folder, self.progress.step
        assert folder is not None, "check_config: ckpt.enable_save_ckpt needs ckpt.save_ckpt_folder"
        if self.last_ckpt == os.path.join(folder, f"step_{step}"):
            return self.last_ckpt  # saved (or resumed from) at this very step: same state, nothing to write
        self.last_ckpt = save_checkpoint(folder, step, self.state, config=self.config.to_dict(), layout=self.job.layout,
                                         keep_last=self.cfg.ckpt.keep_last)
        self.log.log_event(f"saved checkpoint {self.last_ckpt}", checkpoint=self.last_ckpt)
        return self.last_ckpt

    def validate(self) -> None:
        if self.data.valid is not None:
            batches = self.log.progress(self.data.valid, len(self.data.valid), desc="validation")
            values = self.stack.trainer.evaluate(batches)
            if self.data.info.get("type") == "synthetic":  # random ids stand for no text: no bits per byte
                values.pop("bits_per_byte", None)
            self.log.log_valid(self.progress.step, values)

    def evaluate_tasks(self) -> None:
        """``eval``: lm-eval's tasks on the live model, consolidated on rank 0 while the others wait; training
        goes on unchanged (tessera.train.live_eval)."""
        self.evals.run(self.progress.step, self.stack.inner_model, self.stack.optimizer, self.rng, self.log)


def resume(run: Run) -> None:
    """Continue from the newest complete checkpoint of ``ckpt.save_ckpt_folder`` (damaged ones are skipped
    with a warning)."""
    cfg, job, progress = run.cfg, run.job, run.progress
    if not (cfg.ckpt.auto_resume and cfg.ckpt.save_ckpt_folder):
        return
    run.last_ckpt, meta = find_resumable_checkpoint(cfg.ckpt.save_ckpt_folder, job.layout,
                                                    load=lambda path: load_checkpoint(path, run.state,
                                                                                      layout=job.layout))
    if not run.last_ckpt:
        return
    if not meta["rank_state_loaded"]:  # a different TP/DP layout: per-rank streams cannot be carried over
        gpc.set_seed(job.seed + progress.step)
    logger.info("resumed from %s at step %d", run.last_ckpt, progress.step)
    schedule_change = lr_schedule_change(meta.get("config"), cfg, progress.step)
    if schedule_change:
        logger.warning(schedule_change)
    if progress.step > cfg.data.total_steps:
        logger.warning("%s is past data.total_steps=%d: nothing to train, only the final validation and sample "
                       "run (train longer by raising data.total_steps, or start over with another "
                       "ckpt.save_ckpt_folder or ckpt.auto_resume=False)", run.last_ckpt, cfg.data.total_steps)


def lr_schedule_change(saved: dict | None, cfg: RunConfig, step: int) -> str | None:
    """A warning when the resumed checkpoint's run planned another LR schedule length than this one (e.g.
    ``data.total_steps`` raised to train longer, which ``lr_scheduler.total_steps`` follows unless set): the
    schedule is a function of the step and this run's config, so it is recomputed and the learning rate jumps.
    The config wins (the run trains on over the new length, as asked); the warning names both lengths, the jump,
    and how to keep the saved schedule instead. None when the lengths agree, or the checkpoint has no config."""
    old = (saved or {}).get("lr_scheduler", {}).get("total_steps")
    new = cfg.lr_scheduler.total_steps
    if old is None or int(old) == new:
        return None
    sched = cfg.lr_scheduler
    before, after = (WarmupCosineLR([], cfg.adam.lr, total, sched.warmup_ratio, sched.eta_min, sched.init_steps)
                     for total in (int(old), new))
    return (f"lr_scheduler.total_steps is {new} here, {old} in the checkpoint's run (it follows data.total_steps "
            f"unless set): the learning-rate schedule is recomputed over {new} steps, so step {step + 1} uses lr "
            f"{after.lr_at(step):.3e} where the saved schedule gave {before.lr_at(step):.3e}; set "
            f"lr_scheduler.total_steps={old} to keep the saved schedule (past step {old} it stays at "
            f"lr_scheduler.eta_min={sched.eta_min:g})")


def open_metrics(run: Run) -> None:
    """metrics.jsonl, TensorBoard, W&B (``metrics.wandb``) and the progress bar on rank 0; a failure there stops
    every rank."""
    cfg = run.cfg
    run.metrics = MetricsWriter(os.path.join(cfg.log_folder, cfg.job_name), run.job.is_rank0, cfg.data.total_steps,
                                run.progress.step, cfg.metrics.tensorboard, cfg.metrics.progress_bar,
                                wandb=cfg.metrics.wandb.as_dict(), run_config=cfg.as_dict())
    _exit_on(agree_on_errors(run.metrics_problem()))
    peak, source = run.peak
    run.log.log_event(f"peak {peak:.3f} TFLOP/s per device ({source}); {run.flops_per_token / 1e6:.2f} MFLOP per "
                      "token", peak_tflops=peak, flops_per_token=run.flops_per_token, resumed_from=run.last_ckpt,
                      start_step=run.progress.step, seed=run.job.seed)  # the seed: compare_runs pairs runs by it


def train_loop(run: Run, stop_file: str | None) -> None:
    """Steps until ``data.total_steps`` or a stop request (a signal, ``--stop-file``, a metrics failure)."""
    cfg, progress = run.cfg, run.progress
    stop = StopRequest(stop_file=stop_file)
    stop.install()
    while progress.step < cfg.data.total_steps:
        train_one_step(run)
        step = progress.step
        if cfg.data.valid_every and step % cfg.data.valid_every == 0 and step < cfg.data.total_steps:
            run.validate()
        if (cfg.ckpt.enable_save_ckpt and cfg.ckpt.checkpoint_every and step % cfg.ckpt.checkpoint_every == 0
                and step < cfg.data.total_steps):
            run.save()
        if run.evals.due(step, cfg.data.total_steps):
            run.evaluate_tasks()
        _, reason = stop.should_stop(problem=run.metrics_problem())  # one agreement for both
        if reason is not None:  # a reason exactly when a stop was agreed
            stop_now(run, stop, reason, stop_file)
            break


def train_one_step(run: Run) -> None:
    """One optimizer step, and its metrics (every step to metrics.jsonl and TensorBoard; ``metrics.log_every``
    paces the printed line)."""
    cfg, progress, optimizer = run.cfg, run.progress, run.stack.optimizer
    lr = run.stack.scheduler.current_lr
    run.forward_schedule.before_step(progress.step + 1)
    try:
        result = run.stack.trainer.train_step(run.data.train.next_step_batches(), step=progress.step + 1)
    except TooManySkippedSteps as e:
        raise TrainingStopped(f"stopping at step {progress.step + 1}: {e}; last good checkpoint: "
                              f"{run.last_ckpt or 'none'}") from None
    run.stack.scheduler.step()
    progress.step += 1
    progress.consumed_tokens += result.tokens
    step = progress.step
    tgs = result.tokens / result.step_time / run.job.layout.world_size
    tflops = tgs * run.flops_per_token / 1e12
    run.log.log_train(step, {
        "loss": result.loss, "lr": lr, "grad_norm": result.grad_norm, "loss_scale": optimizer.loss_scale,
        "skipped_steps": optimizer.skipped_steps, "success": result.success, "tgs": tgs,
        "tflops": tflops, "mfu": tflops / run.peak[0], "step_time": result.step_time,
        "consumed_tokens": progress.consumed_tokens, "peak_mem_gib": peak_memory_gib(run.job.device),
    }, line=step % cfg.metrics.log_every == 0 or step == cfg.data.total_steps)
    if result.precision is not None:  # metrics.precision_every: per-module numerics of this step
        run.log.log_precision(step, result.precision)


def stop_now(run: Run, stop: StopRequest, reason: str, stop_file: str | None) -> None:
    """A stop every rank agreed on: save, then stop with the problem (if any) or remove the stop file."""
    step = run.progress.step
    run.log.log_event(f"stop requested ({reason}) after step {step}")
    if run.cfg.ckpt.enable_save_ckpt:
        run.save()
    if stop.problems:  # the state so far is saved: stop with the problem on every rank
        raise TrainingStopped(f"{reason}; stopped after step {step}, last checkpoint: {run.last_ckpt or 'none'}",
                              every_rank=True)
    try:
        stop.consume()  # every rank has seen it: remove the stop file so a relaunch trains on
    except OSError as e:
        raise TrainingStopped(f"--stop-file {stop_file}: cannot remove it after stopping ({os_error_text(e)}): "
                              "remove it before relaunching, or the next launch stops after its first step; last "
                              f"checkpoint: {run.last_ckpt or 'none'}") from None


def finish(run: Run) -> None:
    """At ``data.total_steps``: the final validation, checkpoint, evaluation and sample; then close the metrics."""
    cfg, job = run.cfg, run.job
    if run.progress.step >= cfg.data.total_steps:
        run.validate()
        if cfg.ckpt.enable_save_ckpt:
            run.save()
        if run.evals.due_at_end(run.progress.step):
            run.evaluate_tasks()
        tokenizer = run.data.tokenizer
        if cfg.generate.max_new_tokens and tokenizer is not None:
            gen = cfg.generate
            ids = generate_ids_cached(run.stack.inner_model, tokenizer.encode(gen.prompt), gen.max_new_tokens,
                                      temperature=gen.temperature, top_k=gen.top_k, top_p=gen.top_p,
                                      tp_group=job.groups.tp, device=job.device, seed=job.seed,
                                      max_seq_len=cfg.model.max_position_embeddings, vocab_size=tokenizer.vocab_size)
            sample = tokenizer.decode(ids)
            run.log.log_event("sample:\n" + sample, sample=sample)
    run.log.close()
    problems = agree_on_errors(run.metrics_problem())
    if problems:
        raise TrainingStopped(f"{'; '.join(problems)}; training finished at step {run.progress.step}, last "
                              f"checkpoint: {run.last_ckpt or 'none'}", every_rank=True)


def dry_run_report(config: Config, config_name: str, gpu_memory: float | None = None) -> int:
    """``--dry-run``: rank 0 of the launch prints the plan of this job (tools/plan.py) and its verdict against
    ``gpu_memory`` GiB, else this machine's CUDA device (the table's datasheet figures for a device it lists, the
    device's own total otherwise); exit 1 when it does not fit. Without either nothing is compared, and the last
    line says so."""
    if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) != "0":
        return 0  # one plan per job: every rank of a layout is planned alike
    from tessera.plan import gpu_for_device_name, make_plan

    world = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", config.typed.parallel.tensor.size)))
    gpu, memory, source = None, gpu_memory, "--gpu-memory"
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        gpu = gpu_for_device_name(name)
        if memory is None and gpu is None:  # a device the table does not list: its own total
            memory, source = torch.cuda.get_device_properties(0).total_memory / 2**30, f"{name}'s total"
    plan = make_plan(config, world, config_name=config_name, gpu=gpu, memory_gib=memory, memory_source=source)
    print(plan.format(), flush=True)
    if plan.fits is None:
        print("fit not checked: compared against no GPU memory (no CUDA device here); give --gpu-memory GIB to "
              "compare the peak with", flush=True)
    return 1 if plan.fits is False else 0


def output_folder_problem(cfg: RunConfig) -> str | None:
    """Every folder the run will write — logs, checkpoints, the data cache when it has to be filled — is
    created if missing and written to once; the first that fails, as ``key=path: what failed``, or None."""
    from tessera.data.stdlib_corpus import stdlib_corpus_ready
    from tessera.files import folder_write_problem

    folders = [("log_folder", cfg.log_folder, os.path.join(cfg.log_folder, cfg.job_name))]  # key, value, folder
    if cfg.ckpt.enable_save_ckpt and cfg.ckpt.save_ckpt_folder:
        folders.append(("ckpt.save_ckpt_folder", cfg.ckpt.save_ckpt_folder, cfg.ckpt.save_ckpt_folder))
    if (cfg.data.type == "stdlib" and not stdlib_corpus_ready(cfg.data.cache_folder)) or cfg.data.type == "text":
        folders.append(("data.cache_folder", cfg.data.cache_folder, cfg.data.cache_folder))
    for key, value, path in folders:
        problem = folder_write_problem(path)
        if problem:
            return f"{key}={value}: {problem}"
    return None


def _data_keys(cfg: RunConfig) -> str:
    """The config keys naming where the data comes from, for error lines."""
    if cfg.data.type == "stdlib":
        return f"data.cache_folder={cfg.data.cache_folder}"
    if cfg.data.type == "text":
        return f"data.train_folder={cfg.data.train_folder}, data.cache_folder={cfg.data.cache_folder}"
    if cfg.data.type == "tokens":
        return ", ".join(f"data.{k}={folder}" for k, folder in (("train_folder", cfg.data.train_folder),
                                                                 ("valid_folder", cfg.data.valid_folder)) if folder)
    return f"data.type={cfg.data.type}"


def _data_step(cfg: RunConfig, step: Callable[[], T], run_here: bool = True) -> tuple[T | None, str | None]:
    """``(step(), None)``, or ``(None, its error as one line)``: a data error names its file already, a failed
    file operation gets the data keys. With ``run_here`` False nothing runs (another rank does it)."""
    if not run_here:
        return None, None
    try:
        return step(), None
    except DataError as e:
        return None, str(e)
    except OSError as e:
        return None, f"{_data_keys(cfg)}: {os_error_text(e)}"


def _has_checkpoint(cfg: RunConfig) -> bool:
    """A run that already saved checkpoints resumes from them instead of re-loading load_ckpt_folder."""
    return bool(cfg.ckpt.auto_resume and cfg.ckpt.save_ckpt_folder and list_checkpoints(cfg.ckpt.save_ckpt_folder))


def _report(text: str) -> None:
    """``[rank R] text`` on stderr in one write, so ranks sharing a terminal or log never interleave lines; the
    bare text before a rank exists (no launcher gave one, and the job is not joined yet). Under torchrun the text
    is also this rank's error file (``tessera.error_file``), which torchrun's failure summary shows."""
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID"))
    if rank is None and dist.is_initialized():  # a single process launched without a launcher: rank 0 of 1
        rank = str(dist.get_rank())
    data = (f"[rank {rank}] {text}\n" if rank is not None else f"{text}\n").encode()
    # one error line is the whole report: ``python -m tessera.run`` then leaves out torchrun's traceback
    write_error_file(data.decode().rstrip("\n"), complete=text.startswith("error: ") and "\n" not in text)
    sys.stderr.flush()
    while data:  # one write unless the pipe takes less (only past its atomic size, e.g. a long traceback)
        data = data[os.write(sys.stderr.fileno(), data):]


def _exit_together(message: str) -> None:
    """Report on this rank, wait until every rank has (they all reached the same verdict), then exit 1."""
    _report(f"error: {message}")
    dist.barrier()
    _exit_now(1)


def _exit_now(code: int) -> None:
    """``os._exit``: skip interpreter teardown, which can block on a process group whose peers died; the save
    folder's lock is released first (``atexit`` does not run), so its lock file does not linger."""
    release_held_folders()
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(code)


def _exit_on(problems: list[str]) -> None:
    """``_exit_together`` when an agreement found problems (the same list on every rank)."""
    if problems:
        _exit_together("; ".join(problems))


def _bad_environment_variable(e: BaseException) -> str | None:
    """The message of a ``ValueError`` that rejects the value of one of tessera's environment variables (its
    readers raise ``ValueError("TESSERA_NAME='value': what it must be")``, read where the value is first needed,
    e.g. ``TESSERA_CPU_LOWP_MATMUL`` at the first CPU matmul), found in ``e`` or what it wraps; else None."""
    seen: set[int] = set()
    cause: BaseException | None = e
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        name = str(cause).split("=", 1)[0]
        if isinstance(cause, ValueError) and name.startswith("TESSERA_") and name in os.environ:
            return str(cause)
        cause = cause.__cause__ or cause.__context__
    return None


def run() -> None:
    """Exit non-zero on every failing rank at once; never wait on peers that may be gone."""
    try:
        sys.exit(main())
    except (ConfigError, LaunchError, DataError, CheckpointError, EvalSetupError, TrainingStopped) as e:
        logger.debug("the traceback of the error below:", exc_info=True)  # TESSERA_LOG_LEVEL=DEBUG shows it
        if getattr(e, "every_rank", False) and dist.is_initialized():
            _exit_together(str(e))  # every rank raised it together: each reports before any exits
        _report(f"error: {e}")
        if not dist.is_initialized():  # before the job exists, ranks often fail alike: let each say it
            wait_for_peers_to_report(PEER_REPORT_WAIT_S)
    except OSError as e:  # a file operation the environment refused (missing, unreadable, unwritable, full)
        if e.filename is None:  # not a file (a socket, a timeout): the traceback says where
            _report(f"training failed:\n{traceback.format_exc()}")
        else:
            _report(f"error: {getattr(e, 'tessera_doing', 'starting')}: {os_error_text(e)}")
    except Exception as e:  # report with the traceback (one line for a bad variable), then take the job down
        bad_variable = _bad_environment_variable(e)
        if bad_variable:
            logger.debug("the traceback of the error below:", exc_info=True)
            _report(f"error: environment variable {bad_variable}")
        else:
            _report(f"training failed:\n{traceback.format_exc()}")
    _exit_now(1)  # torchrun sees the non-zero exit and stops the other ranks


if __name__ == "__main__":
    run()
