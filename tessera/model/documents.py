"""The document layout of one forward (``AttentionPlan``), shared by every attention layer, and its checks.

Packed rows hold several documents separated by ``cu_seqlens``; the plan records them once per forward
and builds, on first use, what each attention backend needs (varlen boundaries, the block-diagonal mask,
the CPU kernel's buckets). The attention computation itself is ``tessera.model.attention``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from tessera.model import cpu_attention
from tessera.model.rotary import document_ids

__all__ = ["AttentionPlan", "KVCacheLike", "check_cu_seqlens", "check_cu_seqlens_shape", "check_max_seqlen",
           "plan_attention"]


class KVCacheLike(Protocol):
    """A KV cache as attention uses it (``tessera.model.kv_cache.KVCache``): one cache for all layers,
    each attention appending at its own ``layer_index``."""

    length: int  # positions already cached before the current queries (the model advances it after a forward)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class AttentionPlan:
    """The document layout of one forward, shared by every layer.

    The backend is not part of it: each call picks one from the q/k/v it is given (an fp32-marked
    attention inside a bf16 model gets fp32 tensors, which flash_attn refuses). What a backend needs
    (flash varlen boundaries, the SDPA block-diagonal mask, the CPU kernel's document buckets) is built on
    first use and reused. ``max_seqlen`` (the longest document) comes from the host with the boundaries
    checked there (``check_cu_seqlens``), so a ``cu_seqlens`` on the GPU is never read back.
    """

    batch: int
    seqlen: int
    cu_seqlens: torch.Tensor | None = None  # None or one document per row: plain causal attention
    use_flash_attn: bool = True
    max_seqlen: int | None = None  # set with cu_seqlens (plan_attention)
    _varlen: tuple[torch.Tensor, int] | None = field(default=None, repr=False)
    _mask: torch.Tensor | None = field(default=None, repr=False)
    _buckets: list[cpu_attention.DocumentBucket] | None = field(default=None, repr=False)

    @property
    def packed(self) -> bool:
        # one document per row means B+1 boundaries, all of them row boundaries
        return self.cu_seqlens is not None and self.cu_seqlens.numel() != self.batch + 1

    def varlen(self, device: torch.device) -> tuple[torch.Tensor, int]:
        """int32 ``cu_seqlens`` on ``device`` and the longest document (flash_attn_varlen_func)."""
        if self._varlen is None:
            assert self.cu_seqlens is not None, "varlen attention needs cu_seqlens"
            assert self.max_seqlen is not None, "varlen attention needs max_seqlen (plan_attention sets it)"
            self._varlen = (self.cu_seqlens.to(device=device, dtype=torch.int32), self.max_seqlen)
        return self._varlen

    def mask(self, device: torch.device) -> torch.Tensor:
        """``[B, 1, S, S]`` bool, True where a query may attend (same document, not in the future)."""
        if self._mask is None:
            assert self.cu_seqlens is not None, "a packed mask needs cu_seqlens"
            docs = document_ids(self.cu_seqlens.to(device), self.batch, self.seqlen)
            causal = torch.ones(self.seqlen, self.seqlen, dtype=torch.bool, device=device).tril()
            self._mask = ((docs.unsqueeze(2) == docs.unsqueeze(1)) & causal).unsqueeze(1)
        return self._mask

    def document_buckets(self) -> list[cpu_attention.DocumentBucket]:
        """The documents grouped by padded length for the CPU per-document kernel (read on the host)."""
        if self._buckets is None:
            assert self.cu_seqlens is not None, "document buckets need cu_seqlens"
            self._buckets = cpu_attention.document_buckets(self.cu_seqlens, self.batch, self.seqlen)
        return self._buckets


def _shown(values: list[int], limit: int = 12) -> str:
    """A boundary list for an error message, shortened in the middle when long."""
    if len(values) <= limit:
        return str(values)
    return f"[{', '.join(map(str, values[:limit // 2]))}, ..., {', '.join(map(str, values[-limit // 2:]))}] " \
           f"({len(values)} boundaries)"


def check_cu_seqlens_shape(cu_seqlens: torch.Tensor, batch: int, seqlen: int) -> None:
    """What can be checked without reading the values (no device sync): a 1-D integer tensor of at least
    B+1 and at most B*S+1 boundaries."""
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor of document boundaries, got shape "
                         f"{tuple(cu_seqlens.shape)} and dtype {cu_seqlens.dtype}")
    if not batch + 1 <= cu_seqlens.numel() <= batch * seqlen + 1:
        raise ValueError(f"cu_seqlens of a {batch}x{seqlen} batch holds between {batch + 1} boundaries (one "
                         f"document per row) and {batch * seqlen + 1} (one per token), got {cu_seqlens.numel()}")


def check_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, seqlen: int) -> int:
    """Check the document boundaries of a ``[batch, seqlen]`` batch on the host; returns the longest
    document (``max_seqlen`` of varlen attention).

    Run before the batch is copied to the GPU (``tessera.train.batch``): reading boundaries that live on
    the device would wait for it once per micro-batch, so a device tensor is refused here.
    """
    check_cu_seqlens_shape(cu_seqlens, batch, seqlen)
    if cu_seqlens.device.type != "cpu":
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device}: its boundaries are checked and max_seqlen is "
                         "computed on the host, before the copy to the device (reading them there waits for the "
                         "device); pass the host tensor, or max_seqlen with boundaries already checked")
    cu = np.asarray(cu_seqlens.tolist(), dtype=np.int64)  # host values (tolist: no torch op, even under a fake mode)
    total = batch * seqlen
    first, last = int(cu[0]), int(cu[-1])
    if first != 0 or last != total:
        raise ValueError(f"cu_seqlens must start at 0 and end at batch*seq_len = {batch}*{seqlen} = {total}, got "
                         f"{first} ... {last} (cu_seqlens={_shown(cu.tolist())})")
    lengths = np.diff(cu)
    bad = np.flatnonzero(lengths <= 0)
    if bad.size:
        i = int(bad[0]) + 1
        raise ValueError(f"cu_seqlens must be strictly increasing: cu_seqlens[{i}]={int(cu[i])} <= "
                         f"cu_seqlens[{i - 1}]={int(cu[i - 1])} (cu_seqlens={_shown(cu.tolist())})")
    missing = np.flatnonzero(~np.isin(np.arange(seqlen, total, seqlen), cu))
    if missing.size:
        row = int(missing[0]) + 1
        raise ValueError(f"every row boundary must be a document boundary: row {row} starts at token {row * seqlen} "
                         f"(= {row} x seq_len {seqlen}), which cu_seqlens={_shown(cu.tolist())} lacks (a document "
                         "would run across rows)")
    return int(lengths.max())


def check_max_seqlen(cu_seqlens: torch.Tensor, batch: int, seqlen: int, max_seqlen: int | None) -> int:
    """The forward's ``max_seqlen``: a host ``cu_seqlens`` is checked here (cheap); a device one must come with
    ``max_seqlen`` from the host check, and only its shape is checked (no value read back)."""
    if max_seqlen is None or cu_seqlens.device.type == "cpu":
        return check_cu_seqlens(cu_seqlens, batch, seqlen)
    check_cu_seqlens_shape(cu_seqlens, batch, seqlen)
    if not 1 <= max_seqlen <= seqlen:
        raise ValueError(f"max_seqlen={max_seqlen}: the longest document of a {batch}x{seqlen} batch has 1 to "
                         f"{seqlen} tokens")
    return max_seqlen


def plan_attention(cu_seqlens: torch.Tensor | None, batch: int, seqlen: int, use_flash_attn: bool,
                   max_seqlen: int | None = None) -> AttentionPlan:
    """The layout every layer's attention shares in one forward (``cu_seqlens`` already checked). ``max_seqlen``:
    from the host check; None for a host ``cu_seqlens`` computes it here (a device one is refused)."""
    if cu_seqlens is not None and max_seqlen is None:
        max_seqlen = check_cu_seqlens(cu_seqlens, batch, seqlen)
    return AttentionPlan(batch, seqlen, cu_seqlens, use_flash_attn, max_seqlen)
