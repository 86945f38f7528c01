"""The three phases of ``save_checkpoint`` (tessera/checkpoint/save.py), one process, checked from the files
they leave: planning touches nothing, a fault injected where the commit renames the folder (as
tests/fault_train.py does for the killed-save test) leaves the previous checkpoint the one resumed, and a
failing commit is reported naming the step and the checkpoint that remains."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn

from harness.state import HeldState
from tessera.checkpoint import (
    CheckpointError,
    Layout,
    Progress,
    TrainState,
    find_resumable_checkpoint,
    load_checkpoint,
    read_meta,
    read_tree,
)
from tessera.checkpoint import save as save_mod
from tessera.checkpoint.save import commit_save, plan_save, save_checkpoint, write_shards


def _state(value: float, step: int) -> TrainState:
    model = nn.Linear(4, 3)
    with torch.no_grad():
        model.weight.fill_(value)
        model.bias.fill_(value)
    state = TrainState(model, progress=Progress(step))
    state.register("rng", HeldState({"cpu": torch.arange(5)}), per_rank=True)
    return state


def _leaves(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """``{"/a/b": tensor}`` of a nested dict of tensors."""
    if isinstance(tree, dict):
        return {k: t for key, sub in tree.items() for k, t in _leaves(sub, f"{prefix}/{key}").items()}
    return {prefix: tree}


def test_the_phases_compose_to_save_checkpoint(tmp_path):
    """plan_save touches nothing; write_shards writes the planned files into the hidden partial folder only;
    commit_save publishes exactly what save_checkpoint publishes for the same state."""
    state = _state(1.0, 3)
    plan = plan_save(str(tmp_path / "a"), 3, state, Layout())
    assert not (tmp_path / "a").exists()
    assert [name for name, _ in plan.files] == ["model_tp0.safetensors", "rng_rank0.safetensors"]
    assert plan.planned_bytes == (12 + 3) * 4 + 5 * 8  # the fp32 weight and bias, the int64 RNG stand-in
    entries = write_shards(plan)
    assert sorted(os.listdir(tmp_path / "a")) == [os.path.basename(plan.partial)]
    assert sorted(os.listdir(plan.partial)) == sorted(entries) == sorted(name for name, _ in plan.files)
    final = commit_save(plan, entries, state, config=None)
    assert final == plan.final and sorted(os.listdir(tmp_path / "a")) == ["step_3"]

    whole = save_checkpoint(str(tmp_path / "b"), 3, state, config=None, layout=Layout())
    ours, theirs = read_meta(final), read_meta(whole)
    assert ours["trainer_state"] == theirs["trainer_state"] and ours["layout"] == theirs["layout"]
    # the same files of the same sizes and contents (not bytes: safetensors orders its header metadata freely)
    assert {n: e["size"] for n, e in ours["files"].items()} == {n: e["size"] for n, e in theirs["files"].items()}
    for name in ours["files"]:
        a, b = _leaves(read_tree(os.path.join(final, name))), _leaves(read_tree(os.path.join(whole, name)))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name

def test_a_fault_before_the_rename_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    """The fault tests/fault_train.py injects (``commit_folder`` patched in the save module): every file and
    meta.json of step 2 written, the folder not renamed; resuming takes step 1 and tidies step 2 away."""
    folder = str(tmp_path / "ckpt")
    save_checkpoint(folder, 1, _state(1.0, 1), config=None, layout=Layout())

    class Killed(BaseException):
        pass

    def killed(partial: str, final: str) -> None:
        raise Killed(partial)

    monkeypatch.setattr(save_mod, "commit_folder", killed)
    with pytest.raises(Killed):
        save_checkpoint(folder, 2, _state(2.0, 2), config=None, layout=Layout())
    assert sorted(os.listdir(folder)) == [".step_2.partial", "step_1"]
    assert os.path.isfile(os.path.join(folder, ".step_2.partial", "meta.json"))

    monkeypatch.undo()
    state = _state(0.0, 0)
    path, _ = find_resumable_checkpoint(folder, Layout(), load=lambda p: load_checkpoint(p, state, layout=Layout()))
    assert os.path.basename(path) == "step_1" and state.model.weight[0, 0].item() == 1.0
    assert sorted(os.listdir(folder)) == ["step_1"]


def test_a_failing_commit_names_the_step_and_the_checkpoint_that_remains(tmp_path, monkeypatch):
    folder = str(tmp_path / "ckpt")
    first = save_checkpoint(folder, 1, _state(1.0, 1), config=None, layout=Layout())

    def refuse(partial: str, final: str) -> None:
        raise OSError(28, os.strerror(28), final)  # ENOSPC

    monkeypatch.setattr(save_mod, "commit_folder", refuse)
    with pytest.raises(CheckpointError, match=rf"cannot save step 2 in {folder}: .*No space left on device.*the "
                                              rf"checkpoint needs at least .*last complete checkpoint is {first}$"):
        save_checkpoint(folder, 2, _state(2.0, 2), config=None, layout=Layout())
    assert sorted(os.listdir(folder)) == ["step_1"]  # the partial folder is removed
