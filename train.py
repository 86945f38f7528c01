"""Train a tessera decoder: ``torchrun --nproc_per_node=N train.py --config configs/7B.py [key.sub=value ...]``.

Read top to bottom: config -> launch (groups, seeds, precision) -> writable folders -> will it fit -> data -> model
-> precision wrapper -> optimizer and LR schedule -> resume -> loop (step, log, validate, checkpoint, stop) -> final
validation, checkpoint and sample.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from tessera.checkpoint import (
    CheckpointError,
    Layout,
    Progress,
    RngStreams,
    TrainState,
    find_resumable_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from tessera.config import Config, ConfigError
from tessera.config.precision import resolve_precision
from tessera.data import build_data
from tessera.data.errors import DataError
from tessera.data.stdlib_corpus import prepare_stdlib_corpus
from tessera.dist import ParallelMode, gpc, launch_from_slurm, launch_from_torch
from tessera.files import os_error_text
from tessera.model import flops_per_token
from tessera.model.kv_cache import generate_ids_cached
from tessera.optim.skips import TooManySkippedSteps
from tessera.parallel.comm import agree_on_errors
from tessera.train.builder import build_training_stack
from tessera.train.memory_check import check_memory
from tessera.train.metrics import MetricsWriter, gpu_peak_tflops, measure_matmul_tflops, peak_memory_gib, setup_logging
from tessera.train.stop import StopRequest

logger = logging.getLogger("tessera")
T = TypeVar("T")


class TrainingStopped(RuntimeError):
    """The run cannot go on (e.g. it diverged); the message names the step and where to resume from.
    ``every_rank``: every rank raises it together (after an agreement), so each reports before any exits."""

    def __init__(self, message: str, every_rank: bool = False) -> None:
        super().__init__(message)
        self.every_rank = every_rank


_doing = "starting"  # what main() is doing: the context of an OSError that reaches run()


def _now(what: str) -> None:
    global _doing
    _doing = what


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
                   help="plan instead of training: one iteration at real size on meta tensors, as tools/plan.py "
                        "(world size: this launch's, else parallel.tensor.size); exits 1 if it does not fit the GPU")
    p.add_argument("overrides", nargs="*", help="key.sub=value pairs (Python literals) overriding the config")
    return p.parse_intermixed_args(argv)


def peak_tflops_per_device(cfg: Config, precision_name: str, device: torch.device) -> tuple[float, str]:
    """MFU denominator: the config's override, the GPU table (exact device name), or matmuls measured here (a
    CPU, or a GPU the table does not list)."""
    if cfg.metrics.peak_tflops:
        return cfg.metrics.peak_tflops, "config"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_tflops(name, precision_name)
        if peak:
            return peak, name
        logger.warning("no peak TFLOP/s known for %s; measuring a matmul instead (set metrics.peak_tflops)", name)
    dtype = resolve_precision(cfg.model.dtype).dtype
    return measure_matmul_tflops(dtype, device), f"measured {dtype} matmul"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    # 1. config: every mistake is reported here, before any process group exists (logging first: the config
    #    says which InternEvo keys it mapped or accepted)
    setup_logging(int(os.environ.get("RANK" if args.launcher == "torch" else "SLURM_PROCID", "0")))
    _now(f"reading the config {args.config}")
    cfg = Config.from_file(args.config, args.overrides)
    seed = cfg.seed if args.seed is None else args.seed
    if args.dry_run:
        return dry_run_report(cfg, args.config)

    # 2. launch: process groups, RNG streams, TF32 switches
    _now("launching")
    if args.launcher == "slurm":
        launch_from_slurm(cfg, host=args.host, port=args.port, seed=seed)
    else:
        launch_from_torch(cfg, seed=seed)
    layout = Layout.from_gpc()
    precision = resolve_precision(cfg.model.dtype)
    device = gpc.device
    is_rank0 = gpc.get_global_rank() == 0
    logger.info("launched: world %d = tp %d x dp %d, zero1 %d, dtype %s, device %s", layout.world_size,
                layout.tp_size, layout.dp_size, layout.zero1_size, precision.name, device)

    # 2b. the folders the run writes (logs, checkpoints, data cache): a problem on any rank stops every rank
    #     now, not at the first save
    _now("checking the output folders")
    problems = agree_on_errors(output_folder_problem(cfg))
    if problems:
        _exit_together("; ".join(problems))

    # 2c. the MFU denominator: a GPU missing from the peak table is measured now, before the model takes its memory
    peak, peak_source = peak_tflops_per_device(cfg, precision.name, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # the run's peak (metrics' peak_mem_gib) leaves the probe out

    # 3. will it fit: the persistent state of this layout (counted on the meta device) vs this rank's memory
    if not args.skip_memory_check:
        problem = check_memory(cfg, layout.world_size, layout.tp_size, layout.zero1_size, device)
        if problem:  # every rank agreed: each says so before any exits (torchrun stops the rest at the first exit)
            _exit_together(problem)

    # 4. data: a problem on any rank (missing, unreadable, a disk full while preparing) stops every rank
    _now(f"reading the data ({_data_keys(cfg)})")
    if cfg.data.type == "stdlib":  # rank 0 prepares the corpus while the others wait in the agreement
        _, problem = _data_step(cfg, lambda: prepare_stdlib_corpus(cfg.data.cache_folder, progress=True), is_rank0)
        _exit_on(agree_on_errors(problem))
    data, problem = _data_step(cfg, lambda: build_data(
        cfg.data, vocab_size=cfg.model.vocab_size, max_seq_len=cfg.model.max_position_embeddings,
        dp_rank=layout.dp_rank, dp_size=layout.dp_size, seed=seed, barrier=dist.barrier,
        is_main=layout.global_rank == 0, progress=is_rank0))
    _exit_on(agree_on_errors(problem))
    assert data is not None  # no rank had a problem
    logger.info("data: %s", data.info)

    # 5. the training stack: model (fp32, TP-sharded; a weights-only start is loaded before the precision
    #    cast) -> precision wrapper -> optimizer (fp32 masters, ZeRO-1) -> LR schedule -> trainer
    def weights_only_start(model: torch.nn.Module) -> None:
        if cfg.ckpt.load_ckpt_folder and not _has_checkpoint(cfg):
            _now(f"loading ckpt.load_ckpt_folder={cfg.ckpt.load_ckpt_folder}")
            try:
                load_checkpoint(cfg.ckpt.load_ckpt_folder, TrainState(model), layout=layout, load_optimizer=False,
                                load_components=False)
            except CheckpointError as e:  # name the key the path came from
                raise CheckpointError(f"ckpt.load_ckpt_folder={cfg.ckpt.load_ckpt_folder}: {e}",
                                      every_rank=e.every_rank) from None
            logger.info("initialized weights from %s", cfg.ckpt.load_ckpt_folder)

    _now("building the model and optimizer")
    stack = build_training_stack(cfg, seed=seed, before_cast=weights_only_start)
    optimizer, scheduler, trainer = stack.optimizer, stack.scheduler, stack.trainer

    # 6. what a checkpoint holds, registered once: saving and resuming iterate this one registry
    progress = Progress()
    state = TrainState(stack.inner_model, optimizer, progress=progress, lr_scheduler=scheduler, sampler=data.train)
    state.register("rng", RngStreams(gpc), per_rank=True)

    # 7. resume from the newest complete checkpoint (damaged ones are skipped with a warning)
    last_ckpt = None
    if cfg.ckpt.auto_resume and cfg.ckpt.save_ckpt_folder:
        _now(f"resuming from ckpt.save_ckpt_folder={cfg.ckpt.save_ckpt_folder}")
        last_ckpt, meta = find_resumable_checkpoint(cfg.ckpt.save_ckpt_folder, layout,
                                                    load=lambda path: load_checkpoint(path, state, layout=layout))
        if last_ckpt:
            if not meta["rank_state_loaded"]:  # a different TP/DP layout: per-rank streams cannot be carried over
                gpc.set_seed(seed + progress.step)
            logger.info("resumed from %s at step %d", last_ckpt, progress.step)
            if progress.step > cfg.data.total_steps:
                logger.warning("%s is past data.total_steps=%d: nothing to train, only the final validation "
                               "and sample run (train longer by raising data.total_steps, or start over with "
                               "another ckpt.save_ckpt_folder or ckpt.auto_resume=False)",
                               last_ckpt, cfg.data.total_steps)

    # 8. metrics
    flops_tok = flops_per_token(cfg.model, cfg.data.seq_len)
    log_dir = os.path.join(cfg.log_folder, cfg.job_name)
    metrics = MetricsWriter(log_dir, is_rank0, cfg.data.total_steps, progress.step, cfg.metrics.tensorboard,
                            cfg.metrics.progress_bar)

    def metrics_problem() -> str | None:  # rank 0's metrics files: a failure stops every rank (agreed)
        return f"log_folder={cfg.log_folder}: {metrics.problem}" if metrics.problem else None

    _exit_on(agree_on_errors(metrics_problem()))
    metrics.log_event(f"peak {peak:.3f} TFLOP/s per device ({peak_source}); {flops_tok / 1e6:.2f} MFLOP per token",
                      peak_tflops=peak, flops_per_token=flops_tok, resumed_from=last_ckpt, start_step=progress.step)

    def save() -> str:
        nonlocal last_ckpt
        if last_ckpt == os.path.join(cfg.ckpt.save_ckpt_folder, f"step_{progress.step}"):
            return last_ckpt  # saved (or resumed from) at this very step: same state, nothing to write
        last_ckpt = save_checkpoint(cfg.ckpt.save_ckpt_folder, progress.step, state, config=cfg.to_dict(),
                                    layout=layout, keep_last=cfg.ckpt.keep_last)
        metrics.log_event(f"saved checkpoint {last_ckpt}", checkpoint=last_ckpt)
        return last_ckpt

    def validate(at_step: int) -> None:
        if data.valid is not None:
            metrics.log_valid(at_step, trainer.evaluate(data.valid))

    # 9. the loop
    _now("training")
    stop = StopRequest(stop_file=args.stop_file)
    stop.install()
    saving = cfg.ckpt.enable_save_ckpt
    while progress.step < cfg.data.total_steps:
        lr = scheduler.current_lr
        try:
            result = trainer.train_step(data.train.next_step_batches(), step=progress.step + 1)
        except TooManySkippedSteps as e:
            raise TrainingStopped(f"stopping at step {progress.step + 1}: {e}; last good checkpoint: "
                                  f"{last_ckpt or 'none'}") from None
        scheduler.step()
        progress.step += 1
        progress.consumed_tokens += result.tokens
        step = progress.step
        tgs = result.tokens / result.step_time / layout.world_size
        tflops = tgs * flops_tok / 1e12
        metrics.log_train(step, {  # every step to metrics.jsonl and TensorBoard; log_every paces the printed line
            "loss": result.loss, "lr": lr, "grad_norm": result.grad_norm, "loss_scale": optimizer.loss_scale,
            "skipped_steps": optimizer.skipped_steps, "success": result.success, "tgs": tgs,
            "tflops": tflops, "mfu": tflops / peak, "step_time": result.step_time,
            "consumed_tokens": progress.consumed_tokens, "peak_mem_gib": peak_memory_gib(device),
        }, line=step % cfg.metrics.log_every == 0 or step == cfg.data.total_steps)
        if result.precision is not None:  # metrics.precision_every: per-module numerics of this step
            metrics.log_precision(step, result.precision)
        if cfg.data.valid_every and step % cfg.data.valid_every == 0 and step < cfg.data.total_steps:
            validate(step)
        if (saving and cfg.ckpt.checkpoint_every and step % cfg.ckpt.checkpoint_every == 0
                and step < cfg.data.total_steps):
            save()
        requested, reason = stop.should_stop(problem=metrics_problem())  # one agreement for both
        if requested:
            metrics.log_event(f"stop requested ({reason}) after step {step}")
            if saving:
                save()
            if stop.problems:  # the state so far is saved: stop with the problem on every rank
                raise TrainingStopped(f"{reason}; stopped after step {step}, last checkpoint: {last_ckpt or 'none'}",
                                      every_rank=True)
            try:
                stop.consume()  # every rank has seen it: remove the stop file so a relaunch trains on
            except OSError as e:
                raise TrainingStopped(f"--stop-file {args.stop_file}: cannot remove it after stopping "
                                      f"({os_error_text(e)}): remove it before relaunching, or the next launch stops "
                                      f"after its first step; last checkpoint: {last_ckpt or 'none'}") from None
            break

    # 10. the end: validation, checkpoint, a sample
    _now("finishing")
    if progress.step >= cfg.data.total_steps:
        validate(progress.step)
        if saving:
            save()
        if cfg.generate.max_new_tokens and data.tokenizer is not None:
            ids = generate_ids_cached(stack.inner_model, data.tokenizer.encode(cfg.generate.prompt),
                                      cfg.generate.max_new_tokens, temperature=cfg.generate.temperature,
                                      top_k=cfg.generate.top_k, top_p=cfg.generate.top_p,
                                      tp_group=gpc.get_group(ParallelMode.TENSOR),
                                      device=device, seed=seed, max_seq_len=cfg.model.max_position_embeddings,
                                      vocab_size=data.tokenizer.vocab_size)
            sample = data.tokenizer.decode(ids)
            metrics.log_event("sample:\n" + sample, sample=sample)
    metrics.close()
    problems = agree_on_errors(metrics_problem())
    if problems:
        raise TrainingStopped(f"{'; '.join(problems)}; training finished at step {progress.step}, last checkpoint: "
                              f"{last_ckpt or 'none'}", every_rank=True)
    gpc.destroy()
    return 0


def dry_run_report(cfg: Config, config_name: str) -> int:
    """``--dry-run``: rank 0 of the launch prints the plan of this job (tools/plan.py) and says whether it fits."""
    if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) != "0":
        return 0  # one plan per job: every rank of a layout is planned alike
    from tessera.plan import gpu_for_device_name, make_plan

    world = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", cfg.parallel.tensor.size)))
    gpu = gpu_for_device_name(torch.cuda.get_device_name()) if torch.cuda.is_available() else None
    plan = make_plan(cfg, world, config_name=config_name, gpu=gpu)
    print(plan.format(), flush=True)
    return 1 if plan.fits is False else 0


def output_folder_problem(cfg: Config) -> str | None:
    """Every folder the run will write — logs, checkpoints, the data cache when it has to be filled — is
    created if missing and written to once; the first that fails, as ``key=path: what failed``, or None."""
    from tessera.data.stdlib_corpus import stdlib_corpus_ready
    from tessera.files import folder_write_problem

    folders = [("log_folder", cfg.log_folder, os.path.join(cfg.log_folder, cfg.job_name))]  # key, value, folder
    if cfg.ckpt.enable_save_ckpt and cfg.ckpt.save_ckpt_folder:
        folders.append(("ckpt.save_ckpt_folder", cfg.ckpt.save_ckpt_folder, cfg.ckpt.save_ckpt_folder))
    if cfg.data.type == "stdlib" and not stdlib_corpus_ready(cfg.data.cache_folder):
        folders.append(("data.cache_folder", cfg.data.cache_folder, cfg.data.cache_folder))
    for key, value, path in folders:
        problem = folder_write_problem(path)
        if problem:
            return f"{key}={value}: {problem}"
    return None


def _data_keys(cfg: Config) -> str:
    """The config keys naming where the data comes from, for error lines."""
    if cfg.data.type == "stdlib":
        return f"data.cache_folder={cfg.data.cache_folder}"
    if cfg.data.type == "tokens":
        return ", ".join(f"data.{k}={getattr(cfg.data, k)}" for k in ("train_folder", "valid_folder")
                         if getattr(cfg.data, k))
    return f"data.type={cfg.data.type}"


def _data_step(cfg: Config, step: Callable[[], T], run_here: bool = True) -> tuple[T | None, str | None]:
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


def _has_checkpoint(cfg: Config) -> bool:
    """A run that already saved checkpoints resumes from them instead of re-loading load_ckpt_folder."""
    return bool(cfg.ckpt.auto_resume and cfg.ckpt.save_ckpt_folder and list_checkpoints(cfg.ckpt.save_ckpt_folder))


def _report(text: str) -> None:
    """``[rank R] text`` on stderr in one write, so ranks sharing a terminal or log never interleave lines."""
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "?"))
    data = f"[rank {rank}] {text}\n".encode()
    sys.stderr.flush()
    while data:  # one write unless the pipe takes less (only past its atomic size, e.g. a long traceback)
        data = data[os.write(sys.stderr.fileno(), data):]


def _exit_together(message: str) -> None:
    """Report on this rank, wait until every rank has (they all reached the same verdict), then exit 1."""
    _report(f"error: {message}")
    dist.barrier()
    os._exit(1)


def _exit_on(problems: list[str]) -> None:
    """``_exit_together`` when an agreement found problems (the same list on every rank)."""
    if problems:
        _exit_together("; ".join(problems))


def run() -> None:
    """Exit non-zero on every failing rank at once; never wait on peers that may be gone."""
    try:
        sys.exit(main())
    except (ConfigError, DataError, CheckpointError, TrainingStopped) as e:
        if getattr(e, "every_rank", False) and dist.is_initialized():
            _exit_together(str(e))  # every rank raised it together: each reports before any exits
        _report(f"error: {e}")
    except OSError as e:  # a file operation the environment refused (missing, unreadable, unwritable, full)
        if e.filename is None:  # not a file (a socket, a timeout): the traceback says where
            _report(f"training failed:\n{traceback.format_exc()}")
        else:
            _report(f"error: {_doing}: {os_error_text(e)}")
    except Exception:  # noqa: BLE001 - report with the traceback, then take the whole job down
        _report(f"training failed:\n{traceback.format_exc()}")
    # os._exit: skip interpreter teardown, which can block on a process group whose peers died;
    # torchrun sees the non-zero exit and stops the other ranks.
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(1)


if __name__ == "__main__":
    run()
