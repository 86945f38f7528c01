"""What the emulated low-precision GEMMs cost on this machine, with the block quantizers eager and compiled.

    python -m benchmarks emulation [--rounds 7] [--threads 1] [--skip-linears] [--skip-steps] [--out BENCHMARKS.md]

Two tables, each measured side by side in one process (interleaved rounds, the median kept; ratios to bf16 are
per round, so a load that comes and goes moves both sides):

- **per linear**: one linear's forward and both backward GEMMs (``tessera.parallel.gemm.fp8_linear``, bf16
  operands) at configs/tiny.py's dims (128 tokens, 64 -> 128), at 512^3 and at 4,096 tokens x 2,048 -> 2,048,
  for bf16 and each emulated recipe, with the quantizers eager (``TESSERA_QUANTIZER=eager``) and compiled;
- **whole steps**: train.py's step (``harness.build``, synthetic data, one process) of configs/demo.py at TP=1
  and of a 4-layer hidden-512 model (2,048 tokens a step), per recipe, quantizers eager and compiled, beside bf16.

The choice between eager and compiled quantizers is switched between variants in the same process
(``quantizer_kernels.forget_quantizer_kernels``); compilation happens in the warm-up step, not in the rounds.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks import harness
from tessera.cli_args import positive_int

TITLE = "## 19. Emulated low-precision GEMMs on a CPU: quantizers eager and compiled"
# (name, recipe, switches as RecipeSwitches keywords); None: the bf16 linear
RECIPES: list[tuple[str, str | None, dict[str, Any]]] = [
    ("bf16", None, {}),
    ("fp8 tensorwise", "tensorwise", {}),
    ("fp8 rowwise", "rowwise", {}),
    ("fp8 blockwise", "blockwise", {}),
    ("mxfp8", "mxfp8", {"scale_rounding": "rceil"}),
    ("nvfp4", "nvfp4", {}),
    ("nvfp4 NVIDIA recipe", "nvfp4", {"weight_2d": True, "hadamard": True, "stochastic": True}),
]
LINEAR_DIMS = [("configs/tiny.py's w1", (128, 64, 128)), ("512^3", (512, 512, 512)),
               ("4096 x 2048 -> 2048", (4096, 2048, 2048))]
STEP_RECIPES = {  # name -> the config overrides of its model.low_precision
    "bf16": [],
    "fp8 rowwise": ["model.low_precision.enabled=True", "model.low_precision.recipe='rowwise'"],
    "fp8 blockwise": ["model.low_precision.enabled=True", "model.low_precision.recipe='blockwise'"],
    "mxfp8": ["model.low_precision.enabled=True", "model.low_precision.recipe='mxfp8'"],
    "nvfp4": ["model.low_precision.enabled=True", "model.low_precision.recipe='nvfp4'"],
    "nvfp4 NVIDIA recipe": ["model.low_precision={'preset': 'nvidia'}"],
}
HIDDEN_512 = ["model.hidden_size=512", "model.num_attention_heads=8", "model.num_kv_attention_heads=8",
              "data.seq_len=256", "data.micro_bsz=8"]
STEP_CONFIGS = [("configs/demo.py, TP=1", []), ("hidden 512, 4 layers, 2,048 tokens", HIDDEN_512)]


def _choose(choice: str) -> Callable[[], None]:
    def before() -> None:
        from tessera.parallel import quantizer_kernels

        if os.environ.get(quantizer_kernels.ENV) != choice:
            os.environ[quantizer_kernels.ENV] = choice
            quantizer_kernels.forget_quantizer_kernels()
    return before


def _linear_step(recipe: str | None, switches: dict[str, Any], dims: tuple[int, int, int]) -> Callable[[], Any]:
    import torch

    from tessera.parallel.gemm import RecipeSwitches, fp8_linear, linear
    from tessera.parallel.recipe_state import RecipeStream

    t, k, n = dims
    g = torch.Generator().manual_seed(0)
    x = torch.randn(t, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) * k ** -0.5).bfloat16()
    dy = torch.randn(t, n, generator=g).bfloat16()
    state = RecipeStream(0, "benchmark")

    def step() -> None:
        a, b = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = linear(a, b) if recipe is None else fp8_linear(a, b, None, recipe, switches=RecipeSwitches(**switches),
                                                           state=state)
        y.backward(dy)
    return step


def _variants(make: Callable[[str | None, Any], Callable[[], Any]],
              cases: Sequence[tuple[str, str | None, Any]]) -> list[harness.Variant]:
    """bf16 once, and every other case with the quantizers eager and compiled."""
    out = []
    for name, recipe, extra in cases:
        for choice in (("eager",) if recipe is None else ("eager", "compiled")):
            label = name if recipe is None else f"{name} | {choice}"
            out.append(harness.Variant(label, make(recipe, extra), before=_choose(choice)))
    return out


def _table(series: dict[str, harness.Series]) -> dict[str, dict[str, Any]]:
    base = series["bf16"].wall
    return {name: {"ms": 1e3 * s.median(), "vs_bf16": harness.paired(s.wall, base)} for name, s in series.items()}


def measure_linears(rounds: int) -> list[dict[str, Any]]:
    out = []
    for label, dims in LINEAR_DIMS:
        harness.log(f"[emulation] one linear at {label} {dims}")
        variants = _variants(lambda recipe, sw, dims=dims: _linear_step(recipe, sw, dims), RECIPES)
        reps = max(3, rounds // 2) if dims[0] >= 4096 else rounds
        out.append({"label": label, "dims": dims, "rows": _table(harness.interleave(variants, reps, quiet=True))})
    return out


def _train_step(config: str, overrides: list[str]) -> Callable[[], float]:
    cfg = harness.load_config(config, ["data.type='synthetic'", "parallel.tensor.size=1", *overrides])
    stack = harness.build(cfg)
    batches = harness.batches(cfg)
    return lambda: stack.trainer.train_step(batches).loss


def measure_steps(rounds: int) -> list[dict[str, Any]]:
    out = []
    for label, overrides in STEP_CONFIGS:
        harness.log(f"[emulation] whole steps: {label}")
        cases = [(name, None if not ov else name, ov) for name, ov in STEP_RECIPES.items()]
        variants = _variants(lambda _, ov, base=overrides: _train_step("configs/demo.py", [*base, *ov]), cases)
        out.append({"label": label, "rows": _table(harness.interleave(variants, rounds, warmup=2, quiet=True))})
    return out


def measure(args: Any) -> dict[str, Any]:
    import torch

    from tessera.parallel import quantizer_kernels

    torch.set_num_threads(args.threads)
    res: dict[str, Any] = {"threads": args.threads, "rounds": args.rounds}
    before = os.environ.get(quantizer_kernels.ENV)
    try:
        if not args.skip_linears:
            res["linears"] = measure_linears(args.rounds)
        if not args.skip_steps:
            res["steps"] = measure_steps(args.rounds)
    finally:  # the process's own choice back, for whatever runs after (a test, the next benchmark)
        if before is None:
            os.environ.pop(quantizer_kernels.ENV, None)
        else:
            os.environ[quantizer_kernels.ENV] = before
        quantizer_kernels.forget_quantizer_kernels()
    return res


def _rows(table: dict[str, dict[str, Any]]) -> list[str]:
    lines = []
    names = list(dict.fromkeys(n.split(" | ")[0] for n in table))
    for name in names:
        if name == "bf16":
            lines.append(f"| bf16 | {table['bf16']['ms']:.2f} | 1.00x | - | - |")
            continue
        e, c = table[f"{name} | eager"], table[f"{name} | compiled"]
        lines.append(f"| {name} | {e['ms']:.2f} | {harness.ratio(e['vs_bf16'], bold=False)} | {c['ms']:.2f} | "
                     f"{harness.ratio(c['vs_bf16'])} |")
    return lines


def markdown(res: dict[str, Any]) -> list[str]:
    head = ["| recipe | eager quantizers, ms | vs bf16 | compiled quantizers, ms | vs bf16 |",
            "|---|---:|---:|---:|---:|"]
    lines = [f"Measured by {harness.provenance(res)}; {res['threads']} thread(s), {res['rounds']} interleaved rounds, "
             "the median kept; \"vs bf16\" is the median of the per-round ratios with their range. The emulation "
             "runs the GEMMs in fp32 on exact operands (on a CPU without AVX-512 BF16 or AMX the bf16 route does "
             "too: `TESSERA_CPU_LOWP_MATMUL`); the quantizers are the difference between the two columns."]
    for block in res.get("linears", []):
        t, k, n = block["dims"]
        lines += ["", f"**One linear, forward and backward**, {block['label']} ({t} tokens, {k} -> {n}):", "", *head,
                  *_rows(block["rows"])]
    for block in res.get("steps", []):
        lines += ["", f"**Whole training steps**, {block['label']} (one process, synthetic data):", "", *head,
                  *_rows(block["rows"])]
    return lines


def main(argv: Sequence[str] | None = None, prog: str = "python -m benchmarks emulation") -> int:
    ap = harness.parser(prog, __doc__)
    ap.add_argument("--rounds", type=positive_int, default=7, help="interleaved rounds per table (default 7)")
    ap.add_argument("--threads", type=positive_int, default=1, help="torch threads (default 1)")
    ap.add_argument("--skip-linears", action="store_true", help="leave out the per-linear tables")
    ap.add_argument("--skip-steps", action="store_true", help="leave out the whole-step tables")
    args = ap.parse_args(argv)
    return harness.publish(args, argv, prog, "emulation", TITLE, lambda: measure(args), markdown)


if __name__ == "__main__":
    sys.exit(main())
