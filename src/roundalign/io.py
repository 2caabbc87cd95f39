"""Crash-safe file output: every file is written to a temporary sibling and renamed into place, so a
reader (or a rerun after a crash) sees either the old complete file or the new complete file."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike):
    """Yield a temporary path next to ``path``; on success rename it onto ``path``, on error delete it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike):
    """Yield a temporary directory next to ``path``; on success it replaces ``path`` (an existing directory
    there is removed first), on error it is deleted and ``path`` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        yield tmp
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def atomic_write_json(path: str | os.PathLike, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def atomic_write_csv(df, path: str | os.PathLike) -> None:
    """Write a pandas DataFrame as CSV (no index), atomically."""
    with atomic_path(path) as tmp:
        df.to_csv(tmp, index=False)


def check_writable(path: str | os.PathLike) -> Path:
    """Fail fast, before any long work, if ``path`` cannot be created (parent not a directory, ...)."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    existing = parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        raise PermissionError(f"cannot write {path}: {existing} is not a writable directory")
    if path.is_dir():
        raise IsADirectoryError(f"output path {path} is a directory; give a file name")
    return path
