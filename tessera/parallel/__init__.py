"""Tensor-parallel building blocks: autograd collectives, sharded layers, vocab-parallel loss.

Nothing here reads ``gpc`` or the config: every layer takes its process group as an argument.
"""

from tessera.parallel.attrs import is_tensor_parallel, partition_dim, set_tensor_parallel_attrs
from tessera.parallel.comm import MetaGroup, group_rank, group_size
from tessera.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from tessera.parallel.loss import vocab_parallel_cross_entropy

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy",
    "MetaGroup",
    "group_size",
    "group_rank",
    "set_tensor_parallel_attrs",
    "is_tensor_parallel",
    "partition_dim",
]
