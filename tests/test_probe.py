"""The offline probe end to end through the CLI, on tiny models of both architectures."""

import json
import subprocess
import sys

import pandas as pd
import pytest
import torch

import roundalign.probes.probe as probe_mod
from roundalign.cli import main
from roundalign.models.tiny import make_tiny

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {arch: make_tiny(arch, root / f"tiny-{arch}", hidden=64, layers=2, seed=0) for arch in ("qwen2", "qwen3")}


def probe(model_dir, out, *extra):
    rc = main(["probe", "--model", str(model_dir), "--prompts", "6", "--max-new-tokens", "12", "--seed", "0",
               "--out", str(out), *extra])
    assert rc == 0
    return pd.read_csv(out), pd.read_csv(out.with_name(out.stem + "_layers.csv"))


def value(table, variant, metric, level="token"):
    row = table[(table.variant == variant) & (table.metric == metric) & (table.level == level)]
    assert len(row) == 1, (variant, metric, level)
    return float(row.value.iloc[0])


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_full_is_bitwise_on_policy_and_baseline_is_not(tiny_models, tmp_path, arch):
    table, layers = probe(tiny_models[arch], tmp_path / "probe.csv", "--attn", "eager", "--engine-gemm", "same")
    assert list(table.columns) == ["model", "engine", "variant", "level", "metric", "value"]
    assert set(table.variant) == {"baseline", "rope", "swiglu", "norm", "full"}
    assert set(table.level) == {"token", "sequence"}
    assert value(table, "full", "tokens_exact_frac") == 1.0
    assert value(table, "full", "mismatch_k3") == 0.0
    assert value(table, "full", "seqs_exact_frac", level="sequence") == 1.0
    assert value(table, "baseline", "tokens_exact_frac") < 0.5
    assert value(table, "baseline", "mismatch_k3") > 0.0
    # per-layer attribution: zero error at every layer for full, growing error for baseline
    full = layers[layers.variant == "full"].sort_values("layer")
    base = layers[layers.variant == "baseline"].sort_values("layer")
    assert (full.value == 0.0).all() and len(full) == 2
    assert (base.value > 0).all()
    meta = json.loads((tmp_path / "probe.json").read_text())
    assert meta["config"]["attn"] == "eager" and meta["env"]["versions"]["transformers"] == "5.17.0"


def test_splitk_engine_leaves_a_residual_that_full_does_not_remove(tiny_models, tmp_path):
    """A split-K engine GEMM (bf16 partials) is a mismatch source outside the three regions: ``full`` keeps
    its share (k3 > 0) and removes only the rounding-location share (k3 below baseline's). Measured on the
    tiny Qwen3 with 16-element chunks: baseline 5.0e-4, full 3.5e-4."""
    table, _ = probe(tiny_models["qwen3"], tmp_path / "p.csv", "--engine-gemm", "splitk", "--splitk-chunk", "16",
                     "--variants", "baseline,full")
    base, full = value(table, "baseline", "mismatch_k3"), value(table, "full", "mismatch_k3")
    assert 0.0 < full < base
    assert value(table, "full", "tokens_exact_frac") < 0.5


def test_bad_input_fails_before_loading(tiny_models, tmp_path, capsys):
    out = tmp_path / "x.csv"
    assert main(["probe", "--model", str(tiny_models["qwen2"]), "--variants", "baseline,ropee", "--out", str(out)]) == 2
    assert "variants: 'ropee' is not valid; choose from: baseline, rope, swiglu, norm, full" in capsys.readouterr().err
    assert main(["probe", "--model", str(tmp_path / "nope"), "--out", str(out)]) == 2
    assert "nope" in capsys.readouterr().err
    assert main(["probe", "--model", str(tiny_models["qwen2"]), "--engine", "sglang", "--out", str(out)]) == 2
    assert "vllm-compiled, vllm-eager" in capsys.readouterr().err
    assert main(["probe", "--model", str(tiny_models["qwen2"]), "--attn", "flash", "--out", str(out)]) == 2
    assert "eager, sdpa" in capsys.readouterr().err
    assert main(["probe", "--model", str(tiny_models["qwen2"]), "--norm-reduction", "fast", "--out", str(out)]) == 2
    assert "opaque, inductor" in capsys.readouterr().err
    # a setting the emulated probe does not use is refused, not dropped
    assert main(["probe", "--model", str(tiny_models["qwen2"]), "--trainer-attn", "sdpa", "--out", str(out)]) == 2
    assert "trainer_attn='sdpa' is the vllm backend's" in capsys.readouterr().err
    assert not out.exists()


def test_existing_output_survives_a_failed_run(tiny_models, tmp_path, monkeypatch):
    out = tmp_path / "keep.csv"
    out.write_text("old,complete\n")

    def boom(*a, **k):
        raise RuntimeError("simulated crash during the variants")

    monkeypatch.setattr(probe_mod, "trainer_logprobs", boom)
    assert main(["probe", "--model", str(tiny_models["qwen2"]), "--out", str(out)]) == 2
    assert out.read_text() == "old,complete\n"
    assert [p.name for p in tmp_path.iterdir()] == ["keep.csv"]  # no temp files left behind


def test_python_dash_m_entry_point(tiny_models, tmp_path):
    res = subprocess.run([sys.executable, "-m", "roundalign", "probe", "--help"], capture_output=True, text=True)
    assert res.returncode == 0 and "--engine-gemm" in res.stdout
