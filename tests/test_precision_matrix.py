"""Precision-config matrix: dtype x fp32 marks x tied embeddings x TP, on CPU with gloo.

Every cell goes through the real training path: ``build_model`` -> ``naive_amp_for`` ->
``build_optimizer`` -> ``Trainer.train_step`` with explicit TP/DP groups, then a checkpoint
save/resume and greedy generation with and without the KV cache. A cell either trains or is one of the
combinations declared invalid (a low-precision dtype with tied embeddings and an fp32 mark covering
exactly one of ``embedding``/``output``), which must raise a ``ConfigError`` naming both parameters.

Cost: one spawned 2-process job per TP size runs every cell in a loop (process start-up and imports
dominate on a small CPU). TP=1 runs as DP=2 with ZeRO-1 over both ranks; TP=2 as DP=1. The workers only
*observe* (losses, dtypes, generated ids, errors); the expectations live in this process (the tables
and ``_policy_*`` helpers below) and every comparison is against an independent reference:

- losses: the fp32 cell with the same (marks, tied, TP), seed and data (tf32 on CPU: bitwise equal);
- parameter dtypes: the policy recomputed here from the mark patterns with ``fnmatch``;
- resume: the uninterrupted run (same layout: bitwise);
- KV cache: full recomputation (``generate_ids``, ``model(ids)``).
"""

from __future__ import annotations

import fnmatch
import math
import os
import traceback

import pytest
import torch

from harness.distributed import run_distributed
from tests.tolerances import adam_rtol, adam_window_gain, mean_loss_rtol, order_rtol, precision_rtol, transformer_depth

# ---------------------------------------------------------------------------------------- the matrix
MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_kv_attention_heads=2, vocab_size=64,
             mlp_ratio=2.0, multiple_of=16, use_flash_attn=False)
SEQ, ROWS, MICRO_NUM = 16, 4, 1  # per DP rank and step: MICRO_NUM micro-batches of ROWS x SEQ tokens
STEPS, SAVE_AFTER = 3, 2  # train STEPS steps; checkpoint after SAVE_AFTER, resume, redo the rest
LR, SEED = 1e-2, 7
PROMPT_LEN, NEW_TOKENS = 6, 4  # greedy generation (PROMPT_LEN + NEW_TOKENS <= SEQ: no window sliding)
CACHE_CHUNKS = ((0, 5), (5, 6), (6, 10))  # prompt fed to the KV cache in pieces, compared with one forward

DTYPES = {"fp32": "torch.float32", "tf32": "torch.tf32", "bf16": "torch.bfloat16", "fp16": "torch.float16"}
LOW = {"bf16": "bfloat16", "fp16": "float16"}  # storage dtype of unmarked parameters
MARKS = {
    "none": {},
    "norms": {"use_fp32_norm": True},
    "attention": {"fp32_modules": ["layers.*.attention"]},
    "output": {"fp32_modules": ["output"]},
    "layer1": {"fp32_modules": ["layers.1"]},
}
TIED = (False, True)
TP_SIZES = (1, 2)

# expectations, per dtype (tests/tolerances.py; an fp32 mark only removes low-precision roundings, so the
# unmarked bound holds for every cell): relative loss difference to the fp32 cell at every step (tf32 is
# fp32 on CPU: bitwise), and norm-wise relative error of KV-cache logits vs one full forward.
# Low precision rounds once per stored tensor (GEMMs accumulate in fp32: n = 1); fp32 sums are <= 64 long
# (ffn hidden, vocab, the 4 x 16 tokens).
_U = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # tf32: fp32 on CPU
_N = {"fp32": 64, "tf32": 64, "bf16": 1, "fp16": 1}
FWD_DEPTH = transformer_depth(MODEL["num_layers"])
BWD_DEPTH = transformer_depth(MODEL["num_layers"], backward=True)
TOKENS = ROWS * SEQ * MICRO_NUM


