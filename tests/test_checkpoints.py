"""Crash-consistent checkpoints (roundalign.training.checkpoints): a run killed while it saves, or whose newest checkpoint
was damaged afterwards, sets that checkpoint aside, resumes from the last complete one and ends with the
uninterrupted run's metrics.jsonl (wall-clock fields aside) and status ``done``.

The kills are real SIGKILLs of a ``roundalign train`` process, at named points of Trainer's save path
(``ROUNDALIGN_FAULT_INJECT``: between the files of a save, after the optimizer state; after every file but before the
completion marker; right after the marker); the resumes run in this process."""

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from roundalign.models.pretrain import pretrain_tiny
from roundalign.models.tiny import make_tiny
from roundalign.training import checkpoints as C
from roundalign.training.config import build_config
from roundalign.training.train import TIMING_KEYS, run_train

torch.set_num_threads(1)
FAST = {"prompts_per_step": 4, "num_generations": 4, "per_device_batch_size": 16, "max_completion_length": 6,
        "learning_rate": 2e-3, "checkpoint_every": 2, "num_train_prompts": 64, "steps": 6}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    base = make_tiny("qwen2", root / "tiny", hidden=64, layers=2, seed=0)
    return str(pretrain_tiny(base, root / "tiny-sft", steps=200, log=lambda *_: None))


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "run"
    assert run_train(build_config(overrides={"model": model, **FAST}), out, log=lambda *_: None).status == "done"
    return _metrics(out)


