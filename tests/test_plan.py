"""The rounding plans (roundalign.numerics.plan): what ``RoundingPlan`` accepts and refuses, the vLLM-CPU kernel build
and its RoPE rounding, and which regions of the engine's plan each variant copies. Each test states one behaviour with
real values; all are fast (no slow marker): the first tier of ``make mutation`` runs them."""

import pytest
import torch

from roundalign.numerics import plan
from roundalign.numerics.plan import ENGINES, RoundingPlan, engine_plan, plan_for


def test_rounding_plan_accepts_every_documented_value_and_names_what_it_refuses():
    RoundingPlan(rope="fused-rz")
    RoundingPlan(rope="fused", norm="fused", qk_norm_rope="fused")
    for residual in ("fp32", "fp32-stream"):
        RoundingPlan(norm="fused", residual=residual)
        with pytest.raises(ValueError, match=rf"^RoundingPlan: residual='{residual}' needs norm='fused' \(a compiled "
                                             r"engine fuses the norm that reads the fp32 sum\)$"):
            RoundingPlan(residual=residual)
    with pytest.raises(ValueError, match=r"^RoundingPlan.swiglu='fp32', expected one of \['hf', 'fused'\]$"):
        RoundingPlan(swiglu="fp32")
    with pytest.raises(ValueError, match=r"^RoundingPlan: qk_norm_rope='fused' needs both norm and rope 'fused'$"):
        RoundingPlan(rope="fused-rz", norm="fused", qk_norm_rope="fused")


@pytest.mark.parametrize("avx512,bf16,build,rope", [(True, True, "_C", "fused"), (True, False, "_C_AVX512", "fused-rz"),
                                                    (False, True, "_C_AVX2", "fused-rz")])
def test_cpu_kernel_build_and_its_rope_rounding(monkeypatch, avx512, bf16, build, rope):
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: avx512)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16)
    assert plan.cpu_kernel_build() == build
    assert plan.cpu_rope_rounding() == rope == plan.cpu_rope_rounding(build)
    assert plan.engine_plan("vllm-cpu-eager").rope == rope
    assert plan.cpu_rope_rounding("_C") == "fused" and plan.cpu_rope_rounding("_C_AVX2") == "fused-rz"


def test_each_variant_copies_exactly_its_regions_of_the_engine_plan():
    """plan_for: "full" is the engine's plan; each single-region variant copies that region only (the rest HF)."""
    for engine in ENGINES:
        eng = engine_plan(engine)
        assert plan_for(engine, "full") == eng and plan_for(engine, "baseline") == RoundingPlan()
        assert plan_for(engine, "rope") == RoundingPlan(rope=eng.rope)
        assert plan_for(engine, "swiglu") == RoundingPlan(swiglu=eng.swiglu)
        assert plan_for(engine, "norm") == RoundingPlan(norm=eng.norm, residual=eng.residual)
        assert eng != RoundingPlan(norm=eng.norm, residual=eng.residual), engine  # so "full" is not "norm"
