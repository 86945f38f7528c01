"""train.py's ``eval`` section (``tessera.train.live_eval``): lm-evaluation-harness on the live model during and
after training.

- the scores train.py logs at the end equal ``tools/evaluate.py``'s on the run's final checkpoint, exactly (the
  perplexities are floats summed from every token's log-probability: any difference in the weights or the
  computation shows), at TP=1 and at TP=2 in bf16 (whose fp32 masters differ from the weights: the evaluated copy
  is the masters, as the checkpoint's consolidation reads them);
- the consolidated state is, tensor for tensor, what ``load_for_inference`` makes of a checkpoint of the same
  step, across TP=2 and DP=2 with ZeRO;
- a run that evaluates every 2 steps trains bit for bit as the same run without (dropout on, so an RNG stream
  lm-eval reseeds and nobody put back would change the losses): the same losses and the same checkpoint files;
- the missing extra and an unknown task are one ``error:`` line on every rank before the first step;
- ``MetricsWriter.log_eval``: the record, TensorBoard and W&B; run comparison reads past the new records.

lm-eval is the ``eval`` extra, which CI does not install: the tests that run it skip without it (the missing-extra
tests do not need it). The tasks are the local ones of tests/data/lm_eval_tasks (no hub, no network).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from harness.distributed import run_distributed, run_torchrun
from harness.failure import explain
from harness.tools import run_tool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.py")
TASKS = os.path.join(ROOT, "tests", "data", "lm_eval_tasks")
EVAL_TASKS = ["tiny_facts_mc", "tiny_facts_ppl"]  # log-likelihoods (accuracy) and rolling ones (perplexity floats)
# the tiny decoder on synthetic tokens, evaluated through the byte tokenizer (257 ids: vocab 258, as the demo's)
COMMON = ["data.type='synthetic'", "metrics.progress_bar=False", "data.seq_len=32", "data.micro_bsz=2",
          "data.micro_num=1", "model.vocab_size=258", "adam.lr=3e-3", "eval.tokenizer='byte'",
          f"eval.include_path='{TASKS}'", "eval.batch_size=5"]
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
HANG_GUARD_S = 300


def _needs_lm_eval():
    pytest.importorskip("lm_eval")


def _config(*overrides: str):
    from tessera.config import Config

    return Config.from_file(TINY, [*COMMON, *overrides])


def _records(log_dir: str, kind: str) -> list[dict]:
    with open(os.path.join(log_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


def _train_plain(tmp_path, name: str, *overrides: str) -> str:
    """``python train.py`` (one process, one torch thread as under torchrun); the run's log folder."""
    log_folder = str(tmp_path / "logs")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    env.update(OFFLINE, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--config", TINY, *COMMON,
                           f"log_folder='{log_folder}'", f"job_name='{name}'", *overrides], cwd=str(tmp_path),
                          env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert proc.returncode == 0, explain(proc)
    return os.path.join(log_folder, name)


def _evaluate_tool(ckpt: str, tmp_path, tasks=EVAL_TASKS) -> dict[str, dict[str, float]]:
    """``tools/evaluate.py`` on a checkpoint (its defaults, one thread like the runs), as train.py's records hold
    the scores: ``{task: {metric: value}}``."""
    from tessera.train.lm_eval_adapter import scores_of

    out = str(tmp_path / f"evaluate_{os.path.basename(ckpt)}.json")
    saved = {k: os.environ.get(k) for k in OFFLINE}
    os.environ.update(OFFLINE)
    try:
        run_tool("evaluate.py", ckpt, "--tasks", ",".join(tasks), "--include-path", TASKS, "--tokenizer", "byte",
                 "--batch-size", "5", "--threads", "1", "--output", out)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    with open(out, encoding="utf-8") as f:
        return scores_of(json.load(f))


def _record_scores(record: dict) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for key, value in record.items():
        if "/" in key:
            task, metric = key.split("/", 1)
            out.setdefault(task, {})[metric] = value
    return out


