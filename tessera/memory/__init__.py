"""The memory model: what a rank of a run holds, in closed form, from the config.

One home for every term, used by the run's memory check at launch (``tessera.train.memory_check``) and by
the plan (``tessera.plan``, ``tools/plan.py``), which sets each term beside a dry run's traced bytes:

- ``persistent``: the persistent training state, bytes per parameter by role (``closed_form_bytes``);
- ``activations``: one micro-batch's activations, kept and at their peak (``activation_bytes``);
- ``census``: the parameters of a rank by dtype, on a meta build with the run's fp32 marks (``meta_census``);
- ``extras``: what a GPU holds beyond them (SDPA's masks and expanded K/V, the NCCL and cuBLAS allowance)
  and the low-precision GEMMs' operand copies;
- ``estimate``: the sums, for the run's check (``plan_persistent_state``) and the plan's rows
  (``closed_form_memory``).

It sits above ``core`` (the meta census wraps the model as the run does) and below ``train`` and ``plan``.
"""

from tessera.memory.activations import activation_bytes
from tessera.memory.census import MetaCensus, meta_census, param_counts
from tessera.memory.estimate import StatePlan, closed_form_memory, headroom_of, plan_persistent_state
from tessera.memory.persistent import ROLES, closed_form_bytes

__all__ = ["activation_bytes", "MetaCensus", "meta_census", "param_counts", "StatePlan", "closed_form_memory",
           "headroom_of", "plan_persistent_state", "ROLES", "closed_form_bytes"]
