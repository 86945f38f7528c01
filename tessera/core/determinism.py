"""``deterministic=True``: the same config on the same machine gives the same losses bit for bit, run after run.

Applied once at launch (``tessera.core.launch.join_job``), before the default process group exists and
before this process's first CUDA work:

- ``torch.use_deterministic_algorithms(True)``: torch takes its deterministic kernels where it has a choice
  and raises a RuntimeError naming the op where it has none, instead of running it; it also fills memory from
  ``torch.empty`` with NaN, so a read of uninitialised memory cannot make two runs differ quietly.
- CUDA: ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (cuBLAS reads it when it makes its first handle, so it is set
  while CUDA is not yet initialised in this process, or it is a ConfigError saying to set it in the
  environment); cuDNN deterministic with benchmarking off (``cudnn_benchmark=True`` is a ConfigError);
  ``NCCL_ALGO=^NVLS`` when NCCL runs a group of several ranks and the variable is unset (NVLink SHARP
  reduces in the switch, in no fixed order; another value than Megatron-Core's deterministic choices is a
  ConfigError); the ``flash_attn`` package is refused (``model.use_flash_attn``: its backward accumulates
  dq with atomic adds; torch's own flash and varlen kernels take their deterministic backward under the
  switch above).
- compiled blocks: ``torch._inductor.config.deterministic`` (no on-device benchmarking that picks kernels
  of different numerics run by run).

What needs no switch, checked in ``tests/test_deterministic.py``: tessera's shared-memory TP route reduces in
rank order; gloo's all-reduce and reduce-scatter on CPU run a fixed schedule, repeatable run after run; the
data order comes from the seed (sampler) and sorted file lists. What it cannot fix is logged once: a CPU
GEMM's summation order depends on the intra-op thread count, so runs compare bitwise only at the same count
(``torch.get_num_threads()``, set by ``OMP_NUM_THREADS``), and on the same torch build and machine kind.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, MutableMapping

import torch

from tessera.config import ConfigError, RunConfig

__all__ = ["CUBLAS_WORKSPACE_CONFIGS", "NCCL_ALGOS", "apply_determinism", "determinism_env"]

logger = logging.getLogger("tessera")

CUBLAS_WORKSPACE_CONFIGS = (":4096:8", ":16:8")  # the values cuBLAS documents as reproducible
# NCCL_ALGO values that leave NVLS (in-switch reduction) out: Megatron-Core's deterministic-mode list
NCCL_ALGOS = ("Tree", "Ring", "CollnetDirect", "CollnetChain", "^NVLS")
NCCL_DEFAULT = "^NVLS"


def determinism_env(cfg: RunConfig, environ: Mapping[str, str], *, cuda: bool, cuda_initialized: bool,
                    nccl_group: bool, group_exists: bool) -> dict[str, str]:
    """The environment variables ``deterministic=True`` must set here; ConfigError for what it cannot make
    deterministic. A pure function of its arguments (tests pass CUDA states this machine lacks).

    ``cuda``: this process will use CUDA; ``cuda_initialized``: CUDA already is (cuBLAS may have read its
    workspace setting); ``nccl_group``: NCCL will reduce over more than one rank; ``group_exists``: the
    default process group was made before launch (NCCL may have read its environment).
    """
    if not cfg.deterministic:
        return {}
    src = f" (in {cfg.source})" if cfg.source else ""
    if cfg.cudnn_benchmark:
        raise ConfigError(f"cudnn_benchmark=True contradicts deterministic=True: cuDNN's benchmark picks kernels "
                          f"by timing, so two runs can run different ones; set cudnn_benchmark=False{src}")
    out: dict[str, str] = {}
    if cuda:
        have = environ.get("CUBLAS_WORKSPACE_CONFIG")
        if have is None and cuda_initialized:
            raise ConfigError(f"deterministic=True: CUDA was initialised in this process before launch, so cuBLAS "
                              f"may have read its workspace setting already; set CUBLAS_WORKSPACE_CONFIG=:4096:8 in "
                              f"the environment before starting Python{src}")
        if have is not None and have not in CUBLAS_WORKSPACE_CONFIGS:
            raise ConfigError(f"deterministic=True: CUBLAS_WORKSPACE_CONFIG={have!r} is not one of cuBLAS's "
                              f"reproducible settings {list(CUBLAS_WORKSPACE_CONFIGS)}; unset it or set :4096:8{src}")
        if have is None:
            out["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE_CONFIGS[0]
        if cfg.model.use_flash_attn and _flash_attn_installed():
            raise ConfigError(f"model.use_flash_attn=True with deterministic=True: the flash_attn package's backward "
                              f"adds into dq atomically, in no fixed order; set model.use_flash_attn=False (torch's "
                              f"flash and varlen kernels run deterministically){src}")
    if nccl_group:
        algo = environ.get("NCCL_ALGO")
        if algo is None and group_exists:
            raise ConfigError(f"deterministic=True: the NCCL process group was made before launch without "
                              f"NCCL_ALGO; set NCCL_ALGO={NCCL_DEFAULT} in the environment{src}")
        if algo is not None and algo not in NCCL_ALGOS:
            raise ConfigError(f"deterministic=True: NCCL_ALGO={algo!r} may select NVLS, whose in-switch reductions "
                              f"have no fixed order; use one of {list(NCCL_ALGOS)} or leave it unset{src}")
        if algo is None:
            out["NCCL_ALGO"] = NCCL_DEFAULT
    return out


def _flash_attn_installed() -> bool:
    from tessera.model import flash_probe

    return flash_probe.load_flash_attn()[0] is not None


def apply_determinism(cfg: RunConfig, backend: str, world_size: int,
                      environ: MutableMapping[str, str] | None = None) -> None:
    """Set every switch of ``deterministic`` (both ways: a second launch in one process starts clean), and with
    it on, log once what it set and what it cannot hold. Call before the default group and before CUDA work."""
    environ = os.environ if environ is None else environ
    import torch.distributed as dist

    cuda = backend == "nccl" or torch.cuda.is_available()
    env = determinism_env(cfg, environ, cuda=cuda, cuda_initialized=torch.cuda.is_initialized(),
                          nccl_group=backend == "nccl" and world_size > 1, group_exists=dist.is_initialized())
    environ.update(env)
    on = cfg.deterministic
    torch.use_deterministic_algorithms(on)
    if on or "torch._inductor.config" in sys.modules:  # importing it costs seconds: only when it matters
        import torch._inductor.config as inductor_config

        inductor_config.deterministic = on
    if not on:
        return
    where = ", ".join(f"{k}={v}" for k, v in env.items()) or "nothing in the environment"
    logger.info("deterministic=True: torch.use_deterministic_algorithms on, cuDNN deterministic without "
                "benchmarking, inductor deterministic; set %s. Bitwise repeatable for this config on this machine "
                "kind with %d intra-op threads (OMP_NUM_THREADS: a CPU GEMM's summation order depends on the count) "
                "and torch %s", where, torch.get_num_threads(), torch.__version__)
