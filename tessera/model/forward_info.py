"""What every decoder block of one forward shares (``ForwardContext``), built once by ``Transformer.forward``.

The rotary angles, the attention layout, the KV cache and the dataflow switches are the same for every
layer of a forward; passing them as one frozen object instead of seven positional arguments keeps the
layer, attention and checkpoint call sites from drifting apart, and lets a checkpointed block's
recomputation see exactly what its forward saw: non-reentrant ``torch.utils.checkpoint`` calls the
block again with the very arguments it was given, this object included.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from tessera.model.documents import AttentionPlan, KVCacheLike
from tessera.model.recompute import RNGReplay

__all__ = ["ForwardContext"]


@dataclass(frozen=True)
class ForwardContext:
    """Per-forward inputs of the decoder blocks (frozen: one forward's layers cannot change it for the next).

    ``cos``/``sin``: rotary angles ``[B, S, 1, head_dim / 2]`` (fp32) of the full sequence, also under
    sequence parallelism. ``plan``: the documents' layout; its packed mask is built once and shared.
    ``sequence_parallel``: blocks take and return this rank's sequence chunk (msp). ``selective``: each
    half of a layer runs under selective checkpointing. ``cache``: the whole KV cache (inference); each
    attention appends at its own layer index. ``rng_replay``: set only for one checkpointed region
    (``replaying``), so its recomputation redraws the same attention-dropout masks.
    """

    cos: torch.Tensor
    sin: torch.Tensor
    plan: AttentionPlan
    sequence_parallel: bool = False
    selective: bool = False
    cache: KVCacheLike | None = None
    rng_replay: RNGReplay | None = None

    def replaying(self) -> ForwardContext:
        """This context with a fresh ``RNGReplay``, for one checkpointed region (a layer or a block):
        a replay records one region's dropout state, so regions never share one."""
        return dataclasses.replace(self, rng_replay=RNGReplay())
