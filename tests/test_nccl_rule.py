"""NCCL's device rule, checked on a CPU-only machine.

NCCL refuses CPU tensors (``No backend type associated with device type cpu``); gloo accepts anything,
so a gloo-only test suite cannot catch a CPU-tensor collective. Here the default group is torch's fake
backend registered for CUDA only (``cuda:fake``): it rejects CPU tensors exactly as NCCL does, and
under ``FakeTensorMode`` tensors created with ``device="cuda"`` exist without a GPU. Every collective
of a training step — the stop agreement, the checkpoint agreement, the trainer's token/loss sums, the
optimizer's DP reduce / overflow agreement / grad-norm / ZeRO gather, the TP layers and the parallel
loss, the validation sums — then runs on this group, so one CPU tensor anywhere fails the test.

Rank 0 of a 4-rank job (TP=2 x DP=2, ZeRO over DP) is simulated; the fake backend answers for the
others. Values are meaningless (fake tensors have none); only devices and shapes are checked.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from harness.distributed import fake_process_group
from harness.fake_cuda import fake_cuda_mode
from tessera.checkpoint import Layout, find_resumable_checkpoint
from tessera.config import Config
from tessera.core.job import Job, JobGroups
from tessera.parallel.coordination import all_agree, collective_device, reduce_scalars
from tessera.train.builder import build_training_stack
from tessera.train.stop import StopRequest

CUDA = torch.device("cuda")
MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_attention_heads=2, vocab_size=256,
             mlp_ratio=2.0, multiple_of=16, dtype="torch.bfloat16", use_flash_attn=False)
CFG = dict(model=MODEL, adam=dict(lr=1e-3, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, weight_decay=0.01),
           grad_scaler=None, hybrid_zero_optimizer=dict(clip_grad_norm=1.0))


@pytest.fixture
def cuda_only_job():
    """A 4-rank job seen from rank 0 whose groups accept CUDA tensors only; returns (tp, dp) groups."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with fake_process_group("cuda:fake", 4):
        yield dist.new_group([0, 1]), dist.new_group([0, 2])


