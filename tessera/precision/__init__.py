"""Everything that decides a number's format in a run, in one package: the precision plan built once from the
typed config (``plan``), the process-wide numeric switches (``switches``), the fp32 marks (``fp32_marks``), one
GEMM policy per linear and the recipes' own state (``linears``), the GEMM route the memory plan and the run share
(``routes``), and the loss scalers (``scaler``). The NaiveAMP wrapper that applies the dtype and the marks keeps
InternEvo's path, ``tessera.core.naive_amp``; the master/moment update is the optimizer's
(``tessera.optim.master_policy``), from the plan's ``OptimizerDtypes``.
"""

from tessera.precision.plan import LowPrecisionGemms, OptimizerDtypes, PrecisionPlan
from tessera.precision.switches import apply_precision

__all__ = ["LowPrecisionGemms", "OptimizerDtypes", "PrecisionPlan", "apply_precision"]
