"""Host <-> device transfers of batches and checkpoints, checked without a GPU.

- Packed batches: the document boundaries are checked and ``max_seqlen`` computed on the host, before
  the copy; the forward on (fake) CUDA tensors then reads nothing back from the device (a guard refuses
  every device->host read) and flash_attn's varlen call gets the host's ``max_seqlen``. A malformed
  batch is refused before any copy, naming the boundary or row.
- Pinned memory: on CUDA, batch tensors are pinned and copied ``non_blocking``; checkpoint tensors are
  copied into pinned buffers, then waited for once per device before writing. Pinning needs a GPU, so
  the pinning calls are recorded by stand-ins; on the CPU nothing is pinned.
- Aliases: tied weights are found on the tensors where they live, before the copy to the host gives
  each its own storage, and stored once.
"""

from __future__ import annotations

import json
import os
import sys
import types

import pytest
import torch
from safetensors import safe_open
from torch.overrides import TorchFunctionMode

from harness.fake_cuda import fake_cuda_mode
from tessera.checkpoint import Layout, TrainState, host_copy, load_checkpoint, save_checkpoint, tree
from tessera.config import Config
from tessera.core.job import Job
from tessera.model import attention, build_model, flash_probe
from tessera.model.attention import check_cu_seqlens
from tessera.train import batch as batch_mod
from tessera.train.batch import to_device
from tessera.train.builder import build_training_stack

CUDA = torch.device("cuda")
MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_attention_heads=2, vocab_size=256,
             mlp_ratio=2.0, multiple_of=16, dtype="torch.float32", use_flash_attn=False)


def _cfg(**model: object) -> Config:
    return Config.from_dict({"model": {**MODEL, **model}, "adam": dict(lr=1e-3), "data": {"type": "synthetic"}})


def _packed_batch(lengths: list[int], rows: int, seq: int) -> dict[str, torch.Tensor]:
    """A host batch as the data loader makes it: ``lengths`` are the documents, in order, filling the rows."""
    assert sum(lengths) == rows * seq
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (rows, seq), generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return {"input_ids": ids, "labels": ids.roll(-1, 1), "cu_seqlens": cu}


class _NoDeviceReads(TorchFunctionMode):
    """Fails on any read of a CUDA tensor's values into Python or host memory (``item``, ``tolist``, ``int``,
    ``bool``, ``.cpu()``, ``.to("cpu")``, ...): each would wait for the GPU."""

    READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__int__, torch.Tensor.__bool__,
             torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        t = args[0] if args else None
        if isinstance(t, torch.Tensor) and t.device.type == "cuda":
            to_host = func is torch.Tensor.to and "cpu" in str(kwargs.get("device", "")) + "".join(map(str, args[1:]))
            if func in self.READS or to_host:
                raise AssertionError(f"device->host read of a {tuple(t.shape)} CUDA tensor: {func.__name__}")
        return func(*args, **kwargs)


@pytest.fixture
def flash_standin(monkeypatch):
    """flash_attn "installed" and chosen: the stand-in records what its varlen call gets."""
    seen: list[dict] = []

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
        seen.append({"cu": cu_q, "max_seqlen_q": max_q, "max_seqlen_k": max_k})
        return torch.zeros_like(q)

    def dense(q, k, v, **kwargs):
        seen.append({"dense": True})
        return torch.zeros_like(q)

    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_func=dense,
                                                                         flash_attn_varlen_func=varlen))
    flash = next(b for b in attention.BACKENDS if b.name == attention.FLASH_ATTN)
    monkeypatch.setattr(attention, "choose_backend", lambda call: (flash, ""))
    monkeypatch.setattr(flash_probe, "_PROBE", None)  # probed again: finds the stand-in above

    def refuse(t):  # the one sanctioned device read of older code paths: refuse it for CUDA tensors too
        raise AssertionError(f"to_host of a {t.device} tensor in the forward")

    monkeypatch.setattr(attention, "to_host", refuse, raising=False)
    return seen