def loss_rtol(dtype: str, step: int, ref_losses: list[float]) -> float:
    """The loss at ``step`` of a ``dtype`` cell against the fp32 cell's.

    fp32/tf32: the same computation on CPU, bitwise (0). Low precision: the forward's roundings reach the
    mean loss through ``mean_loss_rtol`` (logits RMS <= 1: a loss near log(vocab) means near-uniform
    logits; the weights' rounding is shared by all tokens), and each earlier step's update differs by the gradient's rounding bound, so the loss those
    updates bought, ``L_1 - L_step`` of the fp32 run, differs by that much of itself (Adam passes a
    relative gradient difference on at gain 1). Measured (AMX, avx2, avx512): bf16 2.7e-5, 4.7e-4, 1.6e-3
    and fp16 4.5e-6, 9.2e-5, 4.2e-4 at steps 1, 2, 3.
    """
    if dtype not in LOW:
        return 0.0
    u = _U[dtype]
    logits_rtol = precision_rtol(u, _N[dtype], FWD_DEPTH)
    forward = mean_loss_rtol(logits_rtol, logits_norm=(TOKENS * MODEL["vocab_size"]) ** 0.5,
                             loss=ref_losses[step - 1], tokens=TOKENS, vocab=MODEL["vocab_size"], shared=True)
    trained = abs(ref_losses[0] - ref_losses[step - 1]) / abs(ref_losses[step - 1])
    return forward + precision_rtol(u, _N[dtype], BWD_DEPTH) * trained  # bf16: 6.1e-3 .. 1.1e-2


# KV cache in chunks vs one forward: two orders of the forward (fp32 3.1e-6, bf16 2.5e-2, fp16 3.2e-3;
# measured 1.2e-7, 3.9e-3, 4.6e-4)
CACHE_LOGITS_RTOL = {d: order_rtol(_U[d], _N[d], FWD_DEPTH) for d in DTYPES}
# the combinations declared invalid, spelled out (``_policy_invalid`` derives the same set from the rule)
INVALID = {("bf16", "output", True), ("fp16", "output", True)}
# parallel_output True vs False (fp32): the same math summed in another order (step-1 loss and gradients);
# gradients and losses after the first update come from weights that already differ by that rounding,
# which Adam amplifies (``_parallel_output_weights_rtol``). Measured: losses bitwise, step-1 gradients
# 1.9e-7, later gradients 4.3e-6, weights 5.1e-6 (AMX, avx2, avx512)
PARALLEL_OUTPUT_LOSS_RTOL = order_rtol(torch.float32, 64, FWD_DEPTH + 1)  # 3.2e-6
PARALLEL_OUTPUT_GRAD_RTOL = order_rtol(torch.float32, 64, BWD_DEPTH)  # 4.4e-6


def _cell_name(dtype: str, marks: str, tied: bool) -> str:
    return f"{dtype}/{marks}/{'tied' if tied else 'untied'}"


def _cells():
    for marks in MARKS:
        for tied in TIED:
            for dtype in DTYPES:  # fp32 first: the reference of the other dtypes
                yield dtype, marks, tied


# ---------------------------------------------------------------------------------------- the policy
def _policy_marked(module_name: str, marks: str) -> bool:
    """Whether ``module_name`` runs in fp32 under ``marks``: it or an ancestor matches a mark."""
    parts = module_name.split(".")
    prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    if MARKS[marks].get("use_fp32_norm"):
        return any("norm" in p.rsplit(".", 1)[-1] for p in prefixes)
    return any(fnmatch.fnmatchcase(p, pat) for p in prefixes for pat in MARKS[marks].get("fp32_modules", []))


def _policy_param_dtype(param_name: str, dtype: str, marks: str) -> str:
    if dtype not in LOW or _policy_marked(param_name.rsplit(".", 1)[0], marks):
        return "float32"
    return LOW[dtype]


def _policy_invalid(dtype: str, marks: str, tied: bool) -> bool:
    """A tied weight cannot be fp32 on one side and low precision on the other."""
    return dtype in LOW and tied and _policy_marked("embedding", marks) != _policy_marked("output", marks)


def test_the_invalid_table_follows_the_rule():
    assert {c for c in _cells() if _policy_invalid(*c)} == INVALID


