"""GRPO against the real CPU engine: TRL 1.16's GRPOTrainer with its colocated vLLM-CPU 0.31.0, through
``roundalign train --backend vllm``.

- the weight sync: after each of several optimizer steps, TRL's own ``sync_weights`` leaves the colocated engine
  bitwise equal (teacher-forced logprobs on fixed sequences) to a fresh engine built from the fp32 masters rounded
  to bf16, and the engine before the sync differs (so the check can fail when the sync is stale);
- a reduced run through the CLI: metrics, run.json's engine record (guard, GEMM path);
- resume after SIGTERM gives the uninterrupted run's metrics.jsonl.
"""

import gc
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

from roundalign import vllm_cpu
from roundalign.config import build_config
from roundalign.pretrain import pretrain_tiny
from roundalign.tiny import make_tiny
from roundalign.train import TIMING_KEYS

QUIET = dict(log=lambda *_: None)
# 2 prompts x 4 completions a step; head_dim 32 (vLLM-CPU's attention has no 16)
FAST = {"prompts_per_step": 2, "num_generations": 4, "per_device_batch_size": 8, "max_completion_length": 6,
        "checkpoint_every": 2, "num_train_prompts": 64}


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory):
    # warm-started, so rewards vary within a group and the gradients are not zero
    root = tmp_path_factory.mktemp("models")
    base = make_tiny("qwen2", root / "tiny", hidden=128, heads=4, layers=2, tie=False, seed=0)
    return str(pretrain_tiny(base, root / "tiny-sft", steps=300, **QUIET))


def _teacher_forced(llm, seqs):
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": s} for s in seqs], SamplingParams(max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)
    return torch.cat([torch.tensor([o.prompt_logprobs[i][s[i]].logprob for i in range(1, len(s))])
                      for o, s in zip(outs, seqs)])


class _Probe(TrainerCallback):
    """After each optimizer step: the engine's logprobs before TRL's sync and after it, and the masters saved as bf16."""

    def __init__(self, out: Path, seqs):
        self.out, self.seqs, self.trainer = out, seqs, None
        self.before, self.after = [], []

    def on_step_end(self, args, state, control, **kw):
        from roundalign.trl_bridge import master_state_dict

        gen = self.trainer.vllm_generation
        self.before.append(_teacher_forced(gen.llm, self.seqs))
        gen.sync_weights()  # TRL's call (trl/generation/vllm_generation.py), as its next generation would make it
        self.after.append(_teacher_forced(gen.llm, self.seqs))
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        masters = master_state_dict(self.trainer)
        path = self.out / f"step{state.global_step}"
        model.save_pretrained(path, state_dict={k: v.to(torch.bfloat16) for k, v in masters.items()})
        self.trainer.processing_class.save_pretrained(path)


def _fresh_engine(path, eager):
    from vllm import LLM

    # the arguments TRL's colocated LLM(...) passes that can matter here (trl/generation/vllm_generation.py:347)
    return LLM(model=str(path), skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=eager, seed=0,
               max_num_batched_tokens=4096, logprobs_mode="processed_logprobs")


@pytest.mark.parametrize("engine", ["vllm-cpu-eager"])
def test_trl_sync_leaves_the_colocated_engine_equal_to_a_fresh_one(sft_model, tmp_path, monkeypatch, engine):
    from roundalign import trl_bridge
    from roundalign.train import run_train

    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 200, (n,), generator=g).tolist() for n in (7, 23, 40)]
    probe = _Probe(tmp_path, seqs)

    class Trainer(trl_bridge.RoundalignGRPOTrainer):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            probe.trainer = self

    monkeypatch.setattr(trl_bridge, "RoundalignGRPOTrainer", Trainer)
    # a learning rate that moves every step's weights well past bf16's resolution
    cfg = build_config(overrides={"model": sft_model, **FAST, "backend": "vllm", "engine": engine, "steps": 3,
                                  "learning_rate": 2e-2, "variant": "full"})
    res = run_train(cfg, tmp_path / "run", callbacks=[probe], **QUIET)
    assert (res.status, res.last_step) == ("done", 3)
    run = json.loads((tmp_path / "run/run.json").read_text())
    assert set(run["vllm_engine"]["kernels"]["gemm"]) == {vllm_cpu.LIVE_GEMM}
    probe.trainer = None
    del Trainer
    gc.collect()
    for step, (before, after) in enumerate(zip(probe.before, probe.after), start=1):
        assert not torch.equal(before, after), f"step {step}: the optimizer step did not change the engine"
        if step > 1:
            assert not torch.equal(after, probe.after[step - 2]), f"step {step}: weights did not move"
        fresh = _fresh_engine(tmp_path / f"step{step}", eager=engine.endswith("eager"))
        want = _teacher_forced(fresh, seqs)
        del fresh
        gc.collect()
        assert torch.equal(after, want), (step, (after - want).abs().max())


def _cli(model, out, steps, *extra):
    sets = {**FAST, "learning_rate": 2e-3, "checkpoint_every": 2}
    return [sys.executable, "-m", "roundalign", "train", "--model", model, "--variant", "full", "--backend", "vllm",
            "--engine", "vllm-cpu-compiled", "--steps", str(steps), "--out", str(out),
            *sum((["--set", f"{k}={v}"] for k, v in sets.items()), []), *extra]


def _metrics(run_dir):
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS}
            for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_cli_run_then_sigterm_and_resume_equals_the_uninterrupted_run(sft_model, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    full = subprocess.run(_cli(sft_model, tmp_path / "full", 5), env=env, capture_output=True, text=True, timeout=600)
    assert full.returncode == 0, full.stdout[-3000:] + full.stderr[-3000:]
    assert "[vllm-guard] engine matches the vllm-cpu-compiled map" in full.stdout
    run = json.loads((tmp_path / "full/run.json").read_text())
    assert run["status"] == "done" and run["backend"] == "vllm" and run["engine"] == "vllm-cpu-compiled"
    record = run["vllm_engine"]
    assert record["checked"] and record["device_type"] == "cpu", record
    assert set(record["kernels"]["gemm"]) == {vllm_cpu.LIVE_GEMM}, record["kernels"]
    rows = _metrics(tmp_path / "full")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    for key in ("reward/mean", "mismatch/token/k3", "mismatch/seq/k3", "policy/entropy", "optim/grad_norm"):
        assert all(key in r for r in rows), key
    assert any(r["optim/grad_norm"] > 0 for r in rows)  # the policy really trains
    assert all(0 <= r["mismatch/token/k3"] < 1e-2 for r in rows)  # bf16-level mismatch, not a broken engine

    cut = tmp_path / "cut"
    proc = subprocess.Popen(_cli(sft_model, cut, 5), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:  # preempt once step 3 is logged (checkpoint: 2)
        if (cut / "metrics.jsonl").is_file() and len((cut / "metrics.jsonl").read_text().splitlines()) >= 3:
            proc.send_signal(signal.SIGTERM)
            break
        time.sleep(0.2)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 143, out[-3000:]
    assert json.loads((cut / "run.json").read_text())["status"] == "preempted"
    again = subprocess.run(_cli(sft_model, cut, 5), env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert json.loads((cut / "run.json").read_text())["resumed_from"]
    assert _metrics(cut) == rows
