"""Crash-consistent checkpoints (roundalign.training.checkpoints): a run killed while it saves, or whose newest checkpoint
was damaged afterwards, sets that checkpoint aside, resumes from the last complete one and ends with the
uninterrupted run's metrics.jsonl (wall-clock fields aside) and status ``done``.

The kills are real SIGKILLs of a ``roundalign train`` process, at named points of Trainer's save path
(``ROUNDALIGN_FAULT_INJECT``: between the files of a save, after the optimizer state; after every file but before the
completion marker; right after the marker); the resumes run in this process."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from roundalign.training import checkpoints as C
from roundalign.training.config import build_config
from roundalign.models.pretrain import pretrain_tiny
from roundalign.models.tiny import make_tiny
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
    from safetensors.torch import save_file

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
    from roundalign.training import checkpoints as C

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
