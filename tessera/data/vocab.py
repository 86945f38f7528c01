"""The model vocabulary a tokenizer needs: at least its ids, padded so tensor parallelism can split it.

A tokenizer's id count is rarely what a model should use: the byte tokenizer has 257 ids (256 bytes and
the end of document), and the vocab-parallel embedding and head split ``model.vocab_size`` evenly over
the TP ranks, so 257 fits TP=1 only. Rounding up to a multiple of ``VOCAB_MULTIPLE`` (64) gives a size
every power-of-two TP size up to 64 divides, for a few rows no target ever names (320 for bytes: 63
unused rows, 0.02 M parameters at the demo's width).
"""

from __future__ import annotations

VOCAB_MULTIPLE = 64


def padded_vocab_size(num_ids: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """The smallest multiple of ``multiple`` that holds ``num_ids`` ids."""
    if num_ids < 1 or multiple < 1:
        raise ValueError(f"padded_vocab_size needs num_ids >= 1 and multiple >= 1, got {num_ids}, {multiple}")
    return -(-num_ids // multiple) * multiple


def vocab_advice(num_ids: int) -> str:
    """What to set ``model.vocab_size`` to for data of a tokenizer with ``num_ids`` ids (one line)."""
    padded = padded_vocab_size(num_ids)
    if padded == num_ids:
        return (f"model.vocab_size={num_ids} (the tokenizer's ids, a multiple of {VOCAB_MULTIPLE}: any power-of-two "
                f"TP size up to {VOCAB_MULTIPLE} divides it)")
    return (f"model.vocab_size={padded} (the tokenizer's {num_ids} ids rounded up to a multiple of {VOCAB_MULTIPLE}, "
            f"so any power-of-two TP size up to {VOCAB_MULTIPLE} divides it; {num_ids} itself splits only over "
            f"TP sizes that divide {num_ids})")
