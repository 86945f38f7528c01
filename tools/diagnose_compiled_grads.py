"""Which parameters' gradients compiled blocks get wrong: each one's relative error against an fp32 eager model.

    python tools/diagnose_compiled_grads.py [--device cuda] [--steps 3] [--checkpoint False|selective|True]

The model of ``tests/test_compile.py`` (2 layers of 64, grouped KV heads, packed documents) with the same
weights four ways: fp32 eager (the reference; on CUDA its attention is SDPA with a mask, no flash kernel
takes fp32), bf16 eager, bf16 with compiled blocks (inductor), and bf16 eager with torch's varlen kernel
refused (SDPA with a mask). Per step, one row per parameter: ``|g - g_fp32| / |g_fp32|`` of each bf16 way.
bf16 rounding puts every entry near 1e-2; a compiled column far above the eager one names what the compiled
backward breaks. Step 0 runs the compiled model eagerly (its warm-up), as train.py's first step does.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
import torch.nn.functional as F

from tessera.cli_args import positive_int
from tessera.core.naive_amp import NaiveAMPModel
from tessera.model import attention
from tessera.model.args import ModelArgs
from tessera.model.compile import compile_blocks
from tessera.model.documents import check_cu_seqlens
from tessera.model.transformer import Transformer

SEQ, BATCH, VOCAB = 32, 2, 128
PACKED = [0, 10, 32, 50, 57, 64]  # several documents a row, every row boundary a document boundary


def _model(dtype: str, checkpoint: Any) -> NaiveAMPModel:
    args = ModelArgs(num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_attention_heads=2,
                     vocab_size=VOCAB, checkpoint=checkpoint, parallel_output=False)
    return NaiveAMPModel(Transformer(args, None, tensor_mode="mtp"), dtype=dtype, sync_buffer=False).train()


def _grads(model: torch.nn.Module, step: int, device: str) -> tuple[float, dict[str, torch.Tensor]]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step)).to(device)
    cu = torch.tensor(PACKED, device=device)
    logits = model(ids, cu_seqlens=cu, max_seqlen=check_cu_seqlens(torch.tensor(PACKED), BATCH, SEQ))
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1))
    loss.backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def _rel(a: torch.Tensor | None, b: torch.Tensor) -> str:
    if a is None:
        return "no grad"
    return f"{float((a - b).norm() / b.norm().clamp_min(1e-30)):.4f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=positive_int, default=3)
    p.add_argument("--checkpoint", default="False", choices=["False", "selective", "True"])
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: --device cuda, but torch.cuda.is_available() is False (use --device cpu)", file=sys.stderr)
        return 2
    checkpoint = {"False": False, "True": True, "selective": "selective"}[args.checkpoint]
    torch.manual_seed(0)
    fp32 = _model("float32", checkpoint).to(args.device)
    eager = _model("bfloat16", checkpoint).to(args.device)
    eager.load_state_dict(fp32.state_dict())
    compiled = _model("bfloat16", checkpoint).to(args.device)  # built, not deep-copied: a copy's weights lose
    compiled.load_state_dict(fp32.state_dict())  # their fusion tags, and the traced backward its weight_grad
    compile_blocks(compiled, backend="inductor")
    varlen = attention.torch_varlen
    for step in range(args.steps):
        ref_loss, ref = _grads(fp32, step, args.device)
        losses, ways = {}, {}
        for name, model in (("eager", eager), ("compiled", compiled)):
            losses[name], ways[name] = _grads(model, step, args.device)
        attention.torch_varlen = lambda: (None, "refused by tools/diagnose_compiled_grads.py")  # type: ignore[assignment]
        try:
            losses["eager, SDPA mask"], ways["eager, SDPA mask"] = _grads(eager, step, args.device)
        finally:
            attention.torch_varlen = varlen
        print(f"step {step}: loss fp32 {ref_loss:.5f}, " + ", ".join(f"{k} {v:.5f}" for k, v in losses.items()))
        print("| parameter | " + " | ".join(ways) + " |")
        print("|---|" + "---|" * len(ways))
        for pname, want in ref.items():
            print(f"| {pname} | " + " | ".join(_rel(g.get(pname), want) for g in ways.values()) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