def _contents(step_folder: str) -> dict:
    """Every tensor file of a checkpoint, read back (the files' bytes are no reference: safetensors writes a
    file's metadata keys in a per-process random order)."""
    from tessera.checkpoint import read_tree

    with open(os.path.join(step_folder, "meta.json"), encoding="utf-8") as f:
        names = sorted(json.load(f)["files"])
    return {name: read_tree(os.path.join(step_folder, name)) for name in names if name.endswith(".safetensors")}


def _same(a, b, where: str = "") -> None:
    """``a`` and ``b`` (nested dicts, lists, tensors, values) equal bit for bit."""
    assert type(a) is type(b), where
    if isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}/{i}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, where


# --------------------------------------------------------------------------------------- train.py end to end
@pytest.fixture(scope="module")
def tp1_runs(tmp_path_factory):
    """The same 6 steps with dropout twice: evaluated every 2 steps and at the end, and not evaluated."""
    _needs_lm_eval()
    tmp = tmp_path_factory.mktemp("train_eval")
    common = ["data.total_steps=6", "model.dropout=0.1", "ckpt.enable_save_ckpt=True", "ckpt.checkpoint_every=2"]
    evaluated = _train_plain(tmp, "evaluated", *common, f"ckpt.save_ckpt_folder='{tmp / 'ckpt_e'}'",
                             f"eval.tasks={EVAL_TASKS}", "eval.every=2")
    plain = _train_plain(tmp, "plain", *common, f"ckpt.save_ckpt_folder='{tmp / 'ckpt_p'}'")
    return {"tmp": tmp, "evaluated": evaluated, "plain": plain}


@pytest.mark.slow
def test_the_scores_at_the_end_equal_tools_evaluate_on_the_final_checkpoint(tp1_runs):
    records = _records(tp1_runs["evaluated"], "eval")
    assert [r["step"] for r in records] == [2, 4, 6]
    final = _record_scores(records[-1])
    want = _evaluate_tool(str(tp1_runs["tmp"] / "ckpt_e" / "step_6"), tp1_runs["tmp"])
    assert final == want
    assert set(final) == set(EVAL_TASKS) and {"acc", "acc_norm"} <= set(final["tiny_facts_mc"])
    assert final["tiny_facts_ppl"]["byte_perplexity"] > 1
    assert _record_scores(records[0]) != final  # training moved the weights: the steps' scores differ
    assert all("seconds" in r for r in records)  # the evaluation's time, reported (never a verdict)


@pytest.mark.slow
def test_evaluating_every_two_steps_changes_no_bit_of_training(tp1_runs):
    evaluated, plain = tp1_runs["evaluated"], tp1_runs["plain"]
    train_e, train_p = _records(evaluated, "train"), _records(plain, "train")
    assert [r["step"] for r in train_e] == list(range(1, 7))
    for a, b in zip(train_e, train_p, strict=True):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), a["step"]
    assert [r["loss"] for r in _records(evaluated, "valid")] == [r["loss"] for r in _records(plain, "valid")]
    # weights, masters, Adam moments and every RNG stream, saved before the step's own evaluation (the end's:
    # after the last checkpoint) and after the earlier ones
    for step in (2, 4, 6):
        evaluated_files = _contents(str(tp1_runs["tmp"] / "ckpt_e" / f"step_{step}"))
        assert {"model_tp0.safetensors", "optim_tp0_zero0.safetensors", "rng_rank0.safetensors"} <= set(evaluated_files)
        _same(evaluated_files, _contents(str(tp1_runs["tmp"] / "ckpt_p" / f"step_{step}")), f"step_{step}")


