"""tessera against the model a user would train instead: Hugging Face's ``LlamaForCausalLM`` at the same dims.

    python -m benchmarks gpu-peers [--config configs/1B.py] [--rounds 8] [--device cuda] [--tiny]
                                   [--only NAME ...] [--out BENCHMARKS.md] [key.sub=value ...]

Four variants in one process, interleaved by the harness (one step each per round, the order rotating):

- ``tessera eager`` / ``tessera compiled``: ``build_training_stack`` of the config (bf16 by default, packed
  documents, the fused head and loss), ``model.compile.enabled`` False / True;
- ``tessera compiled (one document a row)`` (``data.pack_sample_into_one=True``: attention over the whole row,
  no document boundaries, what a packed row must not cost more than) and ``tessera compiled (fusion off)``
  (``hybrid_zero_optimizer.fuse_wgrad_accumulation=False``: what the fp32 weight-gradient GEMMs save);
- ``hf eager`` / ``hf compiled``: transformers' ``LlamaForCausalLM`` of the same dims (``tessera.checkpoint
  .hf_config``), fp32 parameters, bf16 autocast, SDPA attention, ``torch.optim.AdamW`` (fused on CUDA), and
  the same ``torch.compile(model)``; it sees the same tokens, without keeping packed documents apart.

Each step trains on the same ``micro_bsz x micro_num`` rows of ``seq_len`` tokens. Reported per variant:
the median step, tokens/s, MFU (``flops_per_token`` of the dims, against the GPU table's bf16 peak for the
device), and the peak of ``torch.cuda.max_memory_allocated`` over its steps; ratios to ``hf compiled`` are
paired by round. Needs the ``hf`` extra. ``--tiny`` runs configs/tiny.py's dims on any device (the test).
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks import harness
from tessera.cli_args import positive_int

TITLE = "## 17. GPU peers: tessera against Hugging Face LlamaForCausalLM at the same dims"
ONE_DOC, FUSION_OFF = "tessera compiled (one document a row)", "tessera compiled (fusion off)"
VARIANTS = ("tessera eager", "tessera compiled", ONE_DOC, FUSION_OFF, "hf eager", "hf compiled")
BASELINE = "hf compiled"


def _tessera_step(cfg: Any, device: str, compiled: bool, *, one_document_a_row: bool = False,
                  fuse_wgrad: bool = True) -> Callable[[], float]:
    c = copy.deepcopy(cfg)
    c.model.compile.enabled = compiled
    if one_document_a_row:
        c.data.pack_sample_into_one = True
    c.hybrid_zero_optimizer.fuse_wgrad_accumulation = fuse_wgrad
    stack = harness.build(c, device=device)
    batches = harness.batches(c)
    return lambda: stack.trainer.train_step(batches).loss


def _hf_step(cfg: Any, device: str, compiled: bool) -> Callable[[], float]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tessera.checkpoint.hf_config import hf_config_from_model_cfg

    spec = hf_config_from_model_cfg(cfg.model, family="llama")
    spec = {k: v for k, v in spec.items() if k not in ("architectures", "model_type", "torch_dtype", "dtype")}
    torch.manual_seed(cfg.seed)
    # through Any: transformers 5.24's stubs refuse attn_implementation as a keyword and type .to() without self
    hf: Any = LlamaForCausalLM(LlamaConfig(**{**spec, "attn_implementation": "sdpa"}))
    model = hf.to(device)  # fp32 parameters
    fused = {"fused": True} if device.startswith("cuda") else {}
    adam = cfg.adam
    opt = torch.optim.AdamW(model.parameters(), lr=adam.lr, betas=(adam.adam_beta1, adam.adam_beta2),
                            eps=adam.adam_eps, weight_decay=adam.weight_decay, **fused)
    run = torch.compile(model) if compiled else model
    rows = [(b["input_ids"].to(device), b["labels"].to(device)) for b in harness.batches(cfg)]
    autocast_device = "cuda" if device.startswith("cuda") else "cpu"

    def step() -> float:
        total = 0.0
        for ids, labels in rows:  # micro-batches, as tessera's step; HF shifts labels itself: give it the inputs
            with torch.autocast(autocast_device, dtype=torch.bfloat16):
                logits = run(input_ids=ids).logits
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(),
                                                     ignore_index=-100) / len(rows)
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.hybrid_zero_optimizer.clip_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    return step


def _with_peak_memory(step: Callable[[], float], device: str, peaks: dict[str, float], name: str) -> Callable[[], Any]:
    """``step``, keeping the largest ``max_memory_allocated`` of its calls (CUDA only)."""
    import torch

    def run() -> Any:
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        out = step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
            peaks[name] = max(peaks.get(name, 0.0), torch.cuda.max_memory_allocated() / 2**30)
        return out

    return run


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from tessera.model import flops_per_token
    from tessera.train.metrics import gpu_peak_tflops

    config = "configs/tiny.py" if args.tiny else args.config
    cfg = harness.load_config(config, ["data.type='synthetic'", "parallel.tensor.size=1", *args.overrides])
    builders = {"tessera eager": lambda: _tessera_step(cfg, args.device, False),
                "tessera compiled": lambda: _tessera_step(cfg, args.device, True),
                ONE_DOC: lambda: _tessera_step(cfg, args.device, True, one_document_a_row=True),
                FUSION_OFF: lambda: _tessera_step(cfg, args.device, True, fuse_wgrad=False),
                "hf eager": lambda: _hf_step(cfg, args.device, False),
                "hf compiled": lambda: _hf_step(cfg, args.device, True)}
    peaks: dict[str, float] = {}
    variants = [harness.Variant(name, _with_peak_memory(builders[name](), args.device, peaks, name))
                for name in args.only]
    timed = harness.interleave(variants, args.rounds, warmup=args.warmup)
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    tokens = cfg.data.micro_bsz * cfg.data.micro_num * cfg.data.seq_len
    return {"config": config, "overrides": list(args.overrides), "device": device_name, "tokens": tokens,
            "dtype": str(cfg.model.dtype), "flops_per_token": flops_per_token(cfg.model, cfg.data.seq_len),
            "peak_tflops": gpu_peak_tflops(device_name, "bfloat16") if device_name != "cpu" else None,
            "rounds": args.rounds, "wall": {n: s.wall for n, s in timed.items()}, "peak_gib": peaks}


def markdown(res: dict[str, Any]) -> list[str]:
    import statistics

    wall, tokens = res["wall"], res["tokens"]
    base = BASELINE if BASELINE in wall else next(n for n in ("hf eager", *wall) if n in wall)
    what = f"`{res['config']}`" + (f" with `{' '.join(res['overrides'])}`" if res["overrides"] else "")
    lines = [f"Reproduce: {harness.provenance(res)}. {what} on {res['device']}: {tokens:,} tokens a step, "
             f"{res['rounds']} interleaved rounds after warm-up; ratios to `{base}` paired by round "
             "(median [min-max]).", "",
             f"| variant | median step (s) | tokens/s | MFU | peak memory (GiB) | tokens/s vs {base} |",
             "|---|---|---|---|---|---|"]
    for name, times in wall.items():
        step = statistics.median(times)
        tps = tokens / step
        mfu = f"{tps * res['flops_per_token'] / 1e12 / res['peak_tflops']:.1%}" if res["peak_tflops"] else "n/a"
        mem = f"{res['peak_gib'][name]:.2f}" if name in res["peak_gib"] else "n/a"
        vs = harness.ratio(harness.paired(wall[base], times))
        lines.append(f"| {name} | {step:.3f} | {tps:,.0f} | {mfu} | {mem} | {vs} |")
    return lines


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or any(n not in VARIANTS for n in names):
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated, of {', '.join(VARIANTS)}")
    return names


def main(argv: Sequence[str] | None = None, prog: str = "python -m benchmarks gpu-peers") -> int:
    ap = harness.parser(prog, __doc__)
    ap.add_argument("--config", default="configs/1B.py")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--rounds", type=positive_int, default=8)
    ap.add_argument("--warmup", type=positive_int, default=2, help="untimed steps per variant (compiles there)")
    ap.add_argument("--only", type=_names, default=list(VARIANTS), help="comma-separated variants (default all)")
    ap.add_argument("--tiny", action="store_true", help="configs/tiny.py dims, seconds on a CPU (the test mode)")
    ap.add_argument("overrides", nargs="*", help="key.sub=value overrides of the config")
    args = ap.parse_args(argv)
    return harness.publish(args, argv, prog, "gpu-peers", TITLE, lambda: measure(args), markdown)