# ------------------------------------------------------------------------------------------ boundaries
def test_boundaries_are_checked_on_the_host_and_name_the_problem():
    assert check_cu_seqlens(torch.tensor([0, 3, 8, 11, 16], dtype=torch.int32), 2, 8) == 5
    assert check_cu_seqlens(torch.tensor([0, 8, 16]), 2, 8) == 8
    cases = [
        ([0, 4, 15], r"start at 0 and end at batch\*seq_len = 2\*8 = 16, got 0 \.\.\. 15"),
        ([1, 8, 16], r"got 1 \.\.\. 16"),
        ([0, 5, 5, 8, 16], r"strictly increasing: cu_seqlens\[2\]=5 <= cu_seqlens\[1\]=5"),
        ([0, 8, 6, 16], r"cu_seqlens\[2\]=6 <= cu_seqlens\[1\]=8"),
        ([0, 6, 16], r"row 1 starts at token 8 \(= 1 x seq_len 8\), which cu_seqlens=\[0, 6, 16\] lacks"),
        ([0, 16], r"between 3 boundaries .* and 17 .*, got 2"),
    ]
    for cu, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            check_cu_seqlens(torch.tensor(cu, dtype=torch.int32), 2, 8)
    with pytest.raises(ValueError, match="1-D integer tensor"):
        check_cu_seqlens(torch.tensor([0.0, 8.0, 16.0]), 2, 8)
    with pytest.raises(ValueError, match=r"row 3 starts at token 24"):  # the first missing row is named
        check_cu_seqlens(torch.tensor([0, 8, 16, 20, 28, 32]), 4, 8)


def test_a_device_cu_seqlens_without_max_seqlen_is_refused_not_read():
    with fake_cuda_mode(), _NoDeviceReads():
        model = build_model(_cfg(use_flash_attn=True).model, seed=1, device=CUDA).eval()
        ids = torch.zeros(2, 8, dtype=torch.long, device=CUDA)
        cu = torch.tensor([0, 3, 8, 16], dtype=torch.int32, device=CUDA)
        with torch.no_grad(), pytest.raises(ValueError, match="is on cuda.*checked and max_seqlen is computed on "
                                                              "the host, before the copy"):
            model(ids, cu_seqlens=cu)


def test_packed_batch_reaches_cuda_attention_without_a_read_back(flash_standin):
    """The trainer's validation path on fake CUDA tensors with flash_attn's varlen kernel: max_seqlen is the
    host's (8, the longest of the documents 5, 3, 8, 8), nothing is read back from the device."""
    cfg = _cfg(dtype="torch.bfloat16", use_flash_attn=True)
    host = _packed_batch([5, 3, 8, 8], rows=3, seq=8)
    with fake_cuda_mode():
        stack = build_training_stack(cfg, Job.of(cfg, device=CUDA))
        with _NoDeviceReads():
            moved = to_device(host, CUDA)
            stack.trainer.model.eval()
            with torch.no_grad():
                stack.trainer._loss(moved, reduction="sum")
        stack.trainer.evaluate([host])  # the whole validation path (its loss read-out is allowed)
    assert moved["max_seqlen"] == 8 and isinstance(moved["max_seqlen"], int)
    assert moved["cu_seqlens"].device.type == "cuda"
    varlen = [c for c in flash_standin if "cu" in c]
    assert len(varlen) == 2 * 2  # 2 layers, 2 forwards
    assert all(c["max_seqlen_q"] == c["max_seqlen_k"] == 8 for c in varlen)
    assert all(c["cu"].device.type == "cuda" and c["cu"].dtype == torch.int32 for c in varlen)


def test_a_malformed_batch_is_refused_before_the_copy(monkeypatch):
    copies: list[torch.device] = []
    real_to = torch.Tensor.to

    def recording_to(self, *args, **kwargs):
        copies.append(args[0] if args else kwargs.get("device"))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", recording_to)
    bad = _packed_batch([5, 3, 8, 8], rows=3, seq=8)
    bad["cu_seqlens"] = torch.tensor([0, 5, 8, 16, 16, 24], dtype=torch.int32)
    with fake_cuda_mode(), pytest.raises(ValueError, match=r"^micro-batch 1: cu_seqlens must be strictly increasing: "
                                                           r"cu_seqlens\[4\]=16 <= cu_seqlens\[3\]=16"):
        to_device(bad, CUDA, "micro-batch 1")
    assert copies == []


def test_the_trainer_names_the_malformed_micro_batch():
    trainer = build_training_stack(_cfg(), Job.of(_cfg())).trainer
    good = _packed_batch([8, 8], rows=2, seq=8)
    bad = {**good, "cu_seqlens": torch.tensor([0, 6, 16], dtype=torch.int32)}
    with pytest.raises(ValueError, match=r"^micro-batch 1: every row boundary must be a document boundary: row 1"):
        trainer.train_step([good, bad])
    with pytest.raises(ValueError, match=r"^validation batch 0: every row boundary"):
        trainer.evaluate([bad])


