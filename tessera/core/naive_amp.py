"""``from tessera.core.naive_amp import NaiveAMPModel, set_fp32_attr_to_module, module_has_fp32_attr``:
the DESIGN.md path of the mixed-precision wrapper.

Re-exports of ``tessera.train.naive_amp``, where the wrapper lives; patch it there.
"""

from tessera.train.naive_amp import NaiveAMPModel, module_has_fp32_attr, set_fp32_attr_to_module

__all__ = ["NaiveAMPModel", "set_fp32_attr_to_module", "module_has_fp32_attr"]
