"""Weights & Biases (``metrics.wandb``): the scalars that go to TensorBoard go to W&B under the same tags, once a
step, with the resolved config; a resumed run continues the same W&B run; a missing package is one line.

The reference readers are independent of tessera: W&B's offline run file (``run-<id>.wandb``) is read here
from its documented layout (a LevelDB-style log: a 7-byte header ``:W&B`` + magic 0xBEE1 + version 0, then
32 KiB blocks of records, each a crc32 / length / type header and a ``wandb_internal_pb2.Record`` protobuf,
split over blocks as FIRST/MIDDLE/LAST). wandb 0.31 ships no Python reader of it (the ``datastore`` module
left with the Go core) and ``wandb sync`` has no view option. TensorBoard's events are read with
TensorBoard's own ``EventAccumulator``, metrics.jsonl with ``json``.
"""

from __future__ import annotations

import glob
import json
import math
import os
import struct
import sys
import time

import pytest

from harness.distributed import run_torchrun
from harness.failure import explain
from tessera.train.metrics import MetricsWriter
from tessera.train.wandb_log import RUN_ID_FILE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_BLOCK, _FULL, _FIRST, _LAST = 32768, 1, 2, 4


def _records(path: str):
    """The protobuf payloads of a W&B run file, in order."""
    with open(path, "rb") as f:
        data = f.read()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (path, ident, magic, version)
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # the zero padding at the end of a block
            pos += left
            continue
        if pos + 7 + length > len(data):  # still being written
            return
        payload = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        parts = payload if kind in (_FULL, _FIRST) else parts + payload
        if kind in (_FULL, _LAST):
            yield parts


def read_run(path: str) -> dict:
    """A W&B run file: its id, project, name, tags, config and history rows ``{step: {key: value}}``."""
    pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")
    out: dict = {"history": {}, "complete": False}
    for raw in _records(path):
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        out["complete"] |= kind == "exit"
        if kind == "run":
            r = record.run
            out.update(id=r.run_id, project=r.project, name=r.display_name, tags=list(r.tags),
                       config={u.key: json.loads(u.value_json) for u in r.config.update if u.key != "_wandb"})
        elif kind == "history":
            row = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
            step = row.pop("_step")
            out["history"].setdefault(step, {}).update({k: v for k, v in row.items() if not k.startswith("_")})
    return out


