"""Which rounding style each region uses, for an engine mode and an alignment variant.

A ``RoundingPlan`` is the whole answer to "where does this forward pass round?". The engine
emulation runs ``plan_for(engine, "full")``; a trainer aligned with variant V runs ``plan_for(engine, V)``;
``baseline`` is Hugging Face's eager numerics everywhere.

Engine modes (rows of the table in ``docs/numerics.md``):

==============  ==========  ==========  ==========================  =============================
engine          RoPE        SwiGLU      residual add -> RMSNorm     Qwen3 q/k norm -> RoPE
==============  ==========  ==========  ==========================  =============================
vllm-compiled   1 rounding  1 rounding  fp32 sum read, out 1 round  fused: fp32 into RoPE, 1 round
vllm-eager      1 rounding  as HF (2)   bf16 sum read, out 1 round  split: 1 round + 1 round
==============  ==========  ==========  ==========================  =============================
"""

from __future__ import annotations

from dataclasses import dataclass

ENGINES = ("vllm-compiled", "vllm-eager")
VARIANTS = ("baseline", "rope", "swiglu", "norm", "full")


@dataclass(frozen=True)
class RoundingPlan:
    """Rounding style per region.

    Attributes:
        rope: "hf" (3 roundings) or "fused" (fp32 inside, 1 rounding).
        swiglu: "hf" (silu rounded, product rounded) or "fused" (1 rounding).
        norm: "hf" (normalized value rounded, then bf16 weight multiply) or "fused" (1 rounding).
            Covers every RMSNorm: input/post-attention norms, final norm, Qwen3 q/k norms.
        residual: What a norm after a residual add reads: "bf16" (the rounded sum, as HF) or
            "fp32" (the unrounded sum; the stored residual stream is still the rounded sum).
        qk_norm_rope: Qwen3 only. "split": the q/k norm output is rounded before RoPE;
            "fused": it stays fp32 into RoPE and only RoPE's output is rounded.
    """

    rope: str = "hf"
    swiglu: str = "hf"
    norm: str = "hf"
    residual: str = "bf16"
    qk_norm_rope: str = "split"

    def __post_init__(self):
        for name, allowed in (("rope", ("hf", "fused")), ("swiglu", ("hf", "fused")), ("norm", ("hf", "fused")),
                              ("residual", ("bf16", "fp32")), ("qk_norm_rope", ("split", "fused"))):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"RoundingPlan.{name}={value!r}, expected one of {list(allowed)}")
        if self.residual == "fp32" and self.norm != "fused":
            raise ValueError("RoundingPlan: residual='fp32' needs norm='fused' (only a fused norm reads the fp32 sum)")
        if self.qk_norm_rope == "fused" and (self.norm, self.rope) != ("fused", "fused"):
            raise ValueError("RoundingPlan: qk_norm_rope='fused' needs both norm and rope 'fused'")

    @property
    def is_hf(self) -> bool:
        return self == RoundingPlan()


_ENGINE_PLANS = {
    "vllm-compiled": RoundingPlan(rope="fused", swiglu="fused", norm="fused", residual="fp32", qk_norm_rope="fused"),
    "vllm-eager": RoundingPlan(rope="fused", swiglu="hf", norm="fused", residual="bf16", qk_norm_rope="split"),
}


def check_engine(engine: str) -> str:
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; valid engines: {', '.join(ENGINES)}")
    return engine


def check_variant(variant: str) -> str:
    if variant not in VARIANTS:
        raise ValueError(f"unknown alignment variant {variant!r}; valid variants: {', '.join(VARIANTS)}")
    return variant


def engine_plan(engine: str) -> RoundingPlan:
    """Where the emulated engine rounds, in every region."""
    return _ENGINE_PLANS[check_engine(engine)]


def plan_for(engine: str, variant: str) -> RoundingPlan:
    """Where a trainer aligned with ``variant`` to ``engine`` rounds.

    Each variant copies the engine's style for its regions only. The Qwen3 q/k-norm -> RoPE fusion
    is copied only when both regions are aligned: with one of them left as HF, the q/k norm output
    is rounded to bf16 at the boundary (the trainer has no fused kernel spanning the two)."""
    eng = engine_plan(engine)
    check_variant(variant)
    if variant == "baseline":
        return RoundingPlan()
    if variant == "full":
        return eng
    if variant == "rope":
        return RoundingPlan(rope=eng.rope)
    if variant == "swiglu":
        return RoundingPlan(swiglu=eng.swiglu)
    return RoundingPlan(norm=eng.norm, residual=eng.residual)  # "norm"
