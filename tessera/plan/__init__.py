"""Will it fit? Dry runs at real size on meta tensors, closed forms beside them, and a layout search.

Top of the package graph beside ``train.py``: it drives the model, optimizer, trainer and checkpoint
code exactly as training does, so nothing below imports it.
"""

from tessera.plan.dry_run import StepTrace, dry_run, fake_job, trace_iteration
from tessera.plan.planner import Candidate, make_plan, search_layouts, with_layout
from tessera.plan.report import GPUS, Plan, gpu_for_device_name

__all__ = ["StepTrace", "dry_run", "fake_job", "trace_iteration", "Candidate", "make_plan", "search_layouts",
           "with_layout", "GPUS", "Plan", "gpu_for_device_name"]
