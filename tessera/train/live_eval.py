"""train.py's ``eval`` section: lm-evaluation-harness tasks on the live model every ``eval.every`` steps and at the end.

``prepare_live_eval`` runs before the first step (a problem stops every rank with one ``error:`` line there, not
at the end of a long run): every rank imports lm-eval (the ``eval`` extra); rank 0 finds the tokenizer and the
tasks (lm-eval's ``TaskManager`` names an unknown task) while the others wait.

One evaluation (``LiveEval.run``; every rank calls it at the same step):

1. consolidation: the fp32 masters of the optimizer (what a checkpoint saves and ``tools/evaluate.py`` reads
   back) are gathered bucket by bucket over ZeRO-1 (every rank), each parameter over TP by the TP group of DP
   rank 0 (``tessera.parallel.comm.gather_tensor``), into full tensors on global rank 0's device, cast to
   ``eval.dtype``; ``model_from_full_state`` makes them the TP=1 decoder ``load_for_inference`` makes of this
   step's checkpoint, so the scores are ``tools/evaluate.py``'s on that checkpoint;
2. rank 0 runs lm-eval on that copy (``tessera.train.lm_eval_adapter``) in a thread while every rank meets in a
   small agreement every ``_WAIT_ROUND_S`` (``on_rank0_while_others_wait``): no collective waits through the
   evaluation, and past ``eval.timeout_s`` every rank stops with an error;
3. the copy is freed, the RNG states lm-eval reseeded are put back, and rank 0 logs the scores
   (``MetricsWriter.log_eval``: metrics.jsonl kind ``eval``, TensorBoard and W&B ``eval/<task>/<metric>``).

The live parameters, gradients, optimizer state and model mode are only read, so training goes on bit for bit as
without the evaluation. A failed evaluation (a dataset that cannot be read, out of memory) is a warning line and
an ``event`` record, and the run trains on.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

import torch

from tessera.config import RunConfig
from tessera.config.dtypes import dtype_from_name
from tessera.config.typed import EvalConfig
from tessera.core.job import Job
from tessera.data.errors import DataError
from tessera.data.run_tokenizer import tokenizer_for_checkpoint
from tessera.data.tokenizer import AnyTokenizer
from tessera.model.transformer import Transformer, model_from_full_state
from tessera.optim.hybrid_zero import HybridZeroOptimizer
from tessera.parallel import partition_dim
from tessera.parallel.comm import gather_tensor
from tessera.parallel.coordination import agree_on_errors, on_rank0_while_others_wait
from tessera.train.lm_eval_adapter import (
    EvalSetupError,
    evaluate_tasks,
    import_lm_eval,
    include_path_problem,
    model_max_length,
    scores_of,
    task_manager,
    tessera_lm_class,
    tokenizer_problem,
)
from tessera.train.metrics import MetricsWriter

__all__ = ["LiveEval", "EvalTimedOut", "prepare_live_eval", "consolidated_state"]

logger = logging.getLogger("tessera")
_WAIT_ROUND_S = 2.0  # how often the ranks meet while rank 0 evaluates


class EvalTimedOut(EvalSetupError):
    """Rank 0's evaluation ran past ``eval.timeout_s``: every rank raises it together and the run stops (the
    evaluation thread cannot be interrupted; the process ends)."""


class LiveEval:
    """The checked ``eval`` section of a run, and on rank 0 what evaluating needs (lm-eval, its task manager,
    the tokenizer). Inert when ``eval.tasks`` is empty."""

    def __init__(self, cfg: RunConfig, job: Job) -> None:
        self.settings: EvalConfig = cfg.eval
        self.job = job
        self.model_cfg = cfg.model.as_dict()
        self.max_length = self.settings.max_length or model_max_length(self.model_cfg)
        self.dtype = dtype_from_name(self.settings.dtype)
        self.lm_eval: Any = None  # rank 0, once prepared
        self.manager: Any = None
        self.tokenizer: AnyTokenizer | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.settings.tasks)

    def due(self, step: int, total_steps: int) -> bool:
        """Whether the loop evaluates after ``step``: every ``eval.every`` steps before the last one (the last
        one is ``finish``'s: ``due_at_end``)."""
        every = self.settings.every
        return self.enabled and bool(every) and step % every == 0 and step < total_steps

    def due_at_end(self, step: int) -> bool:
        """Whether the run evaluates after its last step: ``eval.at_end``, or ``eval.every`` divides it."""
        every = self.settings.every
        return self.enabled and (self.settings.at_end or bool(every and step % every == 0))

    # ------------------------------------------------------------------ before training
    def setup_problem(self, cfg: RunConfig) -> str | None:
        """Rank 0: lm-eval, the include folder, the tokenizer and every task name; the first problem as one line
        naming its key, or None (``self`` then holds what evaluating needs)."""
        ev = self.settings
        try:
            self.lm_eval = import_lm_eval("eval.tasks")
        except EvalSetupError as e:
            return str(e)
        folder_problem = include_path_problem(ev.include_path, "eval.include_path=")
        if folder_problem:
            return folder_problem
        try:
            tokenizer, where = tokenizer_for_checkpoint(".", {"config": cfg.as_dict()}, ev.tokenizer,
                                                        how="eval.tokenizer=", max_ids=cfg.model.vocab_size)
        except (DataError, OSError, ValueError) as e:
            return f"eval.tokenizer={ev.tokenizer}: {e}"
        if tokenizer is None:
            return f"eval.tasks needs a tokenizer: {where}"
        too_large = tokenizer_problem(tokenizer, where, cfg.model.vocab_size)
        if too_large:
            return f"eval: {too_large}"
        self.tokenizer = tokenizer
        try:
            self.manager = task_manager(ev.tasks, ev.include_path, tasks_key="eval.tasks",
                                        include_key="eval.include_path=FOLDER")
        except EvalSetupError as e:
            return str(e)
        return None

    # ------------------------------------------------------------------ one evaluation
    def run(self, step: int, model: Transformer, optimizer: HybridZeroOptimizer, rng: Any,
            log: MetricsWriter) -> None:
        """Evaluate the live ``model`` (the unwrapped decoder) at ``step``, on every rank together (see the module
        docstring). ``rng``: the job's RNG streams as a component (``state_dict``/``load_state_dict``), saved
        before and restored after."""
        saved = rng.state_dict()
        start = time.perf_counter()
        job = self.job
        copy: Transformer | str | None = None  # rank 0: the TP=1 copy, or why there is none
        try:  # every rank joins every collective of the consolidation, whatever fails on rank 0 (its memory)
            state = consolidated_state(model, optimizer, job, dtype=self.dtype)
            copy = model_from_full_state(self.model_cfg, state, device=job.device) if state is not None else None
            del state
        except Exception as e:  # rank 0 only: the full copy did not fit; the ranks went through every collective
            logger.debug("the traceback of the failed consolidation:", exc_info=True)
            copy = f"the TP=1 copy in eval.dtype={self.settings.dtype} on {job.device}: {type(e).__name__}: {e}"
        try:
            outcome = on_rank0_while_others_wait(job.is_rank0, lambda: self._evaluate(copy),
                                                 round_s=_WAIT_ROUND_S, timeout_s=self.settings.timeout_s,
                                                 name="tessera-lm-eval")
        except TimeoutError:
            raise EvalTimedOut(f"eval.timeout_s={self.settings.timeout_s:g}: rank 0's evaluation at step {step} is "
                               "still running; raise eval.timeout_s, or evaluate fewer documents (eval.limit)",
                               every_rank=True) from None
        copy = None
        gc.collect()  # the copy may sit in a reference cycle (lm-eval's objects): its memory back now
        if job.device.type == "cuda":
            torch.cuda.empty_cache()  # the copy's blocks back to the device, for training's
        rng.load_state_dict(saved)
        if outcome is None:
            return  # not rank 0
        scores, error = outcome
        if scores is not None:
            log.log_eval(step, scores, seconds=time.perf_counter() - start)
        else:
            log.log_event(f"warning: eval at step {step} failed ({error}); training goes on", eval_error=error,
                          step=step)

    def _evaluate(self, copy: Transformer | str | None) -> tuple[dict[str, dict[str, float]] | None, str | None]:
        """Rank 0, in the evaluation thread: ``(scores, None)``, or ``(None, the failure in one line)``."""
        if isinstance(copy, str):
            return None, copy
        assert copy is not None and self.tokenizer is not None, "rank 0 evaluates a prepared LiveEval"
        ev = self.settings
        if copy.embedding.weight.device.type == "cuda":
            torch.cuda.set_device(copy.embedding.weight.device)  # the current device is per thread
        try:
            lm = tessera_lm_class(self.lm_eval)(copy, self.tokenizer, max_length=self.max_length,
                                                batch_size=ev.batch_size, seed=ev.seed, max_gen_toks=ev.max_gen_toks)
            results = evaluate_tasks(self.lm_eval, lm, ev.tasks, self.manager, num_fewshot=ev.num_fewshot,
                                     limit=ev.limit, seed=ev.seed)
            return scores_of(results), None
        except Exception as e:  # an evaluation must not end the training run
            logger.debug("the traceback of the failed evaluation:", exc_info=True)
            return None, f"{type(e).__name__}: {e}"


def prepare_live_eval(cfg: RunConfig, job: Job) -> LiveEval:
    """The ``eval`` section, checked on every rank before training: a problem is ``EvalSetupError`` on every rank
    together (``every_rank``). lm-eval's import is checked on every rank (each needs nothing else to say so), the
    rest on rank 0 while the others wait (lm-eval's task index takes seconds)."""
    live = LiveEval(cfg, job)
    if not live.enabled:
        return live
    try:
        import_lm_eval("eval.tasks")
        problem = None
    except EvalSetupError as e:
        problem = str(e)
    problems = agree_on_errors(problem)
    if not problems:
        problems = agree_on_errors(on_rank0_while_others_wait(job.is_rank0, lambda: live.setup_problem(cfg),
                                                              round_s=_WAIT_ROUND_S, name="tessera-eval-setup"))
    if problems:
        raise EvalSetupError("; ".join(problems), every_rank=True)
    if job.is_rank0:
        logger.info("eval: %s every %s, %d positions, batch %d, %s copy on %s; tokenizer with %d ids",
                    ", ".join(live.settings.tasks), f"{live.settings.every} steps" if live.settings.every else
                    "(at the end only)", live.max_length, live.settings.batch_size, live.settings.dtype, job.device,
                    live.tokenizer.vocab_size if live.tokenizer else 0)
    return live


def consolidated_state(model: torch.nn.Module, optimizer: HybridZeroOptimizer, job: Job, *,
                       dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor] | None:
    """Global rank 0: every ``state_dict`` key of the TP=1 ``model`` -> its full tensor in ``dtype`` on the job's
    device (a tied head shares the embedding's); None on the other ranks. The fp32 masters, as a checkpoint
    saves them; a parameter the optimizer does not hold, as the model holds it. A collective on every rank; a
    failure to keep a tensor on rank 0 (its memory) is raised there after the last collective."""
    lay, tp_group = job.layout, job.groups.tp
    full: dict[int, torch.Tensor] = {}  # id(parameter) -> full tensor (rank 0)
    failed: list[RuntimeError] = []  # rank 0 stops keeping tensors at a failure, but joins every collective

    def take(param: torch.Tensor, local: torch.Tensor, *, copy: bool = False) -> None:
        if lay.dp_rank != 0:  # DP replicas hold the same weights: the TP group of DP rank 0 gathers
            return
        dim = partition_dim(param)
        whole = local if dim is None else gather_tensor(local.contiguous(), dim, tp_group)
        if lay.global_rank == 0 and not failed:
            try:  # ``copy``: never the live parameter's own storage
                full[id(param)] = whole.to(device=job.device, dtype=dtype, copy=copy and dim is None)
            except RuntimeError as e:  # out of memory: raised below, once every collective is done
                failed.append(e)
                full.clear()

    with torch.no_grad():
        for _, param, master in optimizer.iter_full_masters():  # one bucket at a time (a collective over ZeRO-1)
            take(param, master)
        held = {id(p) for p in optimizer.params}
        for param in model.parameters():  # each once, in the same order on every rank
            if id(param) not in held:
                take(param, param.detach(), copy=True)
    if failed:
        raise failed[0]
    if lay.global_rank != 0:
        return None
    return {name: full[id(p)] for name, p in model.named_parameters(remove_duplicate=False)}
