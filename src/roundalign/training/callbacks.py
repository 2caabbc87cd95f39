"""The run's TrainerCallbacks: metrics.jsonl, collapse detection, stop requests, checkpoint markers, progress
(``RunCallback``), and stopping before the job's time limit (``DeadlineCallback``).

``RunCallback`` is what ``train.run_train`` hands TRL's GRPOTrainer. It owns no state of the run beyond its
detectors: the run's files are a ``RunFiles`` (train.py), the stop flag and collapse record a ``RunState``
(deadline.py), so the callback can be driven on its own by a test, without a trainer.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from transformers import TrainerCallback

from roundalign.io import atomic_write_json
from roundalign.training import distributed as D
from roundalign.training.checkpoints import fault_point, mark_complete, rotate
from roundalign.training.collapse import GradNormCollapse, RewardCollapse
from roundalign.training.trl_bridge import TRL_RENAMES

# Printed once, before the first progress line that carries k3 (`full` shows exact=0.000 beside k3 ~1e-13)
EXACT_LEGEND = (
    "[train] k3: per-token mismatch KL between the engine's sampling logprobs and the trainer's (nats); exact: "
    "fraction of tokens whose two logprobs are equal bit for bit. With scoring=trl (the default) the engine's "
    "sampler and TRL compute log-softmax in different fp32 orders (~1e-7 nats apart), so exact stays well below 1 "
    "even where k3 sits at that floor (~1e-13) and the logits are bitwise equal; scoring=engine scores as the "
    "sampler does")
# A step whose loss, grad norm or k3 is not finite stops the run as collapsed
CHECKED_FINITE = ("optim/loss", "optim/grad_norm", "mismatch/token/k3")


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def metrics_record(step: int, logs: dict) -> dict:
    """One metrics.jsonl line from TRL's logs of a step: our names for TRL's keys (trl_bridge.TRL_RENAMES),
    ``rewards/*`` as ``reward/*``, TRL's step time as ``time/trl_step_time_s``."""
    rec = {"step": step}
    for key, value in logs.items():
        if key == "step_time":
            rec["time/trl_step_time_s"] = value
        elif key.startswith("rewards/"):
            rec["reward/" + key[len("rewards/"):]] = value
        else:
            rec[TRL_RENAMES.get(key, key)] = value
    return rec


def nonfinite_keys(rec: dict) -> list[str]:
    """The checked keys of a step that are not finite. An fp16 step skipped for overflow (the loss scale halved)
    is not a collapse: its grad norm is inf by design."""
    bad = [k for k in CHECKED_FINITE if k in rec and not _finite(rec[k])]
    if "optim/grad_norm" in bad and rec.get("optim/overflow_skipped") and rec.get("optim/loss_scale", 0) > 1:
        bad.remove("optim/grad_norm")
    return bad


class RunCallback(TrainerCallback):
    """Writes metrics.jsonl, detects collapse, honours a stop request, marks complete checkpoints, prints one
    progress line per step.

    ``files``: the run's RunFiles (``append_metrics``, ``record``, ``write``, ``is_main``); ``state``: its RunState
    (``stop_requested``, ``collapse``, ``resume_state``, ``sync``); ``log``: where progress lines go."""

    def __init__(self, files, cfg, state, log=print):
        self.files, self.cfg, self.state, self.log = files, cfg, state, log
        self.t_step = None
        self.last_tokens = None
        self.reward_collapse = RewardCollapse(cfg.reward_collapse_window, cfg.reward_collapse_drop,
                                              cfg.reward_collapse_patience)
        self.grad_norm_collapse = GradNormCollapse(cfg.grad_norm_collapse_factor, cfg.grad_norm_collapse_min_steps)
        self.explained_exact = False

    def on_train_begin(self, args, st, control, **kw):
        if self.state.resume_state:  # the detectors continue where the checkpoint left them
            self.reward_collapse.load_state_dict(self.state.resume_state)
            self.grad_norm_collapse.load_state_dict(self.state.resume_state)
            self.files.record["reward_collapse"] = self.reward_collapse.event
            self.files.record["grad_norm_collapse"] = self.grad_norm_collapse.event

    def on_step_begin(self, args, st, control, **kw):
        self.t_step = time.perf_counter()

    def on_step_end(self, args, st, control, **kw):
        if self.state.stop_requested:  # SIGTERM, SIGUSR1 or the deadline: checkpoint this step, then stop
            control.should_save = True
            control.should_training_stop = True

    def on_log(self, args, st, control, logs=None, **kw):
        if not logs or "loss" not in logs:
            return  # the end-of-training summary
        step_time = time.perf_counter() - (self.t_step or time.perf_counter())
        rec = metrics_record(st.global_step, logs)
        tokens = rec.get("tokens/total")
        new_tokens = tokens - self.last_tokens if tokens is not None and self.last_tokens is not None else tokens
        self.last_tokens = tokens
        rec["step_time_s"] = step_time
        rec["tokens_per_s"] = (new_tokens / step_time) if new_tokens and step_time > 0 else None
        self.files.append_metrics(rec)
        self.files.record["last_step"] = st.global_step
        bad = nonfinite_keys(rec)
        if D.any_rank(bool(bad)):  # decided on a global flag, so every rank stops at the same step
            bad = bad or ["on another rank"]
            self.state.collapse = {"step": st.global_step, "reason": "non-finite " + ", ".join(
                f"{k}={rec[k]}" if k in rec else k for k in bad)}
            control.should_training_stop = True
        if event := self.reward_collapse.update(st.global_step, rec.get("reward/mean")):
            self.files.record["reward_collapse"] = event
            self.log(f"[train] reward collapse flagged at step {st.global_step} (onset {event['step']})")
        if event := self.grad_norm_collapse.update(st.global_step, rec.get("optim/grad_norm")):
            self.files.record["grad_norm_collapse"] = event
            self.log(f"[train] grad-norm collapse flagged at step {st.global_step}")
        self.log(self.progress_line(st.global_step, rec, step_time))

    def progress_line(self, step: int, rec: dict, step_time: float) -> str:
        k3 = rec.get("mismatch/token/k3")
        if k3 is not None and not self.explained_exact:
            self.explained_exact = True
            self.log(EXACT_LEGEND)
        return (f"[train] step {step}/{self.cfg.steps} reward={rec.get('reward/mean', float('nan')):.3f} "
                + (f"k3={k3:.2e} exact={rec.get('mismatch/token/tokens_exact_frac', float('nan')):.3f} "
                   if k3 is not None else "")
                + f"loss={rec.get('optim/loss', float('nan')):.4g} ({step_time:.2f}s)")

    def on_save(self, args, st, control, **kw):
        ckpt = Path(args.output_dir) / f"checkpoint-{st.global_step}"
        if ckpt.is_dir() and self.files.is_main:
            atomic_write_json(ckpt / "roundalign_state.json", {
                "step": st.global_step, "engine": self.cfg.engine, "backend": self.cfg.backend,
                "engine_syncs": self.state.sync.num_syncs if self.state.sync else None,
                **self.reward_collapse.state_dict(), **self.grad_norm_collapse.state_dict()})
        D.barrier()  # every rank's files (ZeRO-3 shards) are written before the marker
        fault_point("before_marker", st.global_step, args.output_dir)
        if ckpt.is_dir() and self.files.is_main:
            mark_complete(ckpt)
            fault_point("after_marker", st.global_step, args.output_dir)
            rotate(ckpt.parent, self.cfg.keep_checkpoints)  # Trainer's rotation is off (build_grpo_args)
        D.barrier()
        self.files.write()


class DeadlineCallback(TrainerCallback):
    """Requests the run's stop (``state.request_stop("deadline")``) and asks the trainer to save and stop once less
    than max(``floor``, 2 x the longest step so far + 60 s) is left before ``end`` (epoch seconds, by ``clock``).
    ``deadline.make_deadline_callback`` builds it from the job's limit."""

    def __init__(self, state, end: float, floor: float, log=print, clock=time.time):
        self.state, self.end, self.floor, self.log, self.clock = state, end, floor, log, clock
        self.t0 = None
        self.longest = 0.0

    def on_step_begin(self, args, st, control, **kw):
        self.t0 = self.clock()

    def on_step_end(self, args, st, control, **kw):
        now = self.clock()
        if self.t0 is not None:
            self.longest = max(self.longest, now - self.t0)
        margin = max(self.floor, 2 * self.longest + 60)
        if self.end - now < margin and not self.state.stop_requested:
            self.log(f"[train] {self.end - now:.0f}s left before the job's time limit (< {margin:.0f}s margin): "
                     f"checkpointing at step {st.global_step} and stopping; a rerun resumes")
            self.state.request_stop("deadline")
        if self.state.stop_requested:
            control.should_save = True
            control.should_training_stop = True