def _metrics(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _killed_run(model, out: Path, fault: str) -> None:
    sets = sum((["--set", f"{k}={v}"] for k, v in FAST.items() if k != "steps"), [])
    res = subprocess.run([sys.executable, "-m", "roundalign", "train", "--model", model, "--variant", "full",
                          "--steps", str(FAST["steps"]), "--out", str(out), *sets],
                         env={**os.environ, "OMP_NUM_THREADS": "1", "ROUNDALIGN_FAULT_INJECT": fault},
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == -9, res.stdout[-2000:] + res.stderr[-2000:]  # SIGKILL, as SLURM's after KillWait
    assert json.loads((out / "run.json").read_text())["status"] == "running"  # what a SIGKILL leaves


def _resume(model, out: Path) -> list[str]:
    lines = []
    res = run_train(build_config(overrides={"model": model, **FAST}), out, log=lines.append)
    assert (res.status, res.last_step) == ("done", FAST["steps"])
    return lines


@pytest.mark.parametrize("point,step,resumes_from", [
    # (a kill before the save's first file leaves nothing to see; after the weights alone is the case below with
    # fewer files written)
    ("before_marker", 4, 2),     # every file written and flushed, the marker not yet
    ("after_optimizer", 2, 0),   # the first save, between its files: no complete checkpoint at all
])
def test_killed_while_saving_resumes_from_the_last_complete_checkpoint(model, reference, tmp_path, point, step,
                                                                       resumes_from):
    out = tmp_path / "run"
    _killed_run(model, out, f"{point}@{step}")
    assert (out / f"checkpoints/checkpoint-{step}").is_dir()
    assert C.verify(out / f"checkpoints/checkpoint-{step}").startswith(f"no {C.MARKER}")
    log = _resume(model, out)
    assert any(f"checkpoint-{step} is incomplete" in line for line in log), log
    if resumes_from:
        assert any(f"resuming from checkpoint-{resumes_from}" in line for line in log), log
    else:
        assert any("no complete checkpoint is left; restarting from step 0" in line for line in log), log
    assert _metrics(out) == reference
    run = json.loads((out / "run.json").read_text())
    assert [r["checkpoint"] for r in run["incomplete_checkpoints"]] == [f"checkpoint-{step}"]
    assert (out / f"checkpoints/incomplete/checkpoint-{step}").is_dir()  # set aside, not deleted
    # rotation counted complete checkpoints only: the newest two are kept, each with its marker
    assert [p.name for p in C.checkpoints(out / "checkpoints")] == ["checkpoint-4", "checkpoint-6"]
    assert all(C.verify(p) is None for p in C.checkpoints(out / "checkpoints"))


def _truncate_weights(ckpt):
    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _drop_optimizer(ckpt):
    (ckpt / "optimizer.pt").unlink()


def _corrupt_state(ckpt):
    f = ckpt / "trainer_state.json"  # same size, garbled: only parsing it tells
    f.write_bytes(b"{" + b"\x00" * (f.stat().st_size - 1))


@pytest.fixture(scope="module")
def complete_at_4(model, tmp_path_factory):
    # killed right after checkpoint-4 was marked complete: a run whose newest checkpoint is good
    out = tmp_path_factory.mktemp("at4") / "run"
    _killed_run(model, out, "after_marker@4")
    assert C.verify(out / "checkpoints/checkpoint-4") is None
    return out


@pytest.mark.parametrize("damage,problem", [
    (_truncate_weights, "model.safetensors has"),
    (_drop_optimizer, "optimizer.pt is missing"),
    (_corrupt_state, "trainer_state.json unreadable"),
])
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_run_ends_identical(model, reference, complete_at_4,
                                                                             tmp_path, damage, problem):
    out = tmp_path / "run"
    shutil.copytree(complete_at_4, out)
    damage(out / "checkpoints/checkpoint-4")
    assert C.verify(out / "checkpoints/checkpoint-4").startswith(problem)
    log = _resume(model, out)
    assert any("checkpoint-4 is incomplete" in line and problem in line for line in log), log
    assert any("resuming from checkpoint-2" in line for line in log), log
    assert _metrics(out) == reference
    assert json.loads((out / "run.json").read_text())["incomplete_checkpoints"][0]["problem"].startswith(problem)


def test_verify_reads_headers_of_a_zero3_layout(tmp_path):
    # DeepSpeed ZeRO-3 writes global_stepN/ shards and a `latest` file into the checkpoint: the marker lists them
    # all, so a truncated shard or a missing `latest` makes the checkpoint incomplete like any other file
    ckpt = tmp_path / "checkpoint-8"
    (ckpt / "global_step8").mkdir(parents=True)
    save_file({"w": torch.ones(4, 4)}, ckpt / "model.safetensors")
    for rank in (0, 1):
        (ckpt / f"global_step8/bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"x" * (100 + rank))
    (ckpt / "latest").write_text("global_step8")
    (ckpt / "trainer_state.json").write_text("{}")
    assert C.verify(ckpt).startswith("no ")
    marker = C.mark_complete(ckpt)
    assert sorted(marker["files"]) == ["global_step8/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                       "global_step8/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", "latest",
                                       "model.safetensors", "trainer_state.json"]
    assert C.verify(ckpt) is None
    shard = ckpt / "global_step8/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shard.write_bytes(b"x" * 50)
    assert C.verify(ckpt) == "global_step8/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt has 50 bytes, 101 were written"
    shard.write_bytes(b"x" * 101)
    (ckpt / "latest").unlink()
    assert C.verify(ckpt) == "latest is missing"
    # a safetensors file of the right size whose header was overwritten
    (ckpt / "latest").write_text("global_step8")
    w = ckpt / "model.safetensors"
    w.write_bytes(b"\xff" * 8 + w.read_bytes()[8:])
    assert "header length" in C.verify(ckpt)


def test_fault_point_names_are_checked_and_fire_once(tmp_path, monkeypatch):
    monkeypatch.setenv("ROUNDALIGN_FAULT_INJECT", "after_lunch@3")
    with pytest.raises(ValueError, match="unknown point 'after_lunch'; valid: save_begin, after_model"):
        C.fault_point("after_model", 3)
    once = tmp_path / "fired"
    once.write_text("earlier attempt\n")
    monkeypatch.setenv("ROUNDALIGN_FAULT_INJECT", f"after_model@3@{once}")
    C.fault_point("after_model", 3)  # the once-file exists: the retried job gets past it (this process lives)
    monkeypatch.setenv("ROUNDALIGN_FAULT_INJECT", f"after_model@3@{tmp_path / 'unfired'}@/baseline/")
    C.fault_point("after_model", 3, "/runs/smoke/m/full/seed0/checkpoints")  # another run of the sweep: no kill
    assert not (tmp_path / "unfired").exists()


def test_mark_complete_flushes_every_file_before_the_marker_exists(tmp_path, monkeypatch):
    """The order a crash cannot show (a SIGKILL keeps the page cache, so both orders end alike after a kill): every
    file and directory of the checkpoint is fsynced before the marker is written, then the marker itself."""
    ckpt = tmp_path / "checkpoint-3"
    (ckpt / "global_step3").mkdir(parents=True)
    for rel in ("model.safetensors", "optimizer.pt", "global_step3/shard.pt"):
        (ckpt / rel).write_bytes(b"x" * 10)
    events = []
    real_fsync, real_write = C._fsync, C.atomic_write_json
    monkeypatch.setenv("ROUNDALIGN_CKPT_FSYNC", "1")
    monkeypatch.setattr(C, "_fsync", lambda p: (events.append(("fsync", Path(p).relative_to(tmp_path).as_posix())),
                                                real_fsync(p)))
    monkeypatch.setattr(C, "atomic_write_json", lambda p, obj: (events.append(("marker", Path(p).name)),
                                                                real_write(p, obj)))
    C.mark_complete(ckpt)
    marker_at = events.index(("marker", C.MARKER))
    before = {p for kind, p in events[:marker_at] if kind == "fsync"}
    assert before == {"checkpoint-3", "checkpoint-3/global_step3", "checkpoint-3/model.safetensors",
                      "checkpoint-3/optimizer.pt", "checkpoint-3/global_step3/shard.pt"}, events
    assert events[marker_at + 1:] == [("fsync", f"checkpoint-3/{C.MARKER}"), ("fsync", "checkpoint-3")], events


# --------------------------------------------------------------------------------------------------------------
# The in-process paths of resume and rotation, without a training run. The end-to-end tests above (real SIGKILLs of a
# ``roundalign train`` process, ~10-40 s each) cover them too; the first tier of ``make mutation`` deselects those and
# relies on these (fast, no slow marker), each against a reference written here.


def _ckpt(root, step, complete=True, state="{}"):
    ckpt = root / f"checkpoint-{step}"
    ckpt.mkdir(parents=True)
    (ckpt / "optimizer.pt").write_bytes(b"o" * (10 + step))
    (ckpt / "trainer_state.json").write_text(state)
    if complete:
        C.mark_complete(ckpt)
    return ckpt


def test_checkpoints_are_listed_by_step_number_and_only_checkpoint_dirs(tmp_path):
    assert C.checkpoints(tmp_path / "absent") == []
    for name in ("checkpoint-10", "checkpoint-2", "checkpoint-9", "checkpoint-x", "checkpoint-3-old", "incomplete"):
        (tmp_path / name).mkdir()
    (tmp_path / "checkpoint-4").write_text("a file, not a checkpoint")
    assert [p.name for p in C.checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-9", "checkpoint-10"]
    assert C.step_of(tmp_path / "checkpoint-10") == 10


def test_latest_complete_sets_aside_every_newer_incomplete_one_under_a_fresh_name(tmp_path, monkeypatch):
    monkeypatch.setenv("ROUNDALIGN_CKPT_FSYNC", "0")
    _ckpt(tmp_path, 2)
    _ckpt(tmp_path, 4)
    _ckpt(tmp_path, 6, complete=False)
    _ckpt(tmp_path, 8, state="{not json")
    for taken in ("checkpoint-6", "checkpoint-6.1"):  # names already taken by earlier set-asides
        (tmp_path / "incomplete" / taken).mkdir(parents=True)
    lines = []
    got, aside = C.latest_complete(tmp_path, log=lines.append)
    assert got == tmp_path / "checkpoint-4"
    assert [(r["checkpoint"], r["moved_to"]) for r in aside] == [
        ("checkpoint-8", str(tmp_path / "incomplete" / "checkpoint-8")),
        ("checkpoint-6", str(tmp_path / "incomplete" / "checkpoint-6.2"))]
    assert aside[0]["problem"].startswith("trainer_state.json unreadable (")
    assert aside[1]["problem"] == f"no {C.MARKER} (the save did not finish)"
    assert lines == [f"[train] checkpoint-8 is incomplete ({aside[0]['problem']}): moved to {aside[0]['moved_to']}; "
                     "resuming from an earlier one",
                     f"[train] checkpoint-6 is incomplete ({aside[1]['problem']}): moved to {aside[1]['moved_to']}; "
                     "resuming from an earlier one"]
    assert [p.name for p in C.checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-4"]
    assert (tmp_path / "incomplete" / "checkpoint-6.2" / "optimizer.pt").is_file()  # moved, not deleted
    # nothing complete left: None, and every one set aside
    (tmp_path / "checkpoint-2" / "optimizer.pt").unlink()
    (tmp_path / "checkpoint-4" / C.MARKER).write_text("[]")
    got, aside = C.latest_complete(tmp_path, log=lines.append)
    assert got is None and [r["checkpoint"] for r in aside] == ["checkpoint-4", "checkpoint-2"]
    assert aside[0]["problem"].startswith(f"{C.MARKER} unreadable (") and aside[1]["problem"] == "optimizer.pt is missing"


def test_rotate_keeps_the_newest_complete_ones_and_never_touches_an_incomplete_one(tmp_path, monkeypatch):
    monkeypatch.setenv("ROUNDALIGN_CKPT_FSYNC", "0")
    for step in (2, 4, 6):
        _ckpt(tmp_path, step)
    _ckpt(tmp_path, 8, complete=False)  # being written
    assert C.rotate(tmp_path, 0) == [] and C.rotate(tmp_path, None) == [] and C.rotate(tmp_path, -1) == []
    assert C.rotate(tmp_path, 2) == [tmp_path / "checkpoint-2"]
    assert [p.name for p in C.checkpoints(tmp_path)] == ["checkpoint-4", "checkpoint-6", "checkpoint-8"]
    assert C.rotate(tmp_path, 1) == [tmp_path / "checkpoint-4"]
    assert [p.name for p in C.checkpoints(tmp_path)] == ["checkpoint-6", "checkpoint-8"]


def test_set_aside_takes_the_first_free_name_starting_at_dot_one(tmp_path):
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "incomplete" / "checkpoint-2").mkdir(parents=True)
    rec = C.set_aside(tmp_path / "checkpoint-2", "why")
    assert rec == {"checkpoint": "checkpoint-2", "problem": "why", "moved_to": str(tmp_path / "incomplete/checkpoint-2.1")}


@pytest.mark.parametrize("value,flushed", [("1", True), ("0", False), ("", False), (None, True)])
def test_mark_complete_flushes_unless_told_not_to_and_records_it(tmp_path, monkeypatch, value, flushed):
    if value is None:
        monkeypatch.delenv("ROUNDALIGN_CKPT_FSYNC", raising=False)
    else:
        monkeypatch.setenv("ROUNDALIGN_CKPT_FSYNC", value)
    calls = []
    monkeypatch.setattr(C, "_fsync", lambda p: calls.append(p))
    ckpt = _ckpt(tmp_path, 12, complete=False)
    marker = C.mark_complete(ckpt)
    assert marker == {"step": 12, "fsync": flushed, "files": {"optimizer.pt": 22, "trainer_state.json": 2}}
    assert json.loads((ckpt / C.MARKER).read_text()) == marker
    assert bool(calls) is flushed


def _safetensors(path, header: bytes, data: bytes, n=None):
    path.write_bytes(struct.pack("<Q", len(header) if n is None else n) + header + data)


def test_verify_names_each_way_a_checkpoint_can_be_incomplete(tmp_path, monkeypatch):
    monkeypatch.setenv("ROUNDALIGN_CKPT_FSYNC", "0")
    ckpt = _ckpt(tmp_path, 2, complete=False)
    w = ckpt / "model.safetensors"
    good = json.dumps({"__metadata__": {"format": "pt"}, "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                       "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}).encode()
    _safetensors(w, good, b"\0" * 12)
    C.mark_complete(ckpt)
    assert C.verify(ckpt) is None

    def redo(header, data, n=None):
        _safetensors(w, header, data, n)
        C.mark_complete(ckpt)  # sizes match the marker: only the header can tell
        return C.verify(ckpt)

    assert redo(good, b"\0" * 11) == f"model.safetensors: safetensors data ends at {8 + len(good) + 12} bytes, file " \
                                      f"has {8 + len(good) + 11}"
    assert redo(good, b"\0" * 12, n=len(good) + 13) == (f"model.safetensors: safetensors header length "
                                                        f"{len(good) + 13} exceeds the file")
    # a length of exactly the rest of the file passes the length check; the header read then runs into the data
    assert redo(good, b"\0" * 12, n=len(good) + 12).startswith("model.safetensors: safetensors header unreadable (")
    assert redo(b"{\xff" + good[2:], b"\0" * 12).startswith("model.safetensors: safetensors header unreadable (")
    assert redo(b"[1, 2" + good[5:], b"\0" * 12).startswith("model.safetensors: safetensors header unreadable (")
    w.write_bytes(b"1234567")
    C.mark_complete(ckpt)
    assert C.verify(ckpt) == "model.safetensors: shorter than a safetensors header"
    # metadata-only header: no tensors, the data ends right after it
    assert redo(json.dumps({"__metadata__": {}}).encode(), b"") is None
    (ckpt / "trainer_state.json").unlink()
    C.mark_complete(ckpt)
    assert C.verify(ckpt) == "trainer_state.json was not written"
    (ckpt / C.MARKER).write_text(json.dumps({"step": 2}))
    assert C.verify(ckpt) == f"{C.MARKER} unreadable ('files')"


# --------------------------------------------------------------------------------------------------------------
# fault_point (``ROUNDALIGN_FAULT_INJECT``): the kill in a child process, and the spec's parsing observed in-process


def test_fault_point_kills_its_process_once_at_its_point_and_step(tmp_path):
    """The kill itself, in a child process running the same ``checkpoints`` module as this test (under
    ``make mutation``: the mutated copy)."""
    src = str(Path(C.__file__).resolve().parents[2])
    once = tmp_path / "once"
    os.environ.pop("ROUNDALIGN_FAULT_INJECT", None)
    C.fault_point("after_model", 3)  # unset: nothing happens (and mutmut maps this test to fault_point)

    def run(spec, point="after_model", step=3, where="/runs/x/full/checkpoints"):
        code = ("import sys; from roundalign.training import checkpoints as C; "
                f"C.fault_point({point!r}, {step}, {where!r}); sys.exit(7)")
        env = {**os.environ, "ROUNDALIGN_FAULT_INJECT": spec, "PYTHONPATH": src}
        if env.get("MUTANT_UNDER_TEST") == "stats":  # mutmut's coverage pass: the child needs no mutant (and has
            del env["MUTANT_UNDER_TEST"]              # no pyproject.toml in its cwd to record hits with)
        return subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, timeout=120).returncode

    assert run("after_model@3") == -signal.SIGKILL
    assert run("after_model@3") == -signal.SIGKILL  # without a once-file: every time
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # and nothing written
    assert run("after_model@4") == 7 and run("after_rng@3") == 7
    assert run("after_model@3@@/full/") == -signal.SIGKILL and run("after_model@3@@/baseline/") == 7
    assert run(f"after_model@3@{once}") == -signal.SIGKILL
    assert once.read_text() == f"after_model@3@{once}\n"  # written before the kill
    assert run(f"after_model@3@{once}") == 7  # the retried job gets past it


def test_fault_point_in_process_reads_each_field_of_the_spec(monkeypatch, tmp_path):
    """fault_point's parsing, observed in this process (os.kill replaced by a recorder): a call without a
    directory matches no ``match`` text; a spec without a once-file or a match fires every time and writes
    nothing."""
    kills = []
    monkeypatch.setattr(C.os, "kill", lambda pid, sig: kills.append((pid, sig)))
    monkeypatch.chdir(tmp_path)

    def fires(spec, *args):
        monkeypatch.setenv("ROUNDALIGN_FAULT_INJECT", spec)
        before = len(kills)
        C.fault_point(*args)
        return len(kills) > before

    assert fires("after_model@3", "after_model", 3) and kills[-1] == (os.getpid(), signal.SIGKILL)
    assert fires("after_model@3", "after_model", 3)  # no once-file: again
    assert not fires("after_model@3@@X", "after_model", 3)  # a match, and no directory given: "" has no "X"
    assert fires("after_model@3@@", "after_model", 3)  # an empty match matches anything
    assert fires("after_model@3@@X", "after_model", 3, "/a/X/b")
    assert not fires("after_model@4", "after_model", 3) and not fires("after_rng@3", "after_model", 3)
    assert list(tmp_path.iterdir()) == []  # nothing written without a once-file
    assert fires("after_model@3@once", "after_model", 3) and not fires("after_model@3@once", "after_model", 3)
    assert (tmp_path / "once").read_text() == "after_model@3@once\n"
    with pytest.raises(ValueError):  # a spec without a step, at its point
        fires("after_model", "after_model", 3)
    assert not fires("after_model", "after_rng", 3)  # ... and elsewhere nothing
