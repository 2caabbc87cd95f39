"""``roundalign probe --backend vllm`` on the CPU: the real engine (vLLM's CPU build) samples and scores
teacher-forced, the trainer variants rescore, and the emulated engine sits beside it, layer by layer."""

import json
import subprocess
import sys

import pandas as pd
import pytest
import torch

from roundalign.bridge import vllm_cpu_attention
from roundalign.models.tiny import make_tiny


@pytest.fixture(scope="module")
def tiny_d32(tmp_path_factory):
    # head_dim 32: the smallest head size vLLM's CPU attention kernel supports (16, our default tiny size, is refused)
    return make_tiny("qwen3", tmp_path_factory.mktemp("m") / "tiny-qwen3-d32", hidden=128, layers=2, heads=4,
                     kv_heads=2, tie=False, seed=5)


def _probe(model, out, *extra):
    cmd = [sys.executable, "-m", "roundalign", "probe", "--backend", "vllm", "--model", str(model), "--out", str(out),
           "--prompts", "3", "--max-new-tokens", "6", "--variants", "baseline,full", *extra]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


def _metric(csv, variant, metric, level="token"):
    t = pd.read_csv(csv)
    return float(t.query("variant == @variant and metric == @metric and level == @level")["value"].iloc[0])


def test_probe_against_the_real_eager_engine_with_its_attention_kernel(tiny_d32, tmp_path):
    out = tmp_path / "p.csv"
    log = _probe(tiny_d32, out, "--engine", "vllm-cpu-eager", "--attn", "vllm_cpu", "--trainer-attn", "vllm_cpu")
    forced = out.with_name("p_teacher_forced.csv")
    # teacher-forced (one prefill, as the trainer scores): full is bitwise, baseline is not
    assert _metric(forced, "full", "tokens_exact_frac") == 1.0 and _metric(forced, "full", "mismatch_k3") == 0.0
    assert _metric(forced, "baseline", "tokens_exact_frac") < 0.5
    # the emulated eager CPU engine with vLLM's attention kernel equals the real engine after every layer
    layers = pd.read_csv(out.with_name("p_engine_layers.csv"))
    exact = layers.query("metric == 'hidden_exact_frac'")["value"]
    assert len(exact) == 2 and (exact == 1.0).all(), layers
    # and the trainer's per-layer error against the real engine: 0 for full in every layer
    tl = pd.read_csv(out.with_name("p_teacher_forced_layers.csv"))
    assert (tl.query("variant == 'full'")["value"] == 0).all() and (tl.query("variant == 'baseline'")["value"] > 0).any()
    meta = json.loads(out.with_suffix(".json").read_text())
    eng = meta["vllm_engine"]
    assert eng["device_type"] == "cpu" and eng["compilation_mode"] == "NONE" and meta["trainer_attn"] == "vllm_cpu"
    isa = vllm_cpu_attention.attn_isa(torch.bfloat16, vllm_cpu_attention.DEFAULT_BLOCK_SIZE, 32)
    assert eng["kernels"]["inspected"] and eng["kernels"]["attention_backend"] == {"CPUAttentionBackendImpl": [isa]}
    # sampled tokens: vLLM decodes them through its KV cache; the sampled table exists for every variant
    sampled = pd.read_csv(out)
    assert set(sampled["variant"]) == {"baseline", "full"}
    assert "sampled tokens" in log and "teacher-forced" in log


def test_probe_refuses_a_gpu_map_on_cpu_torch_naming_the_cpu_targets(tiny_d32, tmp_path):
    cmd = [sys.executable, "-m", "roundalign", "probe", "--backend", "vllm", "--model", str(tiny_d32),
           "--engine", "vllm-compiled", "--out", str(tmp_path / "p.csv")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode != 0
    assert "CPU-only build" in res.stderr and "vllm-cpu-compiled" in res.stderr, res.stderr[-2000:]
    assert not (tmp_path / "p.csv").exists()
