"""Stopping before the job's time limit: the deadline source, the margin rule, and a real run that
checkpoints as `preempted` before the limit (or on SIGUSR1) and resumes on the rerun."""

import datetime
import json
import os
import signal
import time
from types import SimpleNamespace

import pytest
import torch
from transformers import TrainerCallback

from roundalign.models.tiny import make_tiny
from roundalign.training.config import build_config
from roundalign.training.deadline import RunState, job_end_time, make_deadline_callback
from roundalign.training.train import run_train

torch.set_num_threads(1)
QUIET = dict(log=lambda *_: None)
FAST = {"prompts_per_step": 4, "num_generations": 2, "per_device_batch_size": 8, "max_completion_length": 4,
        "checkpoint_every": 50, "num_train_prompts": 32}


def test_end_time_sources(tmp_path, monkeypatch):
    assert job_end_time({"ROUNDALIGN_DEADLINE": "1700000000"}) == 1700000000.0
    assert job_end_time({"SLURM_JOB_END_TIME": "1700000500"}) == 1700000500.0
    assert job_end_time({}) is None
    with pytest.raises(ValueError, match="ROUNDALIGN_DEADLINE"):
        job_end_time({"ROUNDALIGN_DEADLINE": "tomorrow"})
    fake = tmp_path / "squeue"  # squeue -h -j ID -o %e prints the end time in local time
    fake.write_text("#!/bin/sh\necho 2030-01-02T03:04:05\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")

    assert job_end_time({"SLURM_JOB_ID": "42"}) == datetime.datetime(2030, 1, 2, 3, 4, 5).timestamp()


def test_margin_grows_with_the_longest_step(monkeypatch):
    now = [0.0]
    state = RunState()
    cb = make_deadline_callback(state, end_time=1000.0, min_margin=100.0, clock=lambda: now[0], **QUIET)
    control = SimpleNamespace(should_save=False, should_training_stop=False)
    st = SimpleNamespace(global_step=1)
    cb.on_step_begin(None, st, control)
    now[0] = 300.0  # a 300 s step: margin becomes 2 x 300 + 60 = 660 s; 700 s are left
    cb.on_step_end(None, st, control)
    assert not state.stop_requested and not control.should_training_stop
    cb.on_step_begin(None, st, control)
    now[0] = 350.0  # 650 s left < 660 s
    cb.on_step_end(None, st, control)
    assert (state.stop_requested, state.stopped_by) == (True, "deadline")
    assert control.should_save and control.should_training_stop
    for key in ("ROUNDALIGN_DEADLINE", "SLURM_JOB_END_TIME", "SLURM_JOB_ID"):
        monkeypatch.delenv(key, raising=False)
    assert make_deadline_callback(RunState(), **QUIET) is None  # no limit known: no callback


class Usr1At(TrainerCallback):
    def on_step_begin(self, args, state, control, **kw):
        if state.global_step == 1:
            os.kill(os.getpid(), signal.SIGUSR1)


def test_run_stops_before_the_deadline_and_on_usr1_then_resumes(tmp_path, monkeypatch):
    model = str(make_tiny("qwen2", tmp_path / "m", hidden=32, layers=1, seed=0))
    cfg = build_config(overrides={"model": model, "steps": 4, **FAST})

    monkeypatch.setenv("ROUNDALIGN_DEADLINE", str(time.time() + 30))
    monkeypatch.setenv("ROUNDALIGN_STOP_MARGIN_S", "60")  # 30 s left < 60 s: stop after the first step
    first = run_train(cfg, tmp_path / "run", **QUIET)
    assert (first.status, first.last_step, first.exit_code) == ("preempted", 1, 143)
    assert (tmp_path / "run/checkpoints/checkpoint-1/trainer_state.json").is_file()
    monkeypatch.delenv("ROUNDALIGN_DEADLINE")
    usr1 = run_train(cfg, tmp_path / "run", callbacks=[Usr1At()], **QUIET)
    assert (usr1.status, usr1.last_step) == ("preempted", 2)
    done = run_train(cfg, tmp_path / "run", **QUIET)
    assert (done.status, done.last_step) == ("done", 4)
    assert json.loads((tmp_path / "run/run.json").read_text())["resumed_from"] == [1, 2]
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # handler restored