def offline_runs(log_dir: str, wait_s: float = 60.0) -> list[dict]:
    """Every offline run folder W&B wrote under ``log_dir/wandb``, oldest first. W&B's service process may still
    be writing a run file when ``finish()`` has returned: each is read once it holds its closing ``exit`` record."""
    runs = []
    for path in sorted(glob.glob(os.path.join(log_dir, "wandb", "offline-run-*", "run-*.wandb"))):
        deadline = time.monotonic() + wait_s
        while not (run := read_run(path))["complete"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert run["complete"], f"{path}: no exit record after {wait_s} s"
        runs.append(run)
    return runs


def tensorboard_scalars(folder: str) -> dict:
    """``{step: {tag: value}}`` of a TensorBoard events folder, read by TensorBoard itself."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(folder, size_guidance={"scalars": 0})
    acc.Reload()
    out: dict = {}
    for tag in acc.Tags()["scalars"]:
        for e in acc.Scalars(tag):
            out.setdefault(e.step, {})[tag] = e.value
    return out


def _next_second() -> None:
    """Wait for the next wall-clock second: W&B names an offline run folder by its start second and run id, so
    two launches of one run within a second would share a folder (real launches are minutes apart)."""
    time.sleep(1.0 - time.time() % 1.0 + 0.01)


TRAIN = dict(loss=2.5, lr=1e-3, grad_norm=0.75, loss_scale=1.0, skipped_steps=0, tgs=1000.0, tflops=0.1, mfu=0.01,
             step_time=0.5, consumed_tokens=64, peak_mem_gib=0.25, finite=True, note="text")
SETTINGS = dict(project="tessera-test", entity=None, mode="offline", name=None, tags=["ci", "cpu"])


def _writer(log_dir, start_step, settings=SETTINGS):
    return MetricsWriter(str(log_dir), True, 10, start_step, tensorboard=True, progress_bar=False, wandb=settings,
                         run_config={"model": {"dtype": "torch.float32", "num_layers": 2}, "seed": 7})


def test_the_tensorboard_scalars_go_to_wandb_once_a_step_with_the_config(tmp_path):
    pytest.importorskip("wandb")
    log_dir = tmp_path / "job"
    w = _writer(log_dir, 0)
    assert w.problem is None, w.problem
    for step in (1, 2, 3):  # in train.py's order: a step's train line, then its precision record or validation
        w.log_train(step, dict(TRAIN, loss=3.0 / step, consumed_tokens=64 * step), line=False)
        if step == 2:
            w.log_valid(2, {"loss": 2.25, "tokens": 128})
    w.log_precision(3, {"loss_scale": 1024.0, "skipped_steps": 1,
                        "measures": {"grad_underflow": {"layers.0": 0.125, "output": 0.0}}})
    w.close()
    (run,) = offline_runs(str(log_dir))
    assert run["id"] == (log_dir / RUN_ID_FILE).read_text().strip()
    assert (run["project"], run["name"], run["tags"]) == ("tessera-test", "job", ["ci", "cpu"])
    assert run["config"] == {"model": {"dtype": "torch.float32", "num_layers": 2}, "seed": 7}
    tb = tensorboard_scalars(str(log_dir / "tensorboard"))
    assert sorted(run["history"]) == sorted(tb) == [1, 2, 3]
    for step, row in run["history"].items():
        assert set(row) == set(tb[step]), step  # the same tags: valid/..., precision/..., no text or bools
        for tag, v in row.items():  # TensorBoard stores float32: equal within its rounding
            assert math.isclose(v, tb[step][tag], rel_tol=2**-23), (step, tag)
    with open(log_dir / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    losses = {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}
    assert {s: row["loss"] for s, row in run["history"].items()} == losses  # exactly: W&B keeps float64
    assert run["history"][2]["valid/loss"] == 2.25 and run["history"][3]["precision/grad_underflow/layers.0"] == 0.125


def test_a_resumed_run_continues_the_same_wandb_run_and_a_fresh_one_starts_another(tmp_path):
    pytest.importorskip("wandb")
    log_dir = tmp_path / "job"
    for start, steps in ((0, (1, 2)), (2, (3, 4))):
        _next_second()
        w = _writer(log_dir, start)
        for step in steps:
            w.log_train(step, dict(TRAIN, loss=1.0 / step), line=False)
        w.close()
    first, resumed = offline_runs(str(log_dir))
    assert first["id"] == resumed["id"]  # `wandb sync` of both folders appends to one run
    assert sorted(first["history"]) == [1, 2] and sorted(resumed["history"]) == [3, 4]
    _next_second()
    w = _writer(log_dir, 0)  # a run from step 0 in the same folder is a new W&B run
    w.close()
    new_id = (log_dir / RUN_ID_FILE).read_text().strip()
    assert new_id != first["id"] and new_id in [r["id"] for r in offline_runs(str(log_dir))]


class _FakeRun:
    """What wandb.init returns, as far as the start line reads it (wandb 0.31's attributes)."""

    def __init__(self, offline: bool, log_dir: str, run_id: str, name: str):
        self.offline, self.id, self.name = offline, run_id, name
        self.dir = os.path.join(log_dir, "wandb", f"offline-run-20261129_000000-{run_id}", "files")
        self.url = None if offline else f"https://wandb.example/team/tessera-test/runs/{run_id}"

    def log(self, *a, **k):
        pass

    def finish(self):
        pass


def _fake_wandb(monkeypatch):
    import types

    module = types.ModuleType("wandb")
    module.Settings = dict
    module.init = lambda **kw: _FakeRun(kw["mode"] == "offline", kw["dir"], kw["id"], kw["name"])
    monkeypatch.setitem(sys.modules, "wandb", module)


def test_one_line_says_wandb_is_on_and_where_the_run_goes(tmp_path, monkeypatch, caplog):
    """W&B's own output is silenced, so tessera says it: online, the run's page; offline, its folder and the
    command that uploads it. (W&B itself stands in here; the real offline folder is checked below.)"""
    _fake_wandb(monkeypatch)
    caplog.set_level("INFO", logger="tessera")
    for mode in ("offline", "online"):
        caplog.clear()
        w = _writer(tmp_path / mode, 0, dict(SETTINGS, mode=mode))
        run_id = (tmp_path / mode / RUN_ID_FILE).read_text().strip()
        w.close()
        lines = [r.getMessage() for r in caplog.records if "metrics.wandb" in r.getMessage()]
        head = f"metrics.wandb: W&B run {mode} (id {run_id}) of project tessera-test"
        folder = tmp_path / mode / "wandb" / f"offline-run-20261129_000000-{run_id}"
        assert lines == [f"{head}, offline, in {folder}; upload it with: wandb sync {folder}" if mode == "offline"
                         else f"{head}, online: https://wandb.example/team/tessera-test/runs/{run_id}"]


def test_the_offline_line_names_the_folder_wandb_wrote(tmp_path, caplog):
    pytest.importorskip("wandb")
    caplog.set_level("INFO", logger="tessera")
    w = _writer(tmp_path / "job", 0)
    w.close()
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("metrics.wandb: W&B run")]
    folder = line.rsplit("wandb sync ", 1)[1]
    run_id = (tmp_path / "job" / RUN_ID_FILE).read_text().strip()
    assert os.path.dirname(folder) == str(tmp_path / "job" / "wandb") and os.path.isdir(folder)
    assert glob.glob(os.path.join(folder, f"run-{run_id}.wandb")), os.listdir(folder)


def test_without_the_package_one_problem_naming_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    w = _writer(tmp_path / "job", 0)
    assert w.problem is not None and "metrics.wandb" in w.problem and "tessera[wandb]" in w.problem, w.problem
    w.close()
    # disabled, or no project: W&B is never imported
    for settings in (dict(SETTINGS, mode="disabled"), dict(SETTINGS, project=None)):
        w = _writer(tmp_path / "other", 0, settings)
        assert w.problem is None
        w.close()


@pytest.mark.slow  # two torchrun launches (~40 s on 2 cores); the writer's tests above keep the promise quickly
def test_train_py_offline_history_matches_metrics_jsonl_across_a_resume(tmp_path):
    """train.py at DP=2 with metrics.wandb offline: 2 steps, then resumed from the step-2 checkpoint to 4. Rank 0
    alone writes W&B; both offline folders hold the run id of log_folder/job_name/wandb_run_id, and their
    history's losses are metrics.jsonl's."""
    pytest.importorskip("wandb")
    common = ["data.type='synthetic'", "metrics.progress_bar=False", "data.seq_len=32", "data.micro_bsz=1",
              "ckpt.enable_save_ckpt=True", "ckpt.checkpoint_every=1", "generate.max_new_tokens=0",
              "lr_scheduler.total_steps=4", "metrics.wandb.project='tessera-test'", "metrics.wandb.mode='offline'",
              "metrics.wandb.tags=['ci']",
              f"log_folder='{tmp_path}/logs'", f"ckpt.save_ckpt_folder='{tmp_path}/ckpt'", "job_name='wb'"]
    for steps in (2, 4):
        proc = run_torchrun([os.path.join(ROOT, "train.py"), "--config", os.path.join(ROOT, "configs", "tiny.py"),
                             *common, f"data.total_steps={steps}"], nproc_per_node=2, timeout=300, cwd=str(tmp_path),
                            env={**os.environ, "WANDB_SILENT": "true"})
        assert proc.returncode == 0, explain(proc)
    log_dir = tmp_path / "logs" / "wb"
    runs = offline_runs(str(log_dir))
    assert len(runs) == 2 and runs[0]["id"] == runs[1]["id"] == (log_dir / RUN_ID_FILE).read_text().strip()
    assert runs[0]["config"]["data"]["total_steps"] == 2 and runs[1]["config"]["data"]["total_steps"] == 4
    with open(log_dir / "metrics.jsonl") as f:
        losses = {r["step"]: r["loss"] for r in map(json.loads, f) if r["kind"] == "train"}
    history = {**runs[0]["history"], **runs[1]["history"]}
    assert sorted(runs[0]["history"]) == [1, 2] and sorted(runs[1]["history"]) == [3, 4]
    assert {s: row["loss"] for s, row in history.items()} == losses and sorted(losses) == [1, 2, 3, 4]
