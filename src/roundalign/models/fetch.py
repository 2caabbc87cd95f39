"""Fetching on the submit host: hub model snapshots and the math dataset, so compute nodes (often without
network) only read local files. Both write atomically: a temporary sibling renamed into place."""

from __future__ import annotations

import json
from pathlib import Path

from huggingface_hub import snapshot_download

from roundalign.io import atomic_dir, atomic_write_text
from roundalign.tasks.math import load_math_dataset


def fetch_model(hub_id: str, out_dir: str | Path, revision: str = "main", log=print) -> Path:
    """Download a model snapshot (weights, config, tokenizer) into ``out_dir``."""
    out_dir = Path(out_dir)
    log(f"[fetch-model] {hub_id}@{revision} -> {out_dir}")
    with atomic_dir(out_dir) as tmp:
        try:
            snapshot_download(repo_id=hub_id, revision=revision, local_dir=tmp)
        except Exception as exc:  # network, auth, unknown id: one clear message
            why = " ".join(str(exc).split()).rstrip(".")  # huggingface_hub's message ends in a full stop of its own
            raise RuntimeError(f"could not download {hub_id}@{revision} from the Hugging Face hub: {why}. "
                               "Run this rule on a host with network access (it is a localrule).") from None
        if not (tmp / "config.json").is_file():
            raise RuntimeError(f"{hub_id}@{revision} has no config.json: not a transformers model")
    return out_dir


def prepare_math_data(dataset: str, split: str, out_file: str | Path, log=print) -> Path:
    """Write a hub math dataset as JSONL with ``problem`` and ``answer`` (the gold answer) per line."""
    ds = load_math_dataset(dataset, split=split, log=log)  # rows without a gold answer: skipped, counted
    lines = [json.dumps({"problem": row["prompt"][-1]["content"], "answer": row["answer"]}) for row in ds]
    atomic_write_text(out_file, "\n".join(lines) + "\n")
    log(f"[prepare-data] {dataset} ({split}): {len(lines)} problems -> {out_file}")
    return Path(out_file)
