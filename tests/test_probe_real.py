"""The GPU probe's vLLM path, dry-run on CPU: a stand-in ``vllm`` module whose ``LLM`` has vLLM 0.31's call
signature and output layout, and samples with the emulated engine. With equal kernels `full` must then
match the "vLLM" samples bitwise, which checks token/logprob extraction, offsets and the trainer plumbing."""

import importlib.util
import json
import sys
import types
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from roundalign.cli import main
from roundalign.engine import Engine
from roundalign.models.load import load_model
from roundalign.models.tiny import make_tiny
from test_vllm_guard import fake_llm

CALLS = {}


def fake_vllm_module(report_eager=None):
    mod = types.ModuleType("vllm")

    class SamplingParams:  # vllm/sampling_params.py field names
        def __init__(self, *, temperature, top_p, top_k, min_p, seed, max_tokens, logprobs):
            self.__dict__.update(locals())
            del self.__dict__["self"]

    class LLM:
        def __init__(self, *, model, dtype, seed, tensor_parallel_size, gpu_memory_utilization, enforce_eager,
                     max_model_len, logprobs_mode):
            CALLS["llm"] = dict(locals(), self=None)
            eager = enforce_eager if report_eager is None else report_eager
            self.llm_engine = fake_llm(eager=eager).llm.llm_engine
            self.engine = Engine(load_model(model, dtype={"bfloat16": "bf16"}[dtype]),
                                 engine="vllm-eager" if enforce_eager else "vllm-compiled")

        def generate(self, prompts, *, sampling_params, use_tqdm):
            CALLS["params"] = sampling_params
            outs = []
            for p, sp in zip(prompts, sampling_params, strict=True):
                s = self.engine.generate([p["prompt_token_ids"]], max_new_tokens=sp.max_tokens,
                                         temperature=sp.temperature, seed=sp.seed)[0]
                lps = [{t: SimpleNamespace(logprob=float(lp), rank=1)} for t, lp in zip(s.completion_ids, s.logprobs)]
                outs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=tuple(s.completion_ids),
                                                                     logprobs=lps)]))
            return outs

    mod.LLM, mod.SamplingParams = LLM, SamplingParams
    return mod


def pretend_vllm_installed(monkeypatch):
    """A stand-in vLLM of the GPU environment: importable, and beside a CUDA build of torch (the probe refuses a GPU
    map on a CPU-only torch; this dry run still runs the trainer side on the CPU, --device cpu)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    monkeypatch.setattr(torch.version, "cuda", "13.0")


def test_gpu_map_on_cpu_only_torch_is_refused_naming_the_cpu_targets(model, tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    out = tmp_path / "g.csv"
    assert main(["probe", "--backend", "vllm", "--model", model, "--engine", "vllm-eager", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "CPU-only build" in err and "vllm-cpu-eager" in err and not out.exists()


@pytest.fixture
def model(tmp_path):
    return str(make_tiny("qwen3", tmp_path / "tiny-qwen3", hidden=64, layers=2, seed=0))


def test_gpu_probe_against_stand_in_vllm_on_cpu(model, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm_module())
    pretend_vllm_installed(monkeypatch)
    out = tmp_path / "p/vllm-eager.csv"
    assert main(["probe", "--backend", "vllm", "--device", "cpu", "--model", model, "--engine", "vllm-eager",
                 "--variants", "baseline,full", "--prompts", "3", "--max-new-tokens", "5", "--out", str(out)]) == 0
    assert CALLS["llm"]["enforce_eager"] is True and CALLS["llm"]["logprobs_mode"] == "processed_logprobs"
    assert CALLS["llm"]["dtype"] == "bfloat16"
    sp = CALLS["params"]
    assert len(sp) == 3 and {(p.top_k, p.top_p, p.min_p, p.logprobs, p.max_tokens) for p in sp} == {(0, 1.0, 0.0, 0, 5)}
    for name in ("vllm-eager.csv", "vllm-eager_emulated.csv"):
        t = pd.read_csv(tmp_path / "p" / name)
        k3 = t[(t.level == "token") & (t.metric == "mismatch_k3")].set_index("variant")["value"]
        assert k3["full"] == 0 and k3["baseline"] > 0, (name, k3)
        assert set(t.engine) == {"vllm-eager"}
    layers = pd.read_csv(tmp_path / "p/vllm-eager_layers.csv")
    assert (layers[layers.variant == "full"].value == 0).all() and len(layers) == 2 * 2
    meta = json.loads((tmp_path / "p/vllm-eager.json").read_text())
    assert meta["backend"] == "vllm" and meta["vllm_engine"]["compilation_mode"] == "NONE"


def test_gpu_probe_refuses_an_engine_that_rounds_otherwise(model, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm_module(report_eager=True))  # asked compiled, runs eager
    pretend_vllm_installed(monkeypatch)
    out = tmp_path / "q.csv"
    assert main(["probe", "--backend", "vllm", "--device", "cpu", "--model", model, "--engine", "vllm-compiled",
                 "--variants", "full", "--prompts", "1", "--max-new-tokens", "2", "--out", str(out)]) == 2
    assert "does not round the way the alignment for 'vllm-compiled' assumes" in capsys.readouterr().err
    assert not out.exists()


def test_gpu_probe_without_vllm_says_so(model, tmp_path, capsys):
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    assert main(["probe", "--backend", "vllm", "--model", model, "--out", str(tmp_path / "x.csv")]) == 2
    assert "needs vLLM" in capsys.readouterr().err
