"""Weights & Biases: the scalars ``MetricsWriter`` sends to TensorBoard, mirrored to one W&B run.

Opened by ``MetricsWriter`` on rank 0 when ``metrics.wandb.project`` is set and its mode is not
``disabled``: the resolved config is the run's config (once), and each ``log`` is one history row at the
training step, under the same tags as TensorBoard (``loss``, ``valid/loss``, ``precision/...``).

The run's id is kept in ``<log_folder>/<job_name>/wandb_run_id`` (next to metrics.jsonl and the
TensorBoard events, which a resumed run also continues): a run resumed from a checkpoint (start step > 0)
continues that W&B run (``resume="allow"``); a run from step 0 starts a new one and replaces the file.
W&B's files (and, in ``offline`` mode, the run folders ``wandb sync`` uploads) go under that folder's
``wandb/``. W&B's steps only increase: the rows of steps a crashed run logged after its last checkpoint,
which the resumed run logs again, may be dropped by W&B (metrics.jsonl keeps both). Once the run has started,
one log line says so and where it goes: its page online, its folder (and the ``wandb sync`` command) offline.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import uuid
from collections.abc import Mapping
from typing import Any

from tessera.files import atomic_write_text

__all__ = ["WandbRun", "RUN_ID_FILE", "WandbError", "started_line"]

logger = logging.getLogger("tessera")
RUN_ID_FILE = "wandb_run_id"


class WandbError(RuntimeError):
    """W&B cannot start: the package is missing, or ``wandb.init`` failed (its reason in the message)."""


def wanted(settings: Mapping[str, Any] | None) -> bool:
    """Whether ``metrics.wandb`` asks for a W&B run: a project, and a mode other than ``disabled``."""
    return bool(settings and settings.get("project") and settings.get("mode", "online") != "disabled")


class WandbRun:
    """One W&B run of a training job (rank 0). ``log`` failures do not stop training: the first is logged
    once as a warning and W&B gets nothing more (metrics.jsonl and TensorBoard go on)."""

    def __init__(self, settings: Mapping[str, Any], log_dir: str, job_name: str, start_step: int,
                 run_config: Mapping[str, Any]):
        try:
            wandb: Any = importlib.import_module("wandb")
        except ImportError:
            raise WandbError("metrics.wandb needs the wandb package: pip install 'tessera[wandb]' (or set "
                             "metrics.wandb.project=None)") from None
        self.run_id = _run_id(log_dir, start_step)
        try:
            self._run: Any = wandb.init(
                project=settings["project"], entity=settings.get("entity"), mode=settings.get("mode", "online"),
                name=settings.get("name") or job_name, tags=list(settings.get("tags") or []), id=self.run_id,
                resume="allow", dir=log_dir, config=_plain(run_config),
                settings=wandb.Settings(console="off", silent=True))
        except Exception as e:  # noqa: BLE001 - wandb's own errors: no API key, no network in online mode, ...
            raise WandbError(f"metrics.wandb: wandb.init failed: {type(e).__name__}: {e}") from None
        self.failed = False
        logger.info("%s", started_line(self._run, settings["project"]))

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        """One step's scalars (several calls for one step merge into its row)."""
        if self.failed or not scalars:
            return
        try:
            self._run.log(dict(scalars), step=step)
        except Exception as e:  # noqa: BLE001 - a W&B problem must not stop training: said once
            self.failed = True
            logger.warning("metrics.wandb: W&B stopped receiving metrics at step %d (%s: %s); metrics.jsonl and "
                           "TensorBoard go on", step, type(e).__name__, e)

    def close(self) -> None:
        try:
            self._run.finish()
        except Exception as e:  # noqa: BLE001 - training is over; the files are written
            logger.warning("metrics.wandb: finishing the W&B run failed: %s: %s", type(e).__name__, e)


def started_line(run: Any, project: str) -> str:
    """The line that says W&B is on, for a user who set ``metrics.wandb`` (W&B's own output is silenced): the
    run and its page online; offline, its folder and the command that uploads it (W&B's run object exposes
    ``offline``, ``dir`` (the run folder's ``files/``) and ``url``)."""
    what = f"metrics.wandb: W&B run {run.name} (id {run.id}) of project {project}"
    if getattr(run, "offline", False):
        folder = os.path.dirname(os.path.normpath(run.dir))
        return f"{what}, offline, in {folder}; upload it with: wandb sync {folder}"
    return f"{what}, online: {run.url}"


def _run_id(log_dir: str, start_step: int) -> str:
    """The id of this job's W&B run: the saved one when resuming, else a new one (saved)."""
    path = os.path.join(log_dir, RUN_ID_FILE)
    if start_step > 0 and os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            saved = f.read().strip()
        if saved:
            return saved
    run_id = uuid.uuid4().hex[:12]
    os.makedirs(log_dir, exist_ok=True)
    atomic_write_text(path, run_id + "\n")
    return run_id


def _plain(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config as JSON values (dtypes and other objects by their text), as W&B stores it."""
    plain: dict[str, Any] = json.loads(json.dumps(dict(config), default=str))
    return plain
