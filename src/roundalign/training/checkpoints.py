"""Crash-consistent checkpoints: a checkpoint is complete, or resume does not see it.

Trainer writes a checkpoint as many files into ``checkpoint-N/`` (weights, optimizer with our fp32 masters,
scheduler, RNG state, ``trainer_state.json``; under ZeRO-3 also ``global_stepN/`` shards and ``latest``), and the
runner adds ``roundalign_state.json``. A job killed while it saves (SLURM sends SIGKILL ``KillWait`` seconds after
SIGTERM, and a 7B checkpoint takes longer than that) leaves some of them missing or truncated. So:

- **complete marker, last.** Once every file is written, they are flushed to disk (``fsync``, each file and each
  directory), and then ``roundalign_complete.json`` is written atomically, listing every file and its size. Only a
  checkpoint with that marker is complete.
- **verified before resume.** :func:`latest_complete` walks the checkpoints newest first and takes the first one
  whose marker is there and whose files match it: each listed file present with its size, every ``.safetensors``
  header readable, ``trainer_state.json`` parseable. It reads headers, never tensors, so it is cheap at any size.
- **set aside, never deleted silently.** A checkpoint that fails is moved to ``checkpoints/incomplete/`` and named
  in the log and in ``run.json`` (``incomplete_checkpoints``); resume goes on from the one before it, or from step 0
  with a message when there is none.
- **rotation counts complete checkpoints only** (:func:`rotate`, after the marker): Trainer's own rotation is off,
  so the newest complete checkpoint is never removed while a newer one is still being written.

``ROUNDALIGN_CKPT_FSYNC=0`` skips the flush (for measuring its cost: ``tools/bench/train.py``).
``ROUNDALIGN_FAULT_INJECT`` kills the process at a named point of the save (tests only, :func:`fault_point`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import struct
from pathlib import Path

from roundalign.io import atomic_write_json

MARKER = "roundalign_complete.json"
INCOMPLETE_DIR = "incomplete"
_NAME = re.compile(r"^checkpoint-(\d+)$")
# where fault_point can kill a save, in the order a save passes them
FAULT_POINTS = ("save_begin", "after_model", "after_optimizer", "after_rng", "before_marker", "after_marker")


def step_of(path: Path) -> int:
    return int(_NAME.match(path.name).group(1))


def checkpoints(ckpt_dir: Path) -> list[Path]:
    """``checkpoint-N`` directories, oldest first."""
    if not Path(ckpt_dir).is_dir():
        return []
    return sorted((p for p in Path(ckpt_dir).iterdir() if p.is_dir() and _NAME.match(p.name)), key=step_of)


def _files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != MARKER}


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """Every file, then every directory (so that their entries are on disk too)."""
    paths = sorted(root.rglob("*"))
    for p in [*(p for p in paths if p.is_file()), root, *(p for p in paths if p.is_dir())]:
        _fsync(p)


def mark_complete(ckpt: Path) -> dict:
    """Flush every file of ``ckpt`` to disk, then write its marker (atomically, and flushed too)."""
    ckpt = Path(ckpt)
    fsync = os.environ.get("ROUNDALIGN_CKPT_FSYNC", "1") not in ("", "0")
    if fsync:
        _fsync_tree(ckpt)
    marker = {"step": step_of(ckpt), "files": _files(ckpt), "fsync": fsync}
    atomic_write_json(ckpt / MARKER, marker)
    if fsync:
        _fsync(ckpt / MARKER)
        _fsync(ckpt)
    return marker


def _safetensors_header_problem(path: Path, size: int) -> str | None:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return "shorter than a safetensors header"
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            return f"safetensors header length {n} exceeds the file"
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return f"safetensors header unreadable ({exc})"
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end != size:
        return f"safetensors data ends at {8 + n + end} bytes, file has {size}"
    return None


def verify(ckpt: Path) -> str | None:
    """None if ``ckpt`` is complete, else what is wrong (cheap: sizes and headers, no tensor is read)."""
    ckpt = Path(ckpt)
    try:
        marker = json.loads((ckpt / MARKER).read_text())
        listed = marker["files"]
    except FileNotFoundError:
        return f"no {MARKER} (the save did not finish)"
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        return f"{MARKER} unreadable ({exc})"
    for rel, size in listed.items():
        path = ckpt / rel
        if not path.is_file():
            return f"{rel} is missing"
        actual = path.stat().st_size
        if actual != size:
            return f"{rel} has {actual} bytes, {size} were written"
        if rel.endswith(".safetensors"):
            problem = _safetensors_header_problem(path, actual)
            if problem:
                return f"{rel}: {problem}"
    if "trainer_state.json" not in listed:
        return "trainer_state.json was not written"
    try:
        json.loads((ckpt / "trainer_state.json").read_text())
    except json.JSONDecodeError as exc:
        return f"trainer_state.json unreadable ({exc})"
    return None


def set_aside(ckpt: Path, problem: str) -> dict:
    """Move ``ckpt`` into ``incomplete/`` (a fresh name if one is taken). Returns the record for run.json."""
    dest_dir = ckpt.parent / INCOMPLETE_DIR
    dest_dir.mkdir(exist_ok=True)
    dest, n = dest_dir / ckpt.name, 1
    while dest.exists():
        dest, n = dest_dir / f"{ckpt.name}.{n}", n + 1
    os.replace(ckpt, dest)
    return {"checkpoint": ckpt.name, "problem": problem, "moved_to": str(dest)}


def latest_complete(ckpt_dir: Path, log=print) -> tuple[Path | None, list[dict]]:
    """The newest complete checkpoint (or None), after setting aside every newer one that is not complete."""
    aside = []
    for ckpt in reversed(checkpoints(ckpt_dir)):
        problem = verify(ckpt)
        if problem is None:
            return ckpt, aside
        rec = set_aside(ckpt, problem)
        log(f"[train] {ckpt.name} is incomplete ({problem}): moved to {rec['moved_to']}; resuming from an earlier one")
        aside.append(rec)
    return None, aside


def rotate(ckpt_dir: Path, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest COMPLETE checkpoints; an incomplete one is never counted or removed here."""
    complete = [c for c in checkpoints(ckpt_dir) if (c / MARKER).is_file()]
    doomed = complete[:-keep] if keep and keep > 0 else []
    for c in doomed:
        shutil.rmtree(c)
    return doomed


def fault_point(point: str, step: int, where: str | os.PathLike = "") -> None:
    """Tests: ``ROUNDALIGN_FAULT_INJECT=<point>@<step>[@<once-file>[@<match>]]`` SIGKILLs this process when a save
    of step ``step`` reaches ``point`` (one of FAULT_POINTS). With a once-file, only if that file does not exist yet
    (it is created first), so that a retried job gets past the fault; with ``match``, only in a run whose checkpoint
    directory (``where``) contains that text (e.g. one variant of a sweep)."""
    spec = os.environ.get("ROUNDALIGN_FAULT_INJECT")
    if not spec:
        return
    at_point, at_step, once, match = (spec.split("@") + ["", "", "", ""])[:4]
    if at_point not in FAULT_POINTS:
        raise ValueError(f"ROUNDALIGN_FAULT_INJECT: unknown point {at_point!r}; valid: {', '.join(FAULT_POINTS)}")
    if at_point != point or int(at_step) != step or (match and match not in str(where)):
        return
    if once:
        if Path(once).exists():
            return
        Path(once).write_text(spec + "\n")
    os.kill(os.getpid(), signal.SIGKILL)
