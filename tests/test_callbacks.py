"""The run's TrainerCallback on its own (roundalign.training.callbacks.RunCallback), driven step by step without a
trainer: the metrics lines it writes, a non-finite step stopping the run as collapsed, the fp16 overflow step that
is not a collapse, a stop request turning into save-and-stop, the collapse detectors' state surviving a
checkpoint, and the k3/exact legend printed once."""

import json
import math
from types import SimpleNamespace

from transformers import TrainerControl, TrainerState

from roundalign.training.callbacks import EXACT_LEGEND, RunCallback, metrics_record, nonfinite_keys
from roundalign.training.checkpoints import MARKER
from roundalign.training.config import build_config
from roundalign.training.deadline import RunState


class _Files:
    """RunFiles' interface, in memory."""

    def __init__(self):
        self.is_main, self.lines, self.record, self.writes = True, [], {}, 0

    def append_metrics(self, rec):
        self.lines.append(json.loads(json.dumps(rec)))

    def write(self):
        self.writes += 1


def _callback(**overrides):
    cfg = build_config(overrides={"model": "m", "steps": 20, **overrides})
    files, state, logged = _Files(), RunState(), []
    return RunCallback(files, cfg, state, logged.append), files, state, logged


def _step(cb, step, **logs):
    st, control = TrainerState(), TrainerControl()
    st.global_step = step
    cb.on_step_begin(None, st, control)
    cb.on_log(None, st, control, logs={"loss": 0.5, **logs})
    cb.on_step_end(None, st, control)
    return control


def test_metrics_record_renames_trls_keys():
    rec = metrics_record(3, {"loss": 0.1, "rewards/digits_reward/mean": 0.25, "step_time": 1.5, "grad_norm": 2.0})
    assert rec == {"step": 3, "optim/loss": 0.1, "reward/digits_reward/mean": 0.25, "time/trl_step_time_s": 1.5,
                   "optim/grad_norm": 2.0}


def test_each_step_is_one_metrics_line_and_one_progress_line():
    cb, files, state, logged = _callback()
    control = _step(cb, 1, reward=0.4, **{"num_tokens": 100})
    assert not control.should_training_stop and state.collapse is None
    assert [line["step"] for line in files.lines] == [1] and files.record["last_step"] == 1
    assert files.lines[0]["optim/loss"] == 0.5 and files.lines[0]["step_time_s"] >= 0
    assert logged[-1].startswith("[train] step 1/20 reward=") and "k3=" not in logged[-1]


def test_a_non_finite_loss_stops_the_run_as_collapsed():
    cb, files, state, _ = _callback()
    _step(cb, 1)
    control = _step(cb, 2, loss=math.nan)
    assert control.should_training_stop
    assert state.collapse["step"] == 2 and state.collapse["reason"] == "non-finite optim/loss=nan"


def test_an_fp16_overflow_step_is_not_a_collapse():
    skipped = {"optim/grad_norm": math.inf, "optim/overflow_skipped": 1, "optim/loss_scale": 2.0 ** 15}
    assert nonfinite_keys(skipped) == []
    assert nonfinite_keys({**skipped, "optim/loss_scale": 1.0}) == ["optim/grad_norm"]  # nothing left to halve
    assert nonfinite_keys({"mismatch/token/k3": math.inf, "optim/loss": 1.0}) == ["mismatch/token/k3"]


def test_a_stop_request_saves_and_stops_at_the_end_of_the_step():
    cb, _, state, _ = _callback()
    assert not _step(cb, 1).should_save
    state.request_stop("signal")
    control = _step(cb, 2)
    assert control.should_save and control.should_training_stop and state.stopped_by == "signal"


def test_the_k3_legend_is_printed_once_before_the_first_k3_line():
    cb, _, _, logged = _callback()
    for step in (1, 2):
        _step(cb, step, **{"mismatch/token/k3": 1e-13, "mismatch/token/tokens_exact_frac": 0.0})
    assert logged.count(EXACT_LEGEND) == 1 and logged.index(EXACT_LEGEND) == 0
    assert "k3=1.00e-13 exact=0.000" in logged[1]


def test_reward_collapse_is_recorded_and_survives_a_checkpoint(tmp_path):
    over = {"reward_collapse_window": 1, "reward_collapse_drop": 0.5, "reward_collapse_patience": 2}
    cb, files, state, logged = _callback(**over)
    for step, reward in enumerate([1.0, 1.0, 0.1], 1):
        _step(cb, step, **{"reward": reward})
    assert files.record.get("reward_collapse") is None  # one step below the line: not yet
    ckpt = tmp_path / "checkpoint-3"
    ckpt.mkdir()
    st = TrainerState()
    st.global_step = 3
    cb.on_save(SimpleNamespace(output_dir=str(tmp_path)), st, TrainerControl())
    marker = json.loads((ckpt / MARKER).read_text())  # the marker lists the state file it was written after
    assert "roundalign_state.json" in json.dumps(marker) and files.writes == 1
    saved = json.loads((ckpt / "roundalign_state.json").read_text())
    # a resumed run's callback continues the streak from the checkpoint: step 4 confirms the collapse at onset 3
    cb2, files2, state2, _ = _callback(**over)
    state2.resume_state = saved
    cb2.on_train_begin(None, TrainerState(), TrainerControl())
    _step(cb2, 4, **{"reward": 0.1})
    assert files2.record["reward_collapse"]["step"] == 3
    # the uninterrupted run flags the same onset
    _step(cb, 4, **{"reward": 0.1})
    assert files.record["reward_collapse"] == files2.record["reward_collapse"]
