"""A plain single-process PyTorch decoder with tessera's dims, the reference the bench compares to.

Written with ``nn.Linear``/``nn.Embedding``, an RMSNorm, rotate-half rotary, ``F.scaled_dot_product_attention``
(``is_causal``) and a SwiGLU MLP: the same matmuls (same FLOPs) as ``tessera.model.Transformer`` at TP=1,
with the same parameter names, so ``load_state_dict`` of a tessera model works and the first-step losses
can be compared. Precision follows plain-PyTorch practice: fp32 parameters, and for bf16/fp16 a
``torch.autocast`` region. ``gemm="lowp"`` keeps autocast's semantics (per-op casts of the fp32 weights,
low-precision operands) but routes the GEMMs through ``tessera.parallel.gemm.linear`` and attention through
``tessera.model.sdpa`` -- the same kernel choice tessera makes -- so the framework's overhead can be told
apart from the kernel choice (the variant keeps its historical name, ``lowp``, in the results).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from tessera.model import sdpa
from tessera.parallel import gemm as tessera_gemm

__all__ = ["PlainDecoder", "PlainStep"]


class _Ops:
    """Matmul and attention for one precision recipe (autocast's own kernels, or tessera's GEMM route and SDPA)."""

    def __init__(self, dtype: torch.dtype, gemm: str) -> None:
        if gemm not in ("torch", "lowp"):
            raise ValueError(f"gemm must be 'torch' or 'lowp', got {gemm!r}")
        self.low = dtype if dtype in (torch.bfloat16, torch.float16) else None
        self.lowp = gemm == "lowp" and self.low is not None

    def linear(self, x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
        if not self.lowp:
            return layer(x)  # autocast (if active) casts x and the weight to the low dtype
        with torch.autocast(x.device.type, enabled=False):  # cast as autocast would, then tessera's kernel
            return tessera_gemm.linear(x.to(self.low), layer.weight.to(self.low))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not self.lowp:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        with torch.autocast(q.device.type, enabled=False):
            return sdpa.scaled_dot_product_attention(q.to(self.low), k.to(self.low), v.to(self.low), is_causal=True)


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, ops: _Ops) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.ops = ops
        self.wq = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.ops.linear(x, self.wq).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.ops.linear(x, self.wk).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.ops.linear(x, self.wv).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(q.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(k.dtype)
        if self.kv_heads != self.heads:
            rep = self.heads // self.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = self.ops.attention(q, k, v).transpose(1, 2).reshape(b, s, self.heads * self.head_dim)
        return self.ops.linear(out, self.wo)


class _SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int, ops: _Ops) -> None:
        super().__init__()
        self.ops = ops
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(F.silu(self.ops.linear(x, self.w1)) * self.ops.linear(x, self.w3), self.w2)


class _Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int, eps: float, ops: _Ops) -> None:
        super().__init__()
        self.attention_norm = _RMSNorm(hidden, eps)
        self.attention = _Attention(hidden, heads, kv_heads, ops)
        self.ffn_norm = _RMSNorm(hidden, eps)
        self.feed_forward = _SwiGLU(hidden, ffn, ops)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class PlainDecoder(nn.Module):
    """Pre-norm LLaMA-style decoder; parameter names match ``tessera.model.Transformer`` (TP=1)."""

    def __init__(self, args: Any, dtype: torch.dtype = torch.float32, gemm: str = "torch") -> None:
        super().__init__()
        ops = _Ops(dtype, gemm)
        self.head_dim = args.hidden_size // args.num_attention_heads
        self.rope_base = args.rope_base
        self.ops = ops
        self.embedding = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(
            _Layer(args.hidden_size, args.num_attention_heads, args.num_kv_attention_heads, args.ffn_hidden_size,
                   args.layer_norm_epsilon, ops) for _ in range(args.num_layers))
        self.norm = _RMSNorm(args.hidden_size, args.layer_norm_epsilon)
        self.output = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        s = input_ids.shape[1]
        dims = torch.arange(0, self.head_dim, 2, device=input_ids.device).float()
        inv = 1.0 / self.rope_base ** (dims / self.head_dim)
        angles = torch.arange(s, device=input_ids.device).float()[:, None] * inv
        emb = torch.cat((angles, angles), -1)
        cos, sin = emb.cos(), emb.sin()  # [S, d], broadcast over [B, H, S, d]
        h = self.embedding(input_ids)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.ops.linear(self.norm(h), self.output)


class PlainStep:
    """One plain training step: autocast forward, fp32 cross-entropy (token mean), backward,
    ``clip_grad_norm_`` and ``torch.optim.AdamW`` -- the work tessera's step does, written the usual way."""

    def __init__(self, model: PlainDecoder, dtype: torch.dtype, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, clip: float) -> None:
        self.model = model
        self.dtype = dtype
        self.clip = clip
        decay = [p for n, p in model.named_parameters() if p.dim() > 1]
        no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1]
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                            {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=betas, eps=eps)
        self.scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor) -> float:
        """Returns the loss (mean nats per labelled token)."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        low = self.dtype in (torch.bfloat16, torch.float16)
        with torch.autocast(input_ids.device.type, dtype=self.dtype, enabled=low):
            logits = self.model(input_ids)
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
            self.optimizer.step()
        return float(loss.detach())
