"""``roundalign attribute`` against the real engine, vLLM 0.31.0's CPU build: the waterfall ends at k3 = 0, bitwise,
in eager and compiled mode, once every source is equalized; each source this CPU shows loses its share when its
equalization is undone; the sources it does not show (decode, gemm) are exactly zero, with the engine's own GEMM
kernel checked to be running; and the users' effects of tools/studies/user_effects.py (top-p without renormalisation,
the trainer's micro-batch, temperature on one side) hold. The emulated engine's twin: tests/test_attribute.py."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from roundalign.bridge.vllm_internals import cpu_gemm_utils
from roundalign.models.tiny import make_tiny
from roundalign.probes import attribute as A

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # head_dim 32: the smallest head size vLLM's CPU attention kernel supports
    return str(make_tiny("qwen3", tmp_path_factory.mktemp("m") / "q3", hidden=128, layers=2, heads=4, kv_heads=2,
                         tie=False, seed=5))


def _run(model_dir, out, **over):
    cfg = A.AttributeConfig(model=model_dir, backend="vllm", num_prompts=6, max_new_tokens=12, num_resamples=50,
                            **over)
    rows = A.run_attribute(cfg, out, log=lambda *_: None)
    return {(r["step"], r["source"], r["mode"], r["metric"]): r["value"] for r in rows}


def _final(table, metric):
    last = max(step for step, _, mode, _ in table if mode == "cumulative")
    return next(v for (s, _, mode, m), v in table.items() if s == last and mode == "cumulative" and m == metric)


def _share(table, source, mode="cumulative"):
    return next(v for (_, s, md, m), v in table.items() if s == source and md == mode and m == "k3_removed")


@pytest.fixture(scope="module")
def eager(model_dir, tmp_path_factory):
    return _run(model_dir, tmp_path_factory.mktemp("eager"), engine="vllm-cpu-eager")


@pytest.mark.parametrize("engine", ["vllm-cpu-eager", "vllm-cpu-compiled"])
def test_the_waterfall_ends_at_zero_bitwise_against_the_real_engine(eager, model_dir, tmp_path, engine):
    table = eager if engine == "vllm-cpu-eager" else _run(model_dir, tmp_path, engine=engine)
    assert table[(0, "none", "cumulative", "k3")] > 1e-6
    assert _final(table, "k3") == 0.0 and _final(table, "exact_frac") == 1.0
    sources = [s for (step, s, mode, m) in sorted(table) if mode == "cumulative" and m == "k3" and step > 0]
    # real vLLM 0.31.0 has no fp32 head, and its KV cache is not varied here
    assert sources == ["sampling", "decode", "positions", "batching", "gemm", "attention", "rounding"]


def test_cli_writes_the_three_files_and_names_each_source(model_dir, tmp_path):
    res = subprocess.run([sys.executable, "-m", "roundalign", "attribute", "--model", model_dir, "--engine",
                          "vllm-cpu-eager", "--out", str(tmp_path), "--prompts", "3", "--max-new-tokens", "6",
                          "--resamples", "20"], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert {p.name for p in tmp_path.iterdir()} >= {"attribution.csv", "attribution.json", "waterfall.png"}
    for source in ("sampling", "decode", "positions", "batching", "gemm", "attention", "rounding"):
        assert f"cumulative {source:>9}" in res.stdout
    assert "lm_head: absent" in res.stdout
    meta = json.loads((tmp_path / "attribution.json").read_text())
    assert meta["engine_settings"]["kernels"]["gemm"] and meta["engine_settings"]["gemm"] == "native"


@pytest.mark.parametrize("source", ["sampling", "positions", "attention", "rounding"])
def test_negative_control_on_the_real_engine(eager, model_dir, tmp_path, source):
    # what this CPU shows: the source removes something (alone, against nothing equalized); undone, its step
    # removes exactly nothing and the waterfall stops short of bitwise (sampling: TRL's fp32 log-softmax is ~1e-7
    # nats from vLLM's sampler's, so k3 stays near 1e-13 and tokens are not exact)
    assert _share(eager, source, "alone") != 0.0
    undone = _run(model_dir, tmp_path, engine="vllm-cpu-eager", undo=(source,))
    assert _share(undone, source) == 0.0 and _share(undone, source, "alone") == 0.0
    if source != "positions":  # the unpadded layout of the batching step starts every sequence at 0 by itself
        assert _final(undone, "exact_frac") < 1.0 and _final(undone, "k3") > 0.0


def test_decode_and_gemm_are_exactly_zero_on_this_cpu_with_the_engines_own_gemm_running(eager):
    # This CPU's vLLM decodes each token with the logprob a prefill gives it, and its prepacked GEMM equals
    # F.linear at the trainer's shapes: neither source removes anything here. Their negative controls run where
    # they are present, on the emulated engine (tests/test_attribute.py: decode with another attention kernel,
    # split-K GEMMs). That the gemm step runs vLLM's own kernel, not F.linear again, is checked below.
    assert _share(eager, "decode", "alone") == 0.0 and _share(eager, "gemm", "alone") == 0.0


def test_the_gemm_equalization_runs_vllms_own_kernel(monkeypatch):
    """The equalized trainer linear is vLLM-CPU's own GEMM, whichever kernel its dispatch picks on this CPU (SGL's
    AMX-packed ``weight_packed_linear_cpu`` where ``check_cpu_sgl_kernel`` allows it, else oneDNN's ``onednn_mm``
    where oneDNN can build a bf16 matmul, else its own fallback, ``torch.nn.functional.linear``: an AVX2 CPU without
    AVX-512, where ``create_onednn_mm`` raises), not F.linear in disguise: the op is seen running, and its output is
    that op's on a freshly packed weight."""
    U = cpu_gemm_utils()
    ops, N, K = U.ops, 128, 1024
    if U.current_platform.is_zen_cpu() and hasattr(torch.ops, "zentorch"):
        pytest.skip("zentorch is installed: vLLM dispatches this CPU's GEMMs to zentorch, which this test does not cover")
    torch.manual_seed(0)
    lin = torch.nn.Linear(K, N, bias=False).to(torch.bfloat16)
    w = lin.weight.detach().clone()
    # the kernel, decided as vLLM's dispatch_cpu_unquantized_gemm decides it (utils.py of 0.31.0), from the ops
    if U.check_cpu_sgl_kernel(N, K, torch.bfloat16):
        kernel = "weight_packed_linear_cpu"
        reference = lambda x: ops.weight_packed_linear_cpu(x, torch.ops._C.convert_weight_packed(w), N, None)
    else:
        assert ops._supports_onednn, "this vLLM build has neither SGL's packed GEMM for this shape nor oneDNN"
        try:
            handler = ops.create_onednn_mm(w.t(), 32)
            kernel, reference = "onednn_mm", lambda x: ops.onednn_mm(handler, x, None)
        except RuntimeError:  # "could not create a primitive descriptor for the matmul primitive" (AVX2)
            kernel, reference = "linear", lambda x: torch.nn.functional.linear(x, w)
    calls = []
    for owner, name in ((ops, "weight_packed_linear_cpu"), (ops, "onednn_mm"), (torch.nn.functional, "linear")):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    fwd = A._vllm_cpu_gemm(lin)
    x = torch.randn(20, K, dtype=torch.bfloat16)
    got = fwd(x)
    assert calls == [kernel], (calls, kernel)
    monkeypatch.undo()
    assert torch.equal(got, reference(x))
    # measured on three CPU kinds (AMD EPYC with AVX-512 and Intel with AMX: oneDNN at this shape; AMD EPYC with AVX2
    # only: vLLM's F.linear fallback): at the trainer's M it is bitwise F.linear
    assert torch.equal(got, torch.nn.functional.linear(x, lin.weight))


