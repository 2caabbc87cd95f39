"""Library versions, git commit and device of a run, for run records and result tables."""

from __future__ import annotations

import platform
import subprocess
from importlib import metadata
from pathlib import Path

_PACKAGES = ("torch", "transformers", "trl", "accelerate", "vllm")


# What the pipeline writes: committed, so a sweep re-run overwrites tracked files there, which says nothing about the
# code that computed them (a results regeneration must not record its own outputs as "+dirty" code).
OUTPUT_DIRS = ("results", "figures")


def git_sha(repo: str | Path | None = None) -> str:
    """Commit of the checkout the package runs from (``unknown`` outside git), ``+dirty`` if a tracked file outside
    the pipeline's output folders (``OUTPUT_DIRS``) is modified."""
    cwd = Path(repo) if repo else Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5,
                             check=True).stdout.strip()
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=cwd, capture_output=True, text=True,
                             timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                *(f":(exclude){d}" for d in OUTPUT_DIRS)], cwd=top,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment_info() -> dict:
    import torch

    versions = {}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"versions": versions, "python": platform.python_version(), "git_sha": git_sha(),
            "device": "cuda" if gpu else "cpu", "gpu_name": gpu, "torch_num_threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine()}
