"""The one checkpoint stack, used by training, conversion, Hugging Face export/import and inference.

    errors.py          CheckpointError
    tree.py            nested state <-> one safetensors file (JSON skeleton, tied tensors stored once)
    meta.py            step-folder file names, meta.json: build, write last, read, verify
    folders.py         step folders: discovery, atomic publishing, tidying up interrupted saves
    lock.py            one writer per save folder: an advisory flock held while writing
    reshard.py         which tensor is TP-sharded along which dim; the one resharding routine
    state.py           TrainState: the resumable components of a run, registered once
    agreement.py       the cross-rank agreements: every rank learns every rank's failure before a collective
    save.py            save_checkpoint: plan_save, write_shards, commit_save (atomic), every rank agreeing
    training.py        load (resharded) / auto-resume with every rank agreeing
    source.py          offline reader: any TP layout in, one full tensor at a time out
    safetensors_io.py  streaming safetensors reader and writer
    convert.py         offline TP x DP conversion and consolidation into one file
    hf.py              Hugging Face Llama export and import
    inference.py       any checkpoint into one process for inference

The file primitives (sha256 of a file, fsync, atomic file write, atomic folder commit) live in
``tessera.files``, shared with the data layer.
"""

from tessera.checkpoint.convert import consolidate, convert_checkpoint, load_consolidated_state
from tessera.checkpoint.errors import CheckpointError
from tessera.checkpoint.folders import (
    clean_partial_checkpoints,
    list_checkpoints,
    new_step_folder,
    output_step_folder,
    resolve_step_folder,
    step_folder,
    step_of,
)
from tessera.checkpoint.hf import export_hf, import_hf, parse_dtype_name
from tessera.checkpoint.inference import load_for_inference
from tessera.checkpoint.lock import LOCK_FILE, folder_lock, hold_folder, lock_holder
from tessera.checkpoint.meta import (
    CHECKPOINT_FORMAT,
    file_entry,
    new_meta,
    read_meta,
    shard_files,
    verify_files,
    write_meta,
)
from tessera.checkpoint.reshard import ParamLayout, param_layout, reshard
from tessera.checkpoint.save import save_checkpoint
from tessera.checkpoint.source import CheckpointSource
from tessera.checkpoint.state import Progress, RngStreams, Stateful, TrainState
from tessera.checkpoint.training import find_resumable_checkpoint, load_checkpoint
from tessera.checkpoint.tree import read_tree, write_tree
from tessera.core.layout import Layout  # the rank layout, re-exported: checkpoint code takes it
from tessera.data.run_tokenizer import tokenizer_for_checkpoint  # re-exported
from tessera.data.tokenizer import byte_tokenizer_json  # re-exported

__all__ = [
    "CHECKPOINT_FORMAT", "CheckpointError", "CheckpointSource", "LOCK_FILE", "Layout", "ParamLayout", "Progress",
    "RngStreams", "Stateful", "TrainState", "byte_tokenizer_json", "clean_partial_checkpoints", "consolidate",
    "convert_checkpoint", "export_hf", "file_entry", "find_resumable_checkpoint", "folder_lock", "hold_folder",
    "import_hf", "list_checkpoints", "load_checkpoint", "load_consolidated_state", "load_for_inference",
    "lock_holder", "new_meta", "new_step_folder", "output_step_folder", "param_layout", "parse_dtype_name",
    "read_meta", "read_tree", "reshard", "resolve_step_folder", "save_checkpoint", "shard_files", "step_folder",
    "step_of", "tokenizer_for_checkpoint", "verify_files", "write_meta", "write_tree",
]
