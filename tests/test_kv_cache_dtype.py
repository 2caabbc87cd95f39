"""The emulated engine's fp8 KV cache (vLLM's ``kv_cache_dtype``; the stress experiment's dose): the round trip
against an independent float64 formula of fp8 rounding, bitwise; quantized K/V reach prefill and decode alike;
the mismatch it adds; choices and errors."""

import numpy as np
import pytest
import torch
from conftest import random_qwen

from roundalign.training.config import ConfigError, build_config
from roundalign.engine import Engine, EngineModel, KVCache
from roundalign.engine.choices import KV_CACHE_DTYPES
from roundalign.engine.model import fp8_kv_roundtrip

torch.set_num_threads(1)

# (mantissa bits, exponent bias, largest finite value) from the OCP 8-bit floating point spec (E4M3 without
# infinities: the largest finite value is 1.75 * 2^8; E5M2 IEEE-like: 1.75 * 2^15)
FORMATS = {"fp8_e4m3": (3, 7, 448.0), "fp8_e5m2": (2, 15, 57344.0)}


def reference_fp8(x: np.ndarray, kv_cache_dtype: str) -> np.ndarray:
    """Round float64 values to the fp8 grid, nearest-even, saturating at the largest finite value (CUDA's
    __nv_cvt_float_to_fp8 with __NV_SATFINITE), written from the format's definition: below the smallest
    normal exponent the spacing stays 2^(1 - bias - mantissa) (subnormals)."""
    mant, bias, finite_max = FORMATS[kv_cache_dtype]
    out = np.empty_like(x)
    for i, v in enumerate(x):
        if np.isnan(v):
            out[i] = np.nan
            continue
        a = abs(v)
        if a == 0 or a >= finite_max:
            out[i] = np.copysign(min(a, finite_max), v)
            continue
        e = max(int(np.floor(np.log2(a))), 1 - bias)
        quantum = 2.0 ** (e - mant)
        r = np.rint(a / quantum) * quantum  # np.rint: ties to even
        out[i] = np.copysign(min(r, finite_max), v)
    return out


def bf16_values(n=20000, seed=0):
    g = torch.Generator().manual_seed(seed)
    # magnitudes over both formats' whole range (subnormals to beyond the largest finite value) and signs
    mags = torch.exp2(torch.empty(n).uniform_(-20, 18, generator=g))
    x = (mags * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)).to(torch.bfloat16)
    special = torch.tensor([0.0, -0.0, 448.0, 464.0, 480.0, -500.0, 57344.0, 61440.0, 1e30, float("inf"),
                            -float("inf"), float("nan"), 2.0 ** -9, 2.0 ** -10, 1.5 * 2.0 ** -10, 2.0 ** -16,
                            2.0 ** -17, 3 * 2.0 ** -17, 1.0625, 1.1875, 1.125, 1.375], dtype=torch.bfloat16)
    return torch.cat((x, special))


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_roundtrip_equals_the_rounding_formula_bitwise(kv_cache_dtype):
    x = bf16_values()
    got = fp8_kv_roundtrip(x, kv_cache_dtype)
    assert got.dtype == torch.bfloat16
    ref = torch.from_numpy(reference_fp8(x.double().numpy(), kv_cache_dtype)).to(torch.bfloat16)
    same = (got == ref) | (got.isnan() & ref.isnan())
    assert bool(same.all()), x[~same][:10].tolist()
    # the rounding is real: most random values move, none beyond half a quantum, and saturation holds
    finite = x.isfinite() & (x.float().abs() <= FORMATS[kv_cache_dtype][2])
    assert (got[finite] != x[finite]).float().mean() > 0.5
    assert got[x == float("inf")].item() == FORMATS[kv_cache_dtype][2]
    assert got[x.isnan()].isnan().all()
    # ties go to even: 1 + 1/16 sits between 1 and 1.125 on e4m3's grid (3 mantissa bits) -> 1
    if kv_cache_dtype == "fp8_e4m3":
        assert fp8_kv_roundtrip(torch.tensor([1.0625, 1.1875], dtype=torch.bfloat16), kv_cache_dtype).tolist() == \
            [1.0, 1.25]