# ------------------------------------------------------------------------------------------ pinned batches
def test_batches_are_pinned_and_copied_non_blocking_on_cuda_only(monkeypatch):
    pinned: list[tuple[int, ...]] = []
    copies: list[tuple[str, bool]] = []
    real_to = torch.Tensor.to

    def pin(self):
        pinned.append(tuple(self.shape))
        return self  # a CPU-only torch cannot pin; the stand-in records the request

    def recording_to(self, *args, **kwargs):
        copies.append((str(args[0]), kwargs.get("non_blocking", False)))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    monkeypatch.setattr(torch.Tensor, "to", recording_to)
    host = _packed_batch([5, 3, 8, 8], rows=3, seq=8)
    with fake_cuda_mode():
        moved = to_device(host, CUDA)
    assert sorted(pinned) == sorted([(3, 8), (3, 8), (5,)])
    assert copies == [("cuda", True)] * 3
    assert all(moved[k].device.type == "cuda" for k in host) and moved["max_seqlen"] == 8

    pinned.clear()
    copies.clear()
    on_cpu = to_device(host, torch.device("cpu"))
    assert pinned == [] and copies == []  # already there: neither pinned nor copied
    assert all(on_cpu[k] is host[k] for k in host) and on_cpu["max_seqlen"] == 8
    assert batch_mod.host_checks({"input_ids": host["input_ids"]}) == {"input_ids": host["input_ids"]}


# ------------------------------------------------------------------------------------------ checkpoints
def _tied_model(device="cpu", seed=1):
    return build_model(_cfg(tie_word_embeddings=True).model, seed=seed, device=device)


def test_checkpoint_tensors_go_through_pinned_buffers_on_cuda(monkeypatch):
    """Aliases found on the CUDA tensors (the tied weight once), every stored tensor copied into a pinned
    buffer without waiting, one wait for the device after the last copy, host tensors returned."""
    events: list[tuple] = []
    real_copy = torch.Tensor.copy_

    def pinned_buffer(t):
        events.append(("pinned", tuple(t.shape)))
        return torch.empty(t.shape, dtype=t.dtype)  # a CPU-only torch cannot pin: a stand-in buffer

    def recording_copy(self, src, non_blocking=False):
        events.append(("copy", self.device.type, src.device.type, non_blocking))
        return real_copy(self, src, non_blocking=non_blocking)

    monkeypatch.setattr(host_copy, "_pinned_buffer", pinned_buffer)
    monkeypatch.setattr(host_copy, "_wait_for_copies", lambda devices: events.append(("wait", sorted(map(str,
                                                                                                        devices)))))
    monkeypatch.setattr(torch.Tensor, "copy_", recording_copy)
    with fake_cuda_mode():
        model = _tied_model(CUDA)
        state = model.state_dict()
        stored, meta = tree.prepare_tree(state)
    assert json.loads(meta["aliases"]) == {"/output.weight": "/embedding.weight"}
    assert set(stored) == {"/" + k for k in state} - {"/output.weight"}
    assert all(t.device.type == "cpu" for t in stored.values())
    n = len(stored)
    assert [e[0] for e in events] == ["pinned", "copy"] * n + ["wait"]
    assert all(e[1:] == ("cpu", "cuda", True) for e in events if e[0] == "copy")
    assert events[-1] == ("wait", ["cuda:0"])


def test_cpu_checkpoint_tensors_are_not_pinned_or_copied(monkeypatch):
    monkeypatch.setattr(host_copy, "_pinned_buffer", lambda t: pytest.fail("pinned on the CPU"))
    monkeypatch.setattr(host_copy, "_wait_for_copies", lambda d: pytest.fail("waited on the CPU"))
    state = _tied_model().state_dict()
    stored, _ = tree.prepare_tree(state)
    assert all(stored["/" + k].data_ptr() == state[k].data_ptr() for k in state if k != "output.weight")


def test_tied_weights_are_stored_once_when_the_host_copy_gives_new_storages(tmp_path, monkeypatch):
    """A device->host copy gives every tensor a storage of its own (simulated on the CPU by cloning): the tie
    must be found before it. The file holds the tied weight once and the loaded model is tied, with the
    saved values."""
    monkeypatch.setattr(tree, "host_copies", lambda tensors: {k: v.clone() for k, v in tensors.items()})
    model = _tied_model(seed=1)
    layout = Layout(global_rank=0, world_size=1)
    folder = save_checkpoint(str(tmp_path), 1, TrainState(model), config=None, layout=layout)
    with safe_open(os.path.join(folder, "model_tp0.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        aliases = json.loads(f.metadata()["aliases"])
    assert "/embedding.weight" in keys and "/output.weight" not in keys
    assert aliases == {"/output.weight": "/embedding.weight"}
    loaded = _tied_model(seed=2)
    assert not torch.equal(loaded.embedding.weight, model.embedding.weight)
    load_checkpoint(folder, TrainState(loaded), layout=layout)
    assert loaded.output.weight is loaded.embedding.weight
    assert torch.equal(loaded.embedding.weight, model.embedding.weight)
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