@pytest.mark.slow
def test_the_eval_scores_reach_tensorboard_and_run_comparison_reads_past_them(tp1_runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tessera.analysis.run_compare import read_series

    log_dir = tp1_runs["evaluated"]
    events = EventAccumulator(os.path.join(log_dir, "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    records = _records(log_dir, "eval")
    for task, row in _record_scores(records[-1]).items():
        for metric, value in row.items():
            scalars = events.Scalars(f"eval/{task}/{metric}")
            assert [s.step for s in scalars] == [2, 4, 6]
            assert scalars[-1].value == pytest.approx(value, rel=1e-6)  # TensorBoard stores float32
    assert "loss" in tags and "eval/seconds" in tags
    assert list(read_series(log_dir).steps) == list(range(1, 7))  # train records only, as before
    acc = read_series(log_dir, "eval", "tiny_facts_mc/acc")
    assert list(acc.steps) == [2, 4, 6]


@pytest.mark.slow
def test_tp2_bf16_under_torchrun_scores_equal_tools_evaluate_on_its_checkpoint(tmp_path):
    """TP=2 (the copy gathered over TP) in bf16 (the copy is the fp32 masters, not the bf16 weights)."""
    _needs_lm_eval()
    log_folder = str(tmp_path / "logs")
    args = [os.path.join(ROOT, "train.py"), "--config", TINY, *COMMON, "parallel.tensor.size=2",
            "model.dtype='bf16'", "data.total_steps=3", f"eval.tasks={EVAL_TASKS}", f"log_folder='{log_folder}'",
            "job_name='tp2'", "ckpt.enable_save_ckpt=True", f"ckpt.save_ckpt_folder='{tmp_path / 'ckpt'}'"]
    proc = run_torchrun(args, 2, timeout=HANG_GUARD_S, cwd=str(tmp_path), env=OFFLINE)
    assert proc.returncode == 0, explain(proc)
    (record,) = _records(os.path.join(log_folder, "tp2"), "eval")
    assert record["step"] == 3
    assert _record_scores(record) == _evaluate_tool(str(tmp_path / "ckpt" / "step_3"), tmp_path)


# --------------------------------------------------------------------------------------- the consolidation
def _full_grad(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A gradient of the full (TP=1) shape, drawn from the parameter's name: the same on every rank and layout."""
    import zlib

    return torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()))) * 0.1


def _consolidate(rank: int, world: int, folder: str) -> dict:
    import torch.distributed as dist

    from tessera.checkpoint import TrainState, load_for_inference, save_checkpoint
    from tessera.core.job import Job, JobGroups
    from tessera.model.transformer import model_from_full_state
    from tessera.parallel import partition_dim
    from tessera.train.builder import build_training_stack
    from tessera.train.live_eval import consolidated_state

    whole = dist.group.WORLD
    one = [dist.new_group([r]) for r in range(world)][rank]  # every rank creates every group
    out = {}
    for layout, groups in {"tp2": JobGroups(tp=whole, dp=one, zero1=one, world=whole),
                           "dp2_zero2": JobGroups(tp=one, dp=whole, zero1=whole, world=whole)}.items():
        tp = 2 if layout == "tp2" else 1
        cfg = _config("model.dtype='bf16'", f"parallel.tensor.size={tp}",
                      "hybrid_zero_optimizer.reduce_bucket_size=4096")  # several buckets
        job = Job.of(cfg, groups, seed=3)
        stack = build_training_stack(cfg, job, sync_buffer=False)
        model, opt = stack.inner_model, stack.optimizer
        for _ in range(2):  # the main gradients written directly (the full ones, this rank's TP slice)
            for name, p in model.named_parameters():
                dim = partition_dim(p)
                shape = tuple(s * (tp if d == dim else 1) for d, s in enumerate(p.shape))
                full = _full_grad(name, shape)
                opt.get_main_grad(p).copy_(full if dim is None else full.chunk(tp, dim)[dist.get_rank(groups.tp)])
            assert opt.step()[0]
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        state = consolidated_state(model, opt, job)
        assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())  # only read
        assert model.training
        path = save_checkpoint(os.path.join(folder, layout), 2, TrainState(model, opt), config=cfg.to_dict(),
                               layout=job.layout)
        if rank != 0:
            assert state is None
            continue
        assert state is not None
        ours = model_from_full_state(cfg.typed.model.as_dict(), state).state_dict()
        ref = load_for_inference(path)[0].state_dict()
        replicated = [n for n, p in model.named_parameters() if partition_dim(p) is None]
        out[layout] = {"keys": list(ours) == list(ref), "equal": all(torch.equal(ours[k], ref[k]) for k in ref),
                       "masters_not_weights": any(not torch.equal(state[n], weights[n].float()) for n in replicated)}
    return out