def test_auto_is_the_identity_and_fp32_values_are_quantized_too():
    x = bf16_values(100)
    assert fp8_kv_roundtrip(x, "auto") is x
    y = torch.randn(50, dtype=torch.float32)
    q = fp8_kv_roundtrip(y, "fp8_e4m3")
    assert q.dtype == torch.float32
    assert torch.equal(q, torch.from_numpy(reference_fp8(y.double().numpy(), "fp8_e4m3")).float())


@pytest.mark.parametrize("engine", ["vllm-compiled", "vllm-eager"])
def test_prefill_and_decode_both_read_quantized_kv(engine):
    """vLLM V1 writes a step's K/V into the cache before attention reads them, so a prefill attends to the
    quantized values too: one prefill of 9 tokens equals prefill 5 + 4 decode steps, bitwise, and differs from
    the bf16 cache."""
    model = random_qwen("qwen3")
    em = EngineModel(model, engine=engine, kv_cache_dtype="fp8_e5m2")
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    full = em.forward(ids, em.new_cache())
    cache = em.new_cache()
    assert cache.kv_cache_dtype == "fp8_e5m2"
    steps = [em.forward(ids[:, :5], cache)] + [em.forward(ids[:, t:t + 1], cache) for t in range(5, 9)]
    assert torch.equal(torch.cat(steps, dim=1), full)
    # what the cache holds is on the fp8 grid
    k = cache.k[0]
    assert torch.equal(k, fp8_kv_roundtrip(k, "fp8_e5m2"))
    bf16 = EngineModel(model, engine=engine).forward(ids, KVCache(len(em.layers)))
    assert not torch.equal(bf16, full)


def test_fp8_kv_cache_raises_the_engine_trainer_mismatch_in_order():
    """The dose: per-token mean |delta logp| against the (stock) trainer grows auto < e4m3 < e5m2."""
    model = random_qwen("qwen3")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 128, (12,), generator=g).tolist() for _ in range(6)]
    err = {}
    for dt in KV_CACHE_DTYPES:
        samples = Engine(model, kv_cache_dtype=dt).generate(prompts, max_new_tokens=12, seed=0)
        diffs = []
        for s in samples:
            ids = torch.tensor(s.prompt_ids + s.completion_ids).unsqueeze(0)
            with torch.no_grad():
                lg = model(input_ids=ids).logits[0, len(s.prompt_ids) - 1:-1].float()
            lp = torch.log_softmax(lg, -1).gather(-1, torch.tensor(s.completion_ids)[:, None])[:, 0]
            diffs.append((lp - s.logprobs).abs())
        err[dt] = torch.cat(diffs).mean().item()
    assert err["auto"] < err["fp8_e4m3"] < err["fp8_e5m2"], err
    print(f"\nmean |delta logp| vs the stock trainer: {err}")


def test_unknown_kv_cache_dtype_names_the_choices():
    model = random_qwen("qwen2")
    with pytest.raises(ValueError, match="auto, fp8_e4m3, fp8_e5m2"):
        EngineModel(model, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="auto, fp8_e4m3, fp8_e5m2"):
        KVCache(2, "int8")
    with pytest.raises(ConfigError, match="engine_kv_cache_dtype='fp16'.*auto, fp8_e4m3, fp8_e5m2"):
        build_config(overrides={"model": "m", "engine_kv_cache_dtype": "fp16"})
    with pytest.raises(ConfigError, match="engine_kv_cache_dtype=fp8_e4m3 is not used.*backend emulated"):
        build_config(overrides={"model": "m", "backend": "vllm", "engine_kv_cache_dtype": "fp8_e4m3"})
