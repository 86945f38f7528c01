"""DESIGN.md's public API block, run as written: every contract path imports, and each name is the
object of the module where the code lives (the ``tessera.core`` paths re-export, they define nothing)."""

import importlib


def test_the_design_import_block_runs_and_names_the_real_objects():
    import tessera.config
    import tessera.config.precision
    import tessera.core.naive_amp
    import tessera.dist
    from tessera.core.config import Config, ConfigError
    from tessera.core.context import ParallelMode, gpc, launch_from_slurm, launch_from_torch
    from tessera.core.grad_scaler import DynamicGradScaler
    from tessera.core.naive_amp import NaiveAMPModel, module_has_fp32_attr, set_fp32_attr_to_module
    from tessera.core.optimizer import HybridZeroOptimizer
    from tessera.core.precision import parse_dtype
    from tessera.model import RMSNorm, build_model
    from tessera.parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        vocab_parallel_cross_entropy,
    )

    assert (Config, ConfigError) == (tessera.config.Config, tessera.config.ConfigError)
    assert (gpc, ParallelMode, launch_from_torch, launch_from_slurm) == (
        tessera.dist.gpc, tessera.dist.ParallelMode, tessera.core.context.launch_from_torch, tessera.core.context.launch_from_slurm)
    assert parse_dtype is tessera.config.precision.parse_dtype
    assert (NaiveAMPModel, set_fp32_attr_to_module, module_has_fp32_attr) == (
        tessera.core.naive_amp.NaiveAMPModel, tessera.core.naive_amp.set_fp32_attr_to_module,
        tessera.core.naive_amp.module_has_fp32_attr)
    assert all(callable(x) for x in (DynamicGradScaler, HybridZeroOptimizer, RMSNorm, build_model, ColumnParallelLinear,
                                     RowParallelLinear, VocabParallelEmbedding, vocab_parallel_cross_entropy))
    assert {"GLOBAL", "DATA", "TENSOR", "ZERO1"} <= set(ParallelMode.__members__)


def test_the_re_export_modules_export_exactly_the_contract_names():
    contract = {
        "config": {"Config", "ConfigError"},
        "context": {"gpc", "ParallelMode", "launch_from_torch", "launch_from_slurm"},
        "precision": {"parse_dtype"},
        "naive_amp": {"NaiveAMPModel", "set_fp32_attr_to_module", "module_has_fp32_attr"},
    }
    for name, names in contract.items():
        module = importlib.import_module(f"tessera.core.{name}")
        assert module.__name__ == f"tessera.core.{name}"  # a module of its own, not an alias of another
        assert set(module.__all__) == names, name