@pytest.mark.slow  # two processes build, step and save two stacks: 4-18 s on a shared 2-core machine
def test_the_consolidated_copy_is_what_load_for_inference_makes_of_a_checkpoint(tmp_path):
    """TP=2 (gathered over TP) and DP=2 with ZeRO-2 (masters gathered over ZeRO), bf16 weights, fp32 masters."""
    got = run_distributed(_consolidate, 2, str(tmp_path), timeout=HANG_GUARD_S)[0]
    assert set(got) == {"tp2", "dp2_zero2"}
    for layout, checks in got.items():
        assert checks == {"keys": True, "equal": True, "masters_not_weights": True}, layout


# --------------------------------------------------------------------------------------- one evaluation in-process
class _RngStates:
    """The process's RNG states as a component (what train.py's RngStreams(gpc) is to the eval)."""

    def state_dict(self) -> dict:
        return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}

    def load_state_dict(self, state: dict) -> None:
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])


def _stack_and_eval(*overrides: str):
    from tessera.core.job import Job
    from tessera.train.builder import build_training_stack
    from tessera.train.live_eval import prepare_live_eval

    cfg = _config("eval.tasks=['tiny_facts_mc']", *overrides)
    job = Job.of(cfg, seed=0)
    return build_training_stack(cfg, job, sync_buffer=False), prepare_live_eval(cfg.typed, job)


class _Log:
    def __init__(self):
        self.evals, self.events = [], []

    def log_eval(self, step, scores, seconds=None):
        self.evals.append((step, scores))

    def log_event(self, message, **values):
        self.events.append((message, values))


def test_one_evaluation_reads_the_run_and_puts_every_rng_state_back(monkeypatch):
    _needs_lm_eval()
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    stack, live = _stack_and_eval()
    model, opt = stack.inner_model, stack.optimizer
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    before = _RngStates().state_dict()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    log = _Log()
    live.run(5, model, opt, _RngStates(), log)
    ((step, scores),) = log.evals
    assert step == 5 and set(scores) == {"tiny_facts_mc"} and 0 <= scores["tiny_facts_mc"]["acc"] <= 1
    after = _RngStates().state_dict()
    assert random.getstate() == before["python"] and torch.equal(after["torch"], before["torch"])
    assert all(np.array_equal(a, b) for a, b in zip(after["numpy"], before["numpy"], strict=True))
    assert model.training and all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())


def test_a_failed_evaluation_is_an_event_and_training_goes_on(monkeypatch):
    _needs_lm_eval()
    import tessera.train.live_eval as live_eval

    stack, live = _stack_and_eval()

    def broken(*args, **kwargs):
        raise OSError("the dataset is not reachable")

    monkeypatch.setattr(live_eval, "evaluate_tasks", broken)
    log = _Log()
    live.run(3, stack.inner_model, stack.optimizer, _RngStates(), log)
    assert log.evals == [] and log.events == [
        ("warning: eval at step 3 failed (OSError: the dataset is not reachable); training goes on",
         {"eval_error": "OSError: the dataset is not reachable", "step": 3})]

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(live_eval, "model_from_full_state", no_memory)  # rank 0's whole copy does not fit
    log = _Log()
    live.run(4, stack.inner_model, stack.optimizer, _RngStates(), log)
    why = "the TP=1 copy in eval.dtype=fp32 on cpu: OutOfMemoryError: CUDA out of memory"
    assert log.events == [(f"warning: eval at step 4 failed ({why}); training goes on", {"eval_error": why, "step": 4})]