# ---------------------------------------------------------------------------------------- worker side
class _Job:
    """This rank's place in the 2-process job: explicit groups and the checkpoint layout."""

    def __init__(self, rank: int, world: int, tp: int) -> None:
        import torch.distributed as dist

        from tessera.checkpoint import Layout

        singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
        whole = dist.new_group(list(range(world)))
        self.tp_size, self.dp_size = tp, world // tp
        self.tp_group = whole if tp == world else singles[rank]
        self.dp_group = singles[rank] if tp == world else whole
        self.tp_rank, self.dp_rank = (rank, 0) if tp == world else (0, rank)
        self.world_group = dist.group.WORLD
        self.layout = Layout(global_rank=rank, world_size=world, tp_rank=self.tp_rank, tp_size=tp,
                             dp_rank=self.dp_rank, dp_size=self.dp_size, zero1_size=self.dp_size)


_PERM = None


def _sequences(n: int, length: int, seed: int) -> torch.Tensor:
    """Rows that follow a fixed random bigram permutation from random starts: learnable in a few steps."""
    global _PERM
    vocab = MODEL["vocab_size"]
    if _PERM is None:
        _PERM = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, vocab, (n,), generator=g)]
    for _ in range(length - 1):
        rows.append(_PERM[rows[-1]])
    return torch.stack(rows, dim=1)