def _batch(rows: int = 2, seq: int = 16) -> dict[str, torch.Tensor]:
    """A host batch as the data loader makes it (real CPU tensors, moved to the device by the trainer)."""
    ids = torch.randint(0, 256, (rows, seq))
    cu = torch.arange(0, rows * seq + 1, seq // 2, dtype=torch.int32)  # two documents per row
    return {"input_ids": ids, "labels": ids.roll(-1, 1), "cu_seqlens": cu, "num_bytes": torch.tensor(rows * seq)}


def test_the_guard_rejects_cpu_tensors_like_nccl(cuda_only_job):
    """The test's premise: a CPU-tensor collective on this job raises NCCL's error, a CUDA one passes."""
    tp, _ = cuda_only_job
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        dist.all_reduce(torch.ones(1), group=tp)
    with fake_cuda_mode():
        dist.all_reduce(torch.ones(1, device=CUDA), group=tp)
    assert collective_device(tp).type == "cuda" and collective_device(None).type == "cuda"


def test_host_agreements_use_the_device_the_group_serves(cuda_only_job, tmp_path):
    """Stop and checkpoint agreement (the two that crashed the first GPU step) pass on a CUDA-only group."""
    with fake_cuda_mode():
        assert StopRequest().should_stop() == (False, None)
        assert all_agree(True)
        assert reduce_scalars([1.0, 2.0], None) == [1.0, 2.0]  # a fake reduction returns the local values
        (tmp_path / "step_3").mkdir()
        (tmp_path / "step_3" / "meta.json").write_text("{}")
        path, result = find_resumable_checkpoint(str(tmp_path), Layout(0, 4, 0, 2, 0, 2, 2), load=lambda p: "ok")
        assert path == os.path.join(str(tmp_path), "step_3") and result == "ok"


@pytest.mark.parametrize("dtype", ["torch.bfloat16", "torch.float32"])
def test_optimizer_step_and_validation_on_a_cuda_only_group(cuda_only_job, dtype):
    """The optimizer step (DP reduce of the main grads, overflow agreement, global norm over TP, clipping,
    ZeRO all-gather) and validation (forward with TP collectives, vocab-parallel loss, sums over DP) on
    fake CUDA tensors: no collective sees a CPU tensor.

    A CPU-only torch cannot record autograd graphs of fake CUDA tensors (the autograd engine needs a
    CUDA device guard), so the backward pass itself is not part of this check; its collectives are the
    TP layers' gradient all-reduces, which take the gradients' own device.
    """
    tp, dp = cuda_only_job
    cfg = Config.from_dict({"model": {**MODEL, "dtype": dtype, "fp32_modules": ["norm"]},
                            "parallel": {"tensor": {"size": 2}}, "adam": CFG["adam"],
                            "hybrid_zero_optimizer": CFG["hybrid_zero_optimizer"], "data": {"type": "synthetic"}})
    batch = _batch()  # on the host, with values: its boundaries are checked there, before the copy
    with fake_cuda_mode():
        stack = build_training_stack(cfg, Job.of(cfg, JobGroups(tp=tp, dp=dp, zero1=dp, world=dist.group.WORLD), device=CUDA))
        model, optimizer, trainer = stack.model, stack.optimizer, stack.trainer
        success, _ = optimizer.step()
        assert success and optimizer.num_steps == 1
        assert all(p.device.type == "cuda" for p in model.parameters())
        out = trainer.evaluate([batch])  # fake tensors have no values: only that it ran matters
        assert {"loss", "tokens", "bits_per_token"} <= set(out)


def test_memory_check_agreement_on_a_cuda_only_group(cuda_only_job, monkeypatch):
    """The pre-launch memory verdict is agreed over the default group on the device it serves."""
    from tessera.config import Config
    from tessera.train import memory_check

    monkeypatch.setattr(memory_check, "available_bytes", lambda device: (float(2**50), "test"))
    cfg = Config.from_dict({"model": MODEL, "parallel": {"tensor": {"size": 2}},
                            "data": {"type": "synthetic", "seq_len": 16, "micro_bsz": 1, "total_steps": 1}})
    with fake_cuda_mode():
        job = Job.of(cfg, layout=Layout.of(4, 2, 2, dist.get_rank()), device=CUDA)
        assert memory_check.check_memory(cfg, job) is None


def test_precision_telemetry_on_a_cuda_only_group(cuda_only_job):
    """A measured step of the precision telemetry (metrics.precision_every): its counters, the output hooks,
    the optimizer's observer and its one all-gather over the job all stay on the device the group serves."""
    tp, dp = cuda_only_job
    cfg = Config.from_dict({"model": {**MODEL, "fp32_modules": ["norm"]}, "parallel": {"tensor": {"size": 2}},
                            "adam": CFG["adam"], "hybrid_zero_optimizer": CFG["hybrid_zero_optimizer"],
                            "data": {"type": "synthetic"}, "metrics": {"precision_every": 1}})
    with fake_cuda_mode():
        stack = build_training_stack(cfg, Job.of(cfg, JobGroups(tp=tp, dp=dp, zero1=dp, world=dist.group.WORLD), device=CUDA))
        telemetry = stack.trainer.telemetry
        telemetry.begin()
        with torch.no_grad():  # the output hooks fire (no autograd on fake CUDA tensors, see above)
            stack.model(torch.randint(0, 256, (2, 16), device=CUDA))
        success, _ = stack.optimizer.step()
        telemetry.detach()
        record = telemetry.finish()  # fake values read as zeros: only devices and the structure matter
    assert success and set(record["elements"]) >= {"embedding", "layers.0.attention.wq", "norm", "output"}
    assert "update_rms_ratio" not in record["measures"] and "act_amax_ratio" in record["measures"]