def test_users_effects(model_dir, tmp_path):
    out = tmp_path / "effects.json"
    res = subprocess.run([sys.executable, "-m", "tools.studies.user_effects", "--model", model_dir, "--out", str(out),
                          "--prompts", "12", "--max-new-tokens", "12"], cwd=ROOT, capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    e = json.loads(out.read_text())
    top_p = {(r["top_p"], r["top_k"]): r for r in e["top_p_top_k"]}
    # without renormalisation the trainer's logprob of every kept token is below the engine's: IS ratio < 1, the
    # further below the smaller top_p; vLLM's processed logprobs bring it back to about 1
    r9, r7 = top_p[(0.9, 0)], top_p[(0.7, 0)]
    assert r7["trl_recompute"]["is_ratio_mean"] < r9["trl_recompute"]["is_ratio_mean"] < 0.97
    assert r9["trl_recompute"]["seq_log_ratio"] < 0 and r7["trl_recompute"]["seq_log_ratio"] < 0
    for r in top_p.values():
        assert abs(r["vllm_processed"]["is_ratio_mean"] - 1) < abs(r["trl_recompute"]["is_ratio_mean"] - 1)
        # the trainer's own top-k/top-p set can leave out a sampled token (logits differ at the set's edge): rare
        assert r["trl_recompute"]["excluded_tokens"] == 0
        assert r["vllm_processed"]["excluded_tokens"] <= 0.05 * r["vllm_processed"]["num_tokens"]
    # this CPU: the micro-batch size changes no bit; left padding with positions counted from the first column does
    mb = e["micro_batch"]
    assert mb["mb1_vs_mb8_padded"]["exact_frac"] == 1.0 and mb["mb1_vs_mb8_padded"]["max_abs_dlogp"] == 0.0
    assert mb["padded_vs_unpadded"]["max_abs_dlogp"] > 1e-3
    assert mb["padded_positions_from_mask_vs_unpadded"]["abs_dlogp"] < mb["padded_vs_unpadded"]["abs_dlogp"]
    # temperature on one side: more than 10x the mismatch of both sides at T
    t = e["temperature"]
    assert t["trainer_T1"]["k3"] > 10 * t["both_sides"]["k3"]