def _step_batches(step: int, dp_rank: int) -> list[dict[str, torch.Tensor]]:
    """This DP rank's micro-batches of optimizer step ``step`` (the same in every cell)."""
    out = []
    for m in range(MICRO_NUM):
        ids = _sequences(ROWS, SEQ + 1, seed=1000 * step + 10 * dp_rank + m)
        out.append({"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()})
    return out


def _config(dtype: str, marks: str, tied: bool, tp: int, parallel_output: bool = True):
    from tessera.config import Config

    model = {**MODEL, "dtype": DTYPES[dtype], "tie_word_embeddings": tied, "parallel_output": parallel_output,
             **MARKS[marks]}
    return Config.from_dict({"model": model, "parallel": {"tensor": {"size": tp}}, "adam": {"lr": LR},
                             "lr_scheduler": {"warmup_ratio": 0.0, "eta_min": LR},  # constant: never stepped
                             "data": {"type": "synthetic", "seq_len": SEQ, "micro_bsz": ROWS, "micro_num": MICRO_NUM}})


def _build(cfg, job: _Job, seed: int):
    """train.py's stack: fp32 TP-sharded model -> precision wrapper -> ZeRO optimizer -> Trainer."""
    from tessera.core.job import Job, JobGroups
    from tessera.train.builder import build_training_stack

    groups = JobGroups(tp=job.tp_group, dp=job.dp_group, zero1=job.dp_group, world=job.world_group)
    stack = build_training_stack(cfg, Job.of(cfg, groups, seed=seed))
    return stack.model, stack.optimizer, stack.trainer


def _train(trainer, job: _Job, steps) -> tuple[list[float], list[bool]]:
    losses, success = [], []
    for step in steps:
        result = trainer.train_step(_step_batches(step, job.dp_rank))
        losses.append(result.loss)
        success.append(result.success)
    return losses, success


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _observe_dtypes(inner) -> dict:
    from tessera.core.naive_amp import fp32_module_names

    return {
        # remove_duplicate=False: a tied weight is checked under both of its names
        "param_dtypes": {n: str(p.dtype).removeprefix("torch.")
                         for n, p in inner.named_parameters(remove_duplicate=False)},
        "fp32_modules": sorted(fp32_module_names(inner)),
        "module_names": [n for n, _ in inner.named_modules() if n],
        "tied_shared": inner.embedding.weight is inner.output.weight,
    }


def _observe_generation(inner, job: _Job) -> dict:
    """KV cache vs full recomputation on the unwrapped model, as train.py samples."""
    from tessera.model.generation import generate_ids
    from tessera.model.kv_cache import KVCache, forward_with_cache, generate_ids_cached

    ids = _sequences(1, CACHE_CHUNKS[-1][1], seed=99)
    inner.eval()
    try:
        with torch.no_grad():
            full = inner(ids)
        cache = KVCache()
        cached = torch.cat([forward_with_cache(inner, ids[:, a:b], cache) for a, b in CACHE_CHUNKS], dim=1)
        prompt = ids[0, :PROMPT_LEN].tolist()
        kw = dict(tp_group=job.tp_group, temperature=0.0, max_seq_len=SEQ)
        want = generate_ids(inner, prompt, NEW_TOKENS, **kw)
        got = generate_ids_cached(inner, prompt, NEW_TOKENS, **kw)
    finally:
        inner.train()
    return {"cache_logits_err": _rel_err(cached, full), "cache_len": cache.length, "gen_full": want,
            "gen_cached": got}


def _run_cell(job: _Job, dtype: str, marks: str, tied: bool, folder: str) -> dict:
    """Train one cell, checkpoint and resume it, generate from it; return what was observed."""
    from tessera.checkpoint import Progress, TrainState, load_checkpoint, save_checkpoint
    from tessera.config import ConfigError
    from tessera.core.naive_amp import unwrap_model
    from tessera.precision.switches import apply_precision

    cfg = _config(dtype, marks, tied, job.tp_size)
    apply_precision(cfg.model.dtype)  # what launch_from_torch does (TF32 switches: CUDA only)
    try:
        model, optimizer, trainer = _build(cfg, job, SEED)
    except ConfigError as e:
        return {"config_error": str(e)}
    inner = unwrap_model(model)
    losses, success = _train(trainer, job, range(1, SAVE_AFTER + 1))
    ckpt = save_checkpoint(folder, SAVE_AFTER, TrainState(inner, optimizer, progress=Progress(SAVE_AFTER)),
                           config=cfg.to_dict(), layout=job.layout)
    more, more_ok = _train(trainer, job, range(SAVE_AFTER + 1, STEPS + 1))
    out = {"losses": losses + more, "success": success + more_ok, **_observe_dtypes(inner)}

    # resume into a model initialized from another seed: everything must come from the checkpoint
    model2, optimizer2, trainer2 = _build(cfg, job, SEED + 1)
    load_checkpoint(ckpt, TrainState(unwrap_model(model2), optimizer2, progress=Progress()), layout=job.layout)
    out["resumed_losses"], _ = _train(trainer2, job, range(SAVE_AFTER + 1, STEPS + 1))
    resumed = dict(unwrap_model(model2).named_parameters())
    out["resume_param_diffs"] = [n for n, p in inner.named_parameters() if not torch.equal(p, resumed[n])]
    out["resumed_dtypes"] = _observe_dtypes(unwrap_model(model2))["param_dtypes"]

    out.update(_observe_generation(inner, job))
    return out


def _parallel_output_part(job: _Job) -> dict:
    """fp32, TP=2: the same run with vocab-sharded logits and with gathered logits, through Trainer."""
    from tessera.core.naive_amp import unwrap_model
    from tessera.model.transformer import logits_are_vocab_sharded

    out = {}
    for tied in TIED:
        for parallel_output in (True, False):
            model, optimizer, trainer = _build(_config("fp32", "none", tied, job.tp_size, parallel_output), job, SEED)
            named = dict(unwrap_model(model).named_parameters())
            grads: list[dict[str, torch.Tensor]] = []
            real_step = optimizer.step

            def step_recording_grads(real_step=real_step, optimizer=optimizer, named=named, grads=grads):
                # the accumulated main gradients, just before the update consumes them
                grads.append({n: optimizer.get_main_grad(p).clone() for n, p in named.items()})
                return real_step()

            optimizer.step = step_recording_grads
            results = [trainer.train_step(_step_batches(s, job.dp_rank)) for s in range(1, STEPS + 1)]
            out[tied, parallel_output] = {
                "sharded": logits_are_vocab_sharded(model),
                "losses": [r.loss for r in results],
                "grads": grads,
                "params": {n: p.detach().clone() for n, p in named.items()},
            }
    return out


def _matrix_worker(rank: int, world: int, tp: int, folder: str, only: list | None = None,
                   parallel_output: bool = True) -> dict:
    """Every cell (``only``: those (dtype, marks, tied) cells), and at TP=2 the parallel_output comparison."""
    job = _Job(rank, world, tp)
    cells = {}
    for dtype, marks, tied in only or list(_cells()):
        name = _cell_name(dtype, marks, tied)
        try:
            cells[name] = _run_cell(job, dtype, marks, tied, os.path.join(folder, name.replace("/", "_")))
        except Exception:  # noqa: BLE001 - reported per cell by the test; the other cells still run
            cells[name] = {"error": traceback.format_exc()}
    out = {"cells": cells}
    if tp == 2 and parallel_output:
        out["parallel_output"] = _parallel_output_part(job)
    return out


# ---------------------------------------------------------------------------------------- test side
@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """``jobs(tp)``: both ranks' observations of the TP=``tp`` job (spawned once per module)."""
    cache: dict[int, list[dict] | BaseException] = {}

    def get(tp: int) -> list[dict]:
        if tp not in cache:
            folder = str(tmp_path_factory.mktemp(f"precision_matrix_tp{tp}"))
            try:
                cache[tp] = run_distributed(_matrix_worker, 2, tp, folder, timeout=300)
            except Exception as e:  # noqa: BLE001 - a failed job fails every test that reads it, once
                cache[tp] = e
        if isinstance(cache[tp], BaseException):
            raise cache[tp]
        return cache[tp]

    return get


def _check_cell(dtype: str, marks: str, tied: bool, ranks: list[dict], fp32_ranks: list[dict]) -> list[str]:
    """Every failed expectation of one cell, as readable lines."""
    problems = []
    for r, (obs, ref) in enumerate(zip(ranks, fp32_ranks)):
        where = f"rank {r}: "
        if "error" in obs:
            return [f"rank {r} raised:\n{obs['error']}"]
        if _policy_invalid(dtype, marks, tied):
            msg = obs.get("config_error")
            if msg is None:
                problems.append(where + "trained, but this combination must raise ConfigError")
            elif "embedding.weight" not in msg or "output.weight" not in msg:
                problems.append(where + f"ConfigError does not name embedding.weight and output.weight: {msg}")
            continue
        if "config_error" in obs:
            problems.append(where + f"unexpected ConfigError: {obs['config_error']}")
            continue

        # training: every step applied; losses as the fp32 cell's (same marks, tied, TP, seed, data)
        if not all(obs["success"]):
            problems.append(where + f"skipped steps: success={obs['success']}")
        if "losses" in ref:
            for step, (got, want) in enumerate(zip(obs["losses"], ref["losses"]), start=1):
                rel = abs(got - want) / abs(want)
                tol = loss_rtol(dtype, step, ref["losses"])
                if rel > tol:
                    problems.append(where + f"step {step} loss {got!r} vs fp32 {want!r} "
                                            f"(rel {rel:.2e} > {tol:.2e})")
        if dtype == "fp32" and not obs["losses"][-1] < obs["losses"][0]:
            problems.append(where + f"fp32 loss did not decrease: {obs['losses']}")

        # parameter dtypes as the policy says (after training, and after resuming), tied weight still shared
        want_fp32 = sorted(n for n in obs["module_names"] if _policy_marked(n, marks))
        if obs["fp32_modules"] != want_fp32:
            problems.append(where + f"fp32_module_names {obs['fp32_modules']} != policy {want_fp32}")
        for label, dtypes in (("", obs["param_dtypes"]), ("resumed ", obs["resumed_dtypes"])):
            bad = {n: d for n, d in dtypes.items() if d != _policy_param_dtype(n, dtype, marks)}
            if bad:
                problems.append(where + f"{label}parameter dtypes against the policy: {bad}")
        if tied and not obs["tied_shared"]:
            problems.append(where + "embedding.weight is no longer output.weight")
        if not tied and ("output.weight" not in obs["param_dtypes"] or obs["tied_shared"]):
            problems.append(where + "untied model shares its embedding and output weights")

        # resume: the same layout continues bitwise
        if obs["resumed_losses"] != obs["losses"][SAVE_AFTER:]:
            problems.append(where + f"resumed losses {obs['resumed_losses']} != uninterrupted "
                                    f"{obs['losses'][SAVE_AFTER:]}")
        if obs["resume_param_diffs"]:
            problems.append(where + f"parameters differ after resuming: {obs['resume_param_diffs']}")

        # KV cache: chunked cached logits vs one forward; greedy tokens vs full recomputation
        if obs["cache_len"] != CACHE_CHUNKS[-1][1]:
            problems.append(where + f"cache length {obs['cache_len']} after {CACHE_CHUNKS[-1][1]} tokens")
        if not obs["cache_logits_err"] <= CACHE_LOGITS_RTOL[dtype]:
            problems.append(where + f"KV-cache logits rel err {obs['cache_logits_err']:.2e} > "
                                    f"{CACHE_LOGITS_RTOL[dtype]:.2e}")
        if obs["gen_cached"] != obs["gen_full"] or len(obs["gen_full"]) != PROMPT_LEN + NEW_TOKENS:
            problems.append(where + f"greedy ids with KV cache {obs['gen_cached']} != full recompute {obs['gen_full']}")

    # the two ranks (DP replicas or TP ranks) report one run
    ok = [o for o in ranks if "losses" in o]
    if len(ok) == 2:
        for key in ("losses", "resumed_losses", "gen_full", "gen_cached"):
            if ok[0][key] != ok[1][key]:
                problems.append(f"ranks disagree on {key}: {ok[0][key]} vs {ok[1][key]}")
    return problems


@pytest.mark.parametrize("tp", TP_SIZES, ids=[f"tp{t}" for t in TP_SIZES])
@pytest.mark.slow
def test_precision_matrix(jobs, tp):
    ranks = jobs(tp)
    cells = [r["cells"] for r in ranks]
    failures = []
    for dtype, marks, tied in _cells():
        name = _cell_name(dtype, marks, tied)
        ref = _cell_name("fp32", marks, tied)
        problems = _check_cell(dtype, marks, tied, [c[name] for c in cells], [c[ref] for c in cells])
        failures += [f"TP={tp} {name}: {p}" for p in problems]
    assert not failures, f"{len(failures)} failed expectation(s):\n" + "\n".join(failures)


FAST_CELLS = [(dtype, "none", False) for dtype in DTYPES]  # one cell per dtype, fp32 (the reference) first


def test_one_cell_per_dtype_at_tp2(tmp_path):
    """The quick run's share of the matrix (``-m "not slow"``): every dtype, no fp32 marks, untied, TP=2,
    with the same expectations as the whole matrix (losses against fp32, policy, resume, KV cache)."""
    ranks = run_distributed(_matrix_worker, 2, 2, str(tmp_path), FAST_CELLS, False, timeout=300)
    cells = [r["cells"] for r in ranks]
    failures = []
    for dtype, marks, tied in FAST_CELLS:
        name, ref = _cell_name(dtype, marks, tied), _cell_name("fp32", marks, tied)
        failures += [f"TP=2 {name}: {p}" for p in _check_cell(dtype, marks, tied, [c[name] for c in cells],
                                                              [c[ref] for c in cells])]
    assert not failures, f"{len(failures)} failed expectation(s):\n" + "\n".join(failures)


def _parallel_output_weights_rtol(run: dict, steps: int) -> dict[str, float]:
    """Per parameter: the weights after ``steps`` Adam steps whose gradients differ by
    PARALLEL_OUTPUT_GRAD_RTOL (``adam_rtol``), with Adam's eps-window gain taken from the reference run's
    own gradients (largest RMS, smallest magnitude over the steps: ``adam_window_gain``). ~1e-6 .. 5e-4."""
    from tessera.config import SCHEMA

    eps = SCHEMA.keys["adam"].keys["adam_eps"].default
    out = {}
    for n, p in run["params"].items():
        grads = [g[n].double() for g in run["grads"][:steps]]
        if not grads:
            out[n] = 0.0
            continue
        grad_rms = max(float(g.norm()) / g.numel() ** 0.5 for g in grads)
        # exact zeros (embedding rows of tokens absent from the batch) are zero in both runs: not in the window
        grad_min = min((float(g.abs()[g != 0].min()) for g in grads if bool((g != 0).any())), default=0.0)
        weight_rms = float(p.double().norm()) / p.numel() ** 0.5
        out[n] = adam_rtol(PARALLEL_OUTPUT_GRAD_RTOL, lrs=[LR] * steps, weight_rms=weight_rms,
                           gain=adam_window_gain(grad_rms, eps, grad_min))
    return out


@pytest.mark.slow
def test_parallel_output_true_and_false_agree_at_tp2(jobs):
    """Vocab-sharded logits + parallel loss vs gathered logits + plain loss: the same losses, the same
    main gradients before every update, the same weights after STEPS optimizer steps (fp32)."""
    runs = jobs(2)[0]["parallel_output"], jobs(2)[1]["parallel_output"]
    failures = []
    for rank, by_cell in enumerate(runs):
        for tied in TIED:
            sharded, gathered = by_cell[tied, True], by_cell[tied, False]
            where = f"rank {rank} {'tied' if tied else 'untied'}: "
            if not (sharded["sharded"] and not gathered["sharded"]):
                failures.append(where + "parallel_output did not switch the logits between shard and whole")
            weights_tol = {steps: _parallel_output_weights_rtol(sharded, steps) for steps in range(STEPS + 1)}
            # after k updates, losses and gradients also carry the weights' difference: to first order a
            # relative change eps_p of a weight matrix, embedding or norm weight changes what passes through it
            # by eps_p; independent, they add in quadrature (as in test_model.py)
            later = {step: math.sqrt(sum(t**2 for t in weights_tol[step - 1].values())) for step in range(1, STEPS + 1)}
            for step, (a, b) in enumerate(zip(gathered["losses"], sharded["losses"]), start=1):
                if abs(a - b) > (PARALLEL_OUTPUT_LOSS_RTOL + later[step]) * abs(b):
                    failures.append(where + f"step {step} loss {a!r} != {b!r}")
            for step, (ga, gb) in enumerate(zip(gathered["grads"], sharded["grads"]), start=1):
                tol = PARALLEL_OUTPUT_GRAD_RTOL + later[step]
                for n in gb:
                    if _rel_err(ga[n], gb[n]) > tol:
                        failures.append(where + f"step {step} grad {n} rel err {_rel_err(ga[n], gb[n]):.2e} > {tol:.2e}")
            for n, p in sharded["params"].items():
                if _rel_err(gathered["params"][n], p) > weights_tol[STEPS][n]:
                    failures.append(where + f"weights after {STEPS} steps: {n} "
                                            f"rel err {_rel_err(gathered['params'][n], p):.2e} > {weights_tol[STEPS][n]:.2e}")
            if len(sharded["grads"]) != STEPS or len(gathered["grads"]) != STEPS:
                failures.append(where + "the optimizer step was not called once per train_step")
    assert not failures, "\n".join(failures)


def test_tf32_keeps_fp32_parameters_and_fp32_numbers_on_cpu():
    """``tf32`` is a CUDA compute mode, not a storage dtype: parameters stay fp32 (marks or not) and a
    CPU forward equals the fp32 model's bitwise."""
    from tessera.config.dtypes import parse_dtype, resolve_model_dtype
    from tessera.core.naive_amp import NaiveAMPModel
    from tessera.model import build_model

    for name in ("tf32", "torch.tf32"):
        assert parse_dtype(name) == (torch.float32, True)
        p = resolve_model_dtype(name)
        assert p.dtype == torch.float32 and p.tf32 and not p.is_low_precision and not p.uses_loss_scaling
    assert parse_dtype("torch.float32") == (torch.float32, False)

    cfg = {**MODEL, "dtype": "torch.tf32"}
    ids = _sequences(2, SEQ, seed=3)
    ref = build_model(cfg, seed=SEED)
    with torch.no_grad():
        want = ref(ids)
    for marks in MARKS.values():
        model = NaiveAMPModel(build_model(cfg, seed=SEED), dtype="torch.tf32", sync_buffer=False,
                              fp32_modules=marks.get("fp32_modules", ()),
                              use_fp32_norm=bool(marks.get("use_fp32_norm")))
        assert model.dtype == torch.float32 and model.model_dtype.tf32
        assert {p.dtype for p in model.parameters()} == {torch.float32}, marks
        with torch.no_grad():
            got = model(ids)
        assert got.dtype == torch.float32 and torch.equal(got, want), marks
