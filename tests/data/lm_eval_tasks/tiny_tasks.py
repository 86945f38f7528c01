"""Loader of the local lm-eval test tasks: tiny_facts.jsonl beside this file, read without the hub or a cache."""

from __future__ import annotations

import json
import os
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


def load_facts(**_: Any) -> Any:
    """The 12 facts as a ``datasets.DatasetDict`` with one ``test`` split (lm-eval's ``custom_dataset`` hook)."""
    import datasets

    with open(os.path.join(HERE, "tiny_facts.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
