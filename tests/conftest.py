"""Shared fixtures: small randomly initialised Qwen2/Qwen3 models with realistic scales.

Weights ~ N(0, 1/fan_in) (activations O(1)), non-unit norm weights (lognormal, sigma 0.3), Qwen2 q/k/v
biases ~ N(0, 1): with HF's default init (std 0.02, unit norms) bf16 `weight * x` is exact and the
rounding differences under study mostly vanish.
"""

import copy

import pytest
import torch

torch.set_num_threads(1)


def random_qwen(arch: str, *, dtype=torch.bfloat16, tie=False, seed=0, hidden=64, layers=2, heads=4, kv_heads=2,
                vocab=128, attn="eager"):
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    cfg_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[arch]
    cfg = cfg_cls(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
                  vocab_size=vocab, tie_word_embeddings=tie, max_position_embeddings=4096)
    torch.manual_seed(seed)
    model = model_cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.exp(0.3 * torch.randn_like(p)))
            elif name.endswith("bias"):
                p.normal_(0.0, 1.0)
            elif "embed" in name:
                # tied: the embedding is also the LM head; unit-variance rows would give near-one-hot logits
                p.normal_(0.0, hidden ** -0.5 if tie else 1.0)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    inv_freq = model.model.rotary_emb.inv_freq.clone()
    model = model.to(dtype).eval()
    # .to(dtype) would also cast RoPE's inv_freq buffer; from_pretrained(dtype=bf16) keeps it fp32 (as vLLM does)
    model.model.rotary_emb.inv_freq = inv_freq
    model.set_attn_implementation(attn)
    return model


@pytest.fixture(params=["qwen2", "qwen3"])
def arch(request):
    return request.param


@pytest.fixture
def clone():
    return copy.deepcopy