def test_an_evaluation_past_its_timeout_stops_the_run(monkeypatch):
    _needs_lm_eval()
    import time

    import tessera.train.live_eval as live_eval

    stack, live = _stack_and_eval("eval.timeout_s=0.2")
    monkeypatch.setattr(live_eval, "_WAIT_ROUND_S", 0.05)
    monkeypatch.setattr(live_eval, "evaluate_tasks", lambda *a, **k: time.sleep(3))  # a hung evaluation
    with pytest.raises(live_eval.EvalTimedOut) as e:
        live.run(4, stack.inner_model, stack.optimizer, _RngStates(), _Log())
    assert str(e.value) == ("eval.timeout_s=0.2: rank 0's evaluation at step 4 is still running; raise "
                            "eval.timeout_s, or evaluate fewer documents (eval.limit)") and e.value.every_rank


def test_when_the_loop_and_the_end_evaluate():
    from tessera.core.job import Job
    from tessera.train.live_eval import LiveEval

    def live(*overrides):
        cfg = _config(*overrides)
        return LiveEval(cfg.typed, Job.of(cfg, seed=0))

    every = live("eval.tasks=['t']", "eval.every=2", "eval.at_end=False")
    assert [s for s in range(1, 7) if every.due(s, 6)] == [2, 4] and every.due_at_end(6) and not every.due_at_end(5)
    end = live("eval.tasks=['t']")
    assert not any(end.due(s, 6) for s in range(1, 7)) and end.due_at_end(6)
    off = live("eval.every=2")
    assert not off.enabled and not any(off.due(s, 6) for s in range(1, 7)) and not off.due_at_end(6)


# --------------------------------------------------------------------------------------- errors before training
def test_the_missing_extra_is_one_line_before_anything_else(monkeypatch):
    """Checked without lm-eval: ``import lm_eval`` fails as it does where the extra is not installed."""
    from tessera.core.job import Job
    from tessera.train.live_eval import prepare_live_eval
    from tessera.train.lm_eval_adapter import EvalSetupError

    monkeypatch.setitem(sys.modules, "lm_eval", None)
    cfg = _config("eval.tasks=['tiny_facts_mc']")
    with pytest.raises(EvalSetupError) as e:
        prepare_live_eval(cfg.typed, Job.of(cfg, seed=0))
    assert str(e.value) == "eval.tasks needs lm-evaluation-harness: pip install 'tessera[eval]' (the lm-eval package)"
    assert e.value.every_rank
    assert not prepare_live_eval(_config().typed, Job.of(_config(), seed=0)).enabled  # off: nothing imported


def _only_error_lines(proc, text: str) -> None:
    for rank in (0, 1):
        lines = [line for line in proc.stderr.splitlines() if line.startswith(f"[rank {rank}] error:")]
        assert lines == [f"[rank {rank}] error: {text}"], explain(proc)
    assert "training failed" not in proc.stderr and "step 1 |" not in proc.stdout + proc.stderr, explain(proc)


@pytest.mark.slow
def test_train_py_without_lm_eval_stops_every_rank_before_the_first_step(tmp_path):
    wrapper = tmp_path / "train_without_lm_eval.py"  # train.py where ``import lm_eval`` fails
    wrapper.write_text("import runpy, sys\nsys.modules['lm_eval'] = None\n"
                       f"runpy.run_path({os.path.join(ROOT, 'train.py')!r}, run_name='__main__')\n")
    proc = run_torchrun([str(wrapper), "--config", TINY, *COMMON, "eval.tasks=['tiny_facts_mc']",
                         f"log_folder='{tmp_path / 'logs'}'"], 2, timeout=HANG_GUARD_S, cwd=str(tmp_path))
    assert proc.returncode not in (0, 124), explain(proc)
    _only_error_lines(proc, "eval.tasks needs lm-evaluation-harness: pip install 'tessera[eval]' (the lm-eval package)")


