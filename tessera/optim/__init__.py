"""HybridZeroOptimizer and what it is made of: one module per job.

    hybrid_zero.py    HybridZeroOptimizer: masters, inner-optimizer state, the step, its state dicts
    settings.py       the ``hybrid_zero_optimizer`` config section, read once (ZeroSettings)
    groups.py         TP / DP / ZERO1 / global groups and the in-place flat-buffer collectives
    params.py         which parameters are managed, and the names their state is keyed by
    bucket.py         one bucket's flat buffers, shard layout and per-parameter state translation
    buffers.py        GradientBuffers: main-grad buffers, buckets, post-accumulate-grad hooks, DP reduction
    clipping.py       overflow agreement, the global gradient norm, the clipping factor
    master_policy.py  the model precision and the master / moment dtype policy (MasterPolicy)
    lowp_adamw.py     AdamW arithmetic in fp32 on bf16 masters / moments (Kahan, stochastic rounding)
    skips.py          step counts, recent loss scales, TooManySkippedSteps
    state_format.py   the two state-dict formats and ShardSource (what checkpoints read)

A layer between ``core`` and ``train``: it takes the run description (``tessera.core.job.Job``) for its
groups, precision and seed, and the loss scalers from ``tessera.core.grad_scaler``. The documented path
``tessera.optim.HybridZeroOptimizer`` is the documented path; ``tessera.train.builder`` builds one
from a config, as part of the training stack.
"""

from tessera.optim.hybrid_zero import HybridZeroOptimizer
from tessera.optim.skips import TooManySkippedSteps

__all__ = ["HybridZeroOptimizer", "TooManySkippedSteps"]
