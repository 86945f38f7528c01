"""The MFU denominator: datasheet rows matched on the exact device name, and the matmul probe used for
every device the table does not list (a CPU, an unlisted GPU).

References are the vendor datasheets' dense figures (half the "with sparsity" figures NVIDIA lists):
H100 SXM 1,979 TFLOP/s bf16 with sparsity, H100 NVL 1,671, H100 PCIe 1,513.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from tessera.config import Config
from tessera.core.job import Job
from tessera.plan.report import gpu_for_device_name, gpu_spec
from tessera.train import metrics
from tessera.train.metrics import gpu_peak_tflops, measure_matmul_tflops, probe_shape

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.py")


def _train_module():
    spec = importlib.util.spec_from_file_location("train_script", os.path.join(ROOT, "train.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name,bf16", [
    ("NVIDIA H100 80GB HBM3", 1979 / 2),  # the SXM5 part
    ("NVIDIA H100 NVL", 1671 / 2),
    ("NVIDIA H100 PCIe", 1513 / 2),
])
def test_each_h100_variant_gets_its_own_row(name, bf16):
    assert gpu_peak_tflops(name, "bfloat16") == pytest.approx(bf16, abs=1.0)


@pytest.mark.parametrize("name", ["NVIDIA H100", "H100", "NVIDIA H100 80GB HBM3 MIG 1g.10gb", "NVIDIA A100-SXM4"])
def test_a_name_that_is_not_a_row_has_no_peak(name):
    assert gpu_peak_tflops(name, "bfloat16") is None


def test_a_gpu_without_bf16_units_has_no_bf16_peak():
    assert gpu_peak_tflops("Tesla V100-SXM2-32GB", "bfloat16") is None
    assert gpu_peak_tflops("Tesla V100-SXM2-32GB", "float16") == 125.0


def test_the_planner_maps_device_names_exactly():
    assert gpu_for_device_name("NVIDIA H100 NVL") == "h100-nvl"
    assert gpu_for_device_name("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_for_device_name("NVIDIA H100 PCIe") == "h100-pcie"
    assert gpu_for_device_name("NVIDIA H100 SXM5 64GB") is None
    assert gpu_spec("h100-nvl", "bfloat16")[1] == pytest.approx(1671 / 2, abs=1.0)


def test_train_py_takes_the_exact_row_or_measures_the_device(monkeypatch):
    """On CUDA, train.py's denominator is the row of the device's exact name; an unlisted name is measured
    on the device in the run's dtype (never another variant's row)."""
    train = _train_module()
    cfg = Config.from_file(TINY, ["model.dtype=bf16"])
    measured = []
    monkeypatch.setattr(train, "measure_matmul_tflops", lambda dtype, device: measured.append((dtype, device)) or 1.5)
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 NVL")
    job = Job.of(cfg, device=cuda)  # the run description train.py builds at launch: bf16 on this device
    peak, source = train.peak_tflops_per_device(cfg, job)
    assert (peak, source, measured) == (pytest.approx(835, abs=1.0), "NVIDIA H100 NVL", [])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 SXM5 64GB")
    peak, source = train.peak_tflops_per_device(cfg, job)
    assert peak == 1.5 and measured == [(torch.bfloat16, cuda)] and "measured" in source


def test_the_probe_times_many_matmuls_per_synchronize(monkeypatch):
    """Warm-up matmuls, then windows of ``iterations`` matmuls each closed by one synchronize, repeated
    for ``seconds`` (three windows at least); the best window's rate is the peak."""
    events: list[str] = []
    monkeypatch.setattr(metrics, "linear", lambda a, b: events.append("mm"))
    monkeypatch.setattr(metrics, "_synchronize", lambda device: events.append("sync"))
    # the deadline; (start, end) of windows of 2 s, 1 s and 4 s; past the deadline
    ticks = iter([0.0, 0.0, 2.0, 2.0, 3.0, 3.0, 7.0, 8.0])
    peak = measure_matmul_tflops(torch.float32, torch.device("cpu"), size=64, seconds=0.0, iterations=7, warmup=2,
                                 timer=lambda: next(ticks))
    runs = "".join("m" if e == "mm" else "|" for e in events).split("|")[:-1]
    assert runs == ["mm", "mmmmmmm", "mmmmmmm", "mmmmmmm"]  # warm-up, then three windows of 7
    assert peak == pytest.approx(2 * 64**3 * 7 / 1.0 / 1e12)  # the fastest window: 7 matmuls in 1 s


def test_the_probe_sizes_a_gpu_for_its_tensor_cores():
    size, per_sync = probe_shape("cuda")
    assert size >= 8192 and per_sync >= 10
    assert probe_shape("cpu")[0] <= 1024  # a CPU reaches its dense rate on small matmuls


def test_the_cpu_probe_measures_a_positive_rate():
    assert measure_matmul_tflops(torch.float32, torch.device("cpu"), size=128, seconds=0.0) > 0