@pytest.mark.slow
def test_an_unknown_task_stops_every_rank_before_the_first_step(tmp_path):
    """lm-eval's whole task index is read (the name may be one of its own tasks): ~12 s on rank 0."""
    _needs_lm_eval()
    proc = run_torchrun([os.path.join(ROOT, "train.py"), "--config", TINY, *COMMON,
                         "eval.tasks=['tiny_facts_mc','no_such_task']", f"log_folder='{tmp_path / 'logs'}'"], 2,
                        timeout=HANG_GUARD_S, cwd=str(tmp_path), env=OFFLINE)
    assert proc.returncode not in (0, 124), explain(proc)
    _only_error_lines(proc, "rank 0: eval.tasks: lm-eval knows no task no_such_task")


def test_setup_problems_name_their_key(tmp_path, monkeypatch):
    _needs_lm_eval()
    from tessera.core.job import Job
    from tessera.train.live_eval import LiveEval

    def problem(*overrides):
        cfg = _config("eval.tasks=['tiny_facts_mc']", *overrides)
        return LiveEval(cfg.typed, Job.of(cfg, seed=0)).setup_problem(cfg.typed)

    assert problem(f"eval.include_path='{tmp_path}/none'") == f"eval.include_path={tmp_path}/none: not a folder"
    assert problem("eval.tokenizer=None") == (
        "eval.tasks needs a tokenizer: data.type='synthetic' has no tokenizer; pass "
        "eval.tokenizer=byte|PATH/tokenizer.json|PATH/tokenizer.model (at most 258 ids: model.vocab_size=258)")
    assert problem("model.vocab_size=256") == (
        "eval: the tokenizer (eval.tokenizer=byte) has 257 ids, more than model.vocab_size=256 embeds")
    assert problem() is None


def test_the_tokenizer_advice_names_the_vocabulary_it_needs_and_following_it_works(monkeypatch):
    """configs/tiny.py embeds 256 ids: "pass eval.tokenizer=byte" (257 ids) led to a second error. The checks
    before lm-eval's task index need only its import: a bare module stands in for lm-eval, and a stand-in task
    manager for its index, so this runs without the extra."""
    import types

    from tessera.core.job import Job
    from tessera.train import live_eval

    monkeypatch.setitem(sys.modules, "lm_eval", types.ModuleType("lm_eval"))
    monkeypatch.setattr(live_eval, "task_manager", lambda *a, **k: object())

    def problem(*overrides):
        cfg = _config("eval.tasks=['tiny_facts_mc']", "eval.tokenizer=None", *overrides)
        return live_eval.LiveEval(cfg.typed, Job.of(cfg, seed=0)).setup_problem(cfg.typed)

    assert problem("model.vocab_size=256") == (
        "eval.tasks needs a tokenizer: data.type='synthetic' has no tokenizer; pass "
        "eval.tokenizer=PATH/tokenizer.json|PATH/tokenizer.model of at most 256 ids (model.vocab_size=256; "
        "eval.tokenizer=byte has 257 ids and needs model.vocab_size >= 257)")
    assert problem("model.vocab_size=257").endswith(
        "pass eval.tokenizer=byte|PATH/tokenizer.json|PATH/tokenizer.model (at most 257 ids: model.vocab_size=257)")
    assert problem("model.vocab_size=257", "eval.tokenizer='byte'") is None  # the advice, followed
    assert problem("model.vocab_size=256", "eval.tokenizer='byte'") == (
        "eval: the tokenizer (eval.tokenizer=byte) has 257 ids, more than model.vocab_size=256 embeds")


