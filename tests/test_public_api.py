"""DESIGN.md's public API block, run as written: every contract path imports, and each name is the object the
code defines (``tessera.core`` holds the run description, the parallel context, launch and precision itself;
the optimizer is ``tessera.optim``'s, above ``core``)."""


def test_the_design_import_block_runs_and_names_the_real_objects():
    import tessera.config
    import tessera.config.dtypes
    import tessera.core.context
    import tessera.core.grad_scaler
    import tessera.core.naive_amp
    import tessera.optim.hybrid_zero
    from tessera.config.dtypes import parse_dtype
    from tessera.core.config import Config, ConfigError
    from tessera.core.context import ParallelMode, gpc, launch_from_slurm, launch_from_torch
    from tessera.core.grad_scaler import DynamicGradScaler
    from tessera.core.naive_amp import NaiveAMPModel, module_has_fp32_attr, set_fp32_attr_to_module
    from tessera.model import RMSNorm, build_model
    from tessera.optim import HybridZeroOptimizer
    from tessera.parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        vocab_parallel_cross_entropy,
    )

    assert (Config, ConfigError) == (tessera.config.Config, tessera.config.ConfigError)
    assert gpc is tessera.core.context.gpc and type(gpc).__module__ == "tessera.core.context"
    assert ParallelMode is tessera.core.layout.ParallelMode
    assert launch_from_torch.__module__ == launch_from_slurm.__module__ == "tessera.core.context"
    assert parse_dtype is tessera.config.dtypes.parse_dtype  # the one dtype parser
    assert NaiveAMPModel.__module__ == "tessera.core.naive_amp"
    # the marks and the scalers live in the precision plan's package; InternEvo's paths import the same objects
    assert set_fp32_attr_to_module.__module__ == module_has_fp32_attr.__module__ == "tessera.precision.fp32_marks"
    assert DynamicGradScaler.__module__ == "tessera.precision.scaler"
    assert HybridZeroOptimizer is tessera.optim.hybrid_zero.HybridZeroOptimizer
    assert all(callable(x) for x in (RMSNorm, build_model, ColumnParallelLinear, RowParallelLinear,
                                     VocabParallelEmbedding, vocab_parallel_cross_entropy))
    assert {"GLOBAL", "DATA", "TENSOR", "ZERO1"} <= set(ParallelMode.__members__)


def test_gpc_reads_the_launched_job():
    """``gpc`` answers InternEvo's getters from the run description that launch built (a single process here)."""
    from tessera.core.context import ParallelMode, gpc, launch_from_torch

    job_model = {"num_layers": 1, "hidden_size": 8, "num_attention_heads": 2, "vocab_size": 16}
    launch_from_torch({"model": {**job_model, "dtype": "bf16"},
                       "parallel": {"tensor": {"size": 1, "mode": "msp"}},
                       "data": {"type": "synthetic", "seq_len": 8}}, seed=3)
    try:
        job = gpc.job
        assert job is not None and job.seed == 3 and job.tensor_mode == "msp"
        assert job.precision.dtype is __import__("torch").bfloat16
        assert gpc.get_world_size(ParallelMode.TENSOR) == job.layout.tp_size == 1
        assert gpc.get_group(ParallelMode.DATA) is job.groups.dp
        from tessera.model import build_model
        from tessera.train.builder import build_training_stack

        # the builder passes the launched job's tensor mode; build_model itself reads nothing launched, so the
        # same call builds the same model launched or not (issue 45: no provider registered at import time)
        assert build_training_stack(gpc.config).inner_model.tensor_mode == "msp"
        assert build_model(dict(job_model)).tensor_mode == "mtp"
    finally:
        gpc.destroy()
    assert gpc.job is None
