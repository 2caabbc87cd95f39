"""Stop a training job cleanly before its time limit: checkpoint while there is time, instead of relying on
the SIGTERM that SLURM sends KillWait seconds (30 s by default) before SIGKILL, while a GRPO step at paper
scale takes minutes.

Why not ``--signal=USR1@N`` through the profile: snakemake-executor-plugin-slurm 2.8 submits the job as
``sbatch --wrap "snakemake --executor slurm-jobstep ..."`` and the jobstep plugin (0.6) runs the rule inside
``srun -n1 ... snakemake ...`` (snakemake_executor_plugin_slurm_jobstep/__init__.py, ``run_job``). A step
signal (no ``B:``) reaches every process of that step, including that inner snakemake, which handles only
SIGTERM (snakemake/scheduling/job_scheduler.py:171): it dies on USR1, the step ends, and SLURM kills the
trainer with it. With ``B:`` only the batch shell is signalled, which also dies on USR1 and ends the job.
So the trainer watches the clock itself:

- the job's end time: ``$ROUNDALIGN_DEADLINE`` (a UNIX time, for any scheduler or by hand), else
  ``$SLURM_JOB_END_TIME`` (set by newer SLURM releases), else ``squeue -h -j $SLURM_JOB_ID -o %e``;
- after each optimizer step, when the time left is below ``margin = max(min_margin, 2 x the longest step
  + save time)``, the run checkpoints and stops as ``preempted`` (exit 143); Snakemake's retry (with a
  longer time limit) resumes it. ``$ROUNDALIGN_STOP_MARGIN_S`` sets ``min_margin`` (default 300 s).

SIGUSR1 is also handled like SIGTERM (``train.py``), for hand-written batch scripts that run the trainer
under ``srun --signal=USR1@N`` themselves.
"""

from __future__ import annotations

import dataclasses

import datetime as _dt
import os
import shutil
import subprocess
import time


def job_end_time(env=None) -> float | None:
    """UNIX time at which the scheduler ends this job, or None when unknown / not under a scheduler."""
    env = os.environ if env is None else env
    for key in ("ROUNDALIGN_DEADLINE", "SLURM_JOB_END_TIME"):
        value = env.get(key)
        if value:
            try:
                return float(value)
            except ValueError:
                raise ValueError(f"${key}={value!r} is not a UNIX time in seconds") from None
    job = env.get("SLURM_JOB_ID")
    squeue = shutil.which("squeue")
    if not job or squeue is None:
        return None
    try:
        out = subprocess.run([squeue, "-h", "-j", job, "-o", "%e"], capture_output=True, text=True, timeout=30,
                             check=True).stdout.strip()
        return _dt.datetime.fromisoformat(out).timestamp()  # local time, as squeue prints it
    except (OSError, subprocess.SubprocessError, ValueError):
        return None  # "Unknown"/"NONE" (no limit) or squeue unavailable: no deadline


@dataclasses.dataclass
class RunState:
    """What the parts of one training run tell each other while it runs (``roundalign.training.train``).

    ``stop_requested``: checkpoint at the end of this step and stop (SIGTERM, SIGUSR1 or the job's deadline);
    ``stopped_by``: which of them asked first ("signal" or "deadline", recorded in run.json as ``preempted_by``);
    ``collapse``: the non-finite collapse that stopped the run, ``{"step", "reason"}``; ``sync``: the emulated
    engine's weight sync (``trl_bridge.bridge_emulated_engine``), whose count a checkpoint records;
    ``resume_state``: the ``roundalign_state.json`` of the checkpoint the run resumes from; ``heldout``: the policy's
    held-out evaluation (``training/heldout.py``), None when the run has none."""

    stop_requested: bool = False
    stopped_by: str | None = None
    collapse: dict | None = None
    sync: object | None = None
    resume_state: dict | None = None
    heldout: object | None = None

    def request_stop(self, by: str) -> None:
        if not self.stop_requested:
            self.stop_requested, self.stopped_by = True, by


def make_deadline_callback(state: RunState, log=print, end_time: float | None = None,
                           min_margin: float | None = None, clock=time.time):
    """A TrainerCallback that requests the run's stop (``state.request_stop("deadline")``) and asks the trainer to
    save and stop when the job's time is nearly up. Returns None when there is no deadline."""
    end = job_end_time() if end_time is None else end_time
    if end is None:
        return None
    floor = float(os.environ.get("ROUNDALIGN_STOP_MARGIN_S", "300")) if min_margin is None else min_margin
    from roundalign.training.callbacks import DeadlineCallback  # noqa: PLC0415 -- optional: vllm (trl imports it)

    log(f"[train] job ends at {_dt.datetime.fromtimestamp(end).isoformat(timespec='seconds')}; the run "
        f"checkpoints and stops when less than max({floor:.0f}s, 2 x longest step + 60s) is left")
    return DeadlineCallback(state, end, floor, log=log, clock=clock)