def test_bad_eval_values_are_config_errors_naming_the_key():
    from tessera.config import ConfigError

    for override, text in [("eval.every=-1", "eval.every: must be >= 0"),
                           ("eval.tasks='hellaswag'", "eval.tasks: expected list or tuple, got str"),
                           ("eval.tasks=[1]", "eval.tasks: must be a list of strings"),
                           ("eval.dtype='fp8'", "eval.dtype: must be one of ['fp32', 'bf16', 'fp16']"),
                           ("eval.seed=-1", "eval.seed: must be in [0, 2**32 - 1]"),
                           ("eval.batch_size=0", "eval.batch_size: must be > 0"),
                           ("eval.taks=[]", "unknown key 'eval.taks'; did you mean 'tasks'?")]:
        with pytest.raises(ConfigError, match=None) as e:
            _config(override)
        assert text in str(e.value), (override, str(e.value))
    with pytest.raises(ConfigError, match="would never run with eval.every=0 and eval.at_end=False"):
        _config("eval.tasks=['t']", "eval.at_end=False")


# --------------------------------------------------------------------------------------- reporting
class _FakeWandb:
    def __init__(self):
        self.rows: list[tuple[int, dict]] = []

    def log(self, step, scalars):
        self.rows.append((step, dict(scalars)))

    def close(self):
        pass


def test_log_eval_writes_one_record_and_the_same_scalars_to_tensorboard_and_wandb(tmp_path, capsys):
    from tessera.analysis.run_compare import read_series
    from tessera.train.metrics import MetricsWriter

    log = MetricsWriter(str(tmp_path), True, total_steps=4, tensorboard=False, progress_bar=False)
    tb: list[tuple[str, float, int]] = []
    log._tb = type("TB", (), {"add_scalar": lambda self, tag, v, step: tb.append((tag, v, step)),
                              "close": lambda self: None})()
    log._wandb = wandb = _FakeWandb()  # type: ignore[assignment]
    log.log_train(4, {"loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "loss_scale": 1.0, "skipped_steps": 0, "tgs": 1.0,
                      "tflops": 0.0, "mfu": 0.0, "step_time": 0.1, "consumed_tokens": 8, "peak_mem_gib": 0.0})
    scores = {"hellaswag": {"acc": 0.25, "acc_stderr": 0.01, "acc_norm": 0.5}, "gsm8k": {"exact_match/strict": 0.1}}
    log.log_eval(4, scores, seconds=3.0)
    log.close()
    (record,) = _records(str(tmp_path), "eval")
    assert {k: v for k, v in record.items() if k != "time"} == {
        "kind": "eval", "step": 4, "hellaswag/acc": 0.25, "hellaswag/acc_stderr": 0.01, "hellaswag/acc_norm": 0.5,
        "gsm8k/exact_match/strict": 0.1, "seconds": 3.0}
    want = {"eval/hellaswag/acc": 0.25, "eval/hellaswag/acc_stderr": 0.01, "eval/hellaswag/acc_norm": 0.5,
            "eval/gsm8k/exact_match/strict": 0.1, "eval/seconds": 3.0}
    assert {tag: v for tag, v, step in tb if tag.startswith("eval/") and step == 4} == want
    assert wandb.rows[-1] == (4, want)
    line = "eval step 4 | hellaswag acc 0.2500 acc_norm 0.5000 | gsm8k exact_match/strict 0.1000"
    assert line in capsys.readouterr().out
    assert list(read_series(str(tmp_path)).values) == [2.0]  # the train loss alone
    assert list(read_series(str(tmp_path), "eval", "hellaswag/acc").values) == [0.25]


def test_scores_of_keeps_the_numbers_and_names_the_filters():
    from tessera.train.lm_eval_adapter import scores_of

    results = {"results": {"t": {"alias": "t", "sample_len": 12, "acc,none": 0.5, "acc_stderr,none": "N/A",
                                 "exact_match,strict-match": 0.25, "flag": True}}}
    assert scores_of(results) == {"t": {"sample_len": 12.0, "acc": 0.5, "exact_match/strict-match": 0.25}}
