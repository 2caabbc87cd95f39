"""Which rounding style each region uses, for an engine mode and an alignment variant.

A ``RoundingPlan`` is the whole answer to "where does this forward pass round?". The engine
emulation runs ``plan_for(engine, "full")``; a trainer aligned with variant V runs ``plan_for(engine, V)``;
``baseline`` is Hugging Face's eager numerics everywhere.

Engine modes (rows of the table in ``docs/numerics.md``):

=================  ==========  ==========  ======================================  ==========================
engine             RoPE        SwiGLU      residual add -> RMSNorm                 Qwen3 q/k norm -> RoPE
=================  ==========  ==========  ======================================  ==========================
vllm-compiled      1 rounding  1 rounding  fp32 sum read, out 1 round; fp32 stream  fused: fp32 into RoPE
                                           inside a piece (rounded at attention)
vllm-eager         1 rounding  as HF (2)   bf16 sum read, out 1 round              split: 1 + 1 round
vllm-cpu-compiled  1 rounding  1 rounding  fp32 sum read, out 1 round; the stream  fused: fp32 into RoPE
                                           is never rounded (one graph)
vllm-cpu-eager     1 (toward   as HF (2)   fp32 sum read, out as HF (2 roundings); split: HF norm + 1 round
                   zero on                 the stored stream rounded
                   AVX2/512)
=================  ==========  ==========  ======================================  ==========================

The two ``vllm-cpu-*`` rows are vLLM 0.31.0's CPU build (``vllm-cpu``): compiled, its platform compiles the
whole model as one Inductor graph with attention an opaque op inside it (``vllm/platforms/cpu.py``,
``CompilationMode.DYNAMO_TRACE_ONCE``, no splitting ops), so no value is stored between layers but what enters
a GEMM or attention; eager, it runs the native formulas uncompiled (RMSNorm, SiLU-and-mul) and the C++
``rotary_embedding`` kernel (fp32 inside; its result truncated to bf16 by the AVX2 and AVX-512 builds,
rounded to nearest by the AVX-512-BF16 build: ``cpu_rope_rounding``). Measured against the real engine: ``tests/vllm_cpu/test_real_engine.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

from roundalign.numerics.engines import CPU_ENGINES, ENGINES, GPU_ENGINES, spec  # noqa: F401 (re-exported)

# where each residual mode keeps the unrounded sum of the residual stream (RoundingPlan.residual)
RESIDUALS = ("bf16", "fp32", "fp32-read", "fp32-stream")
#: how the fp32 regions run (``apply_alignment(kernels=...)``, ``regions.region_kernels``): separate torch ops, or
#: one Inductor kernel per region
KERNEL_MODES = ("eager", "compiled")
VARIANTS = ("baseline", "rope", "swiglu", "norm", "full")


def default_kernel_mode(engine: str, fp32: bool = False) -> str:
    """The region kernel mode that matches ``engine`` (``apply_alignment``'s and ``TrainConfig``'s default):
    ``compiled`` against vLLM-CPU's compiled engine on a bf16/fp16 model, whose graph is Inductor's too, ``eager``
    otherwise (the exact reference, and the only mode that is a bitwise no-op on an fp32 model). With the
    engine's norm reduction orders both modes are bitwise against the compiled engine; compiled kernels are the
    cheaper there."""
    return spec(engine).region_kernels if not fp32 else "eager"


@dataclass(frozen=True)
class RoundingPlan:
    """Rounding style per region.

    Attributes:
        rope: "hf" (3 roundings), "fused" (fp32 inside, 1 rounding to nearest) or "fused-rz" (fp32 inside,
            1 rounding toward zero: vLLM-CPU's C++ kernel truncates its fp32 result to bf16).
        swiglu: "hf" (silu rounded, product rounded) or "fused" (1 rounding).
        norm: "hf" (normalized value rounded, then bf16 weight multiply) or "fused" (1 rounding).
            Covers every RMSNorm: input/post-attention norms, final norm, Qwen3 q/k norms.
        residual: What a norm after a residual add reads, and where the unrounded sum lives on:
            "bf16": the rounded sum (HF; vLLM's eager CUDA ``fused_add_rms_norm``);
            "fp32-read": the unrounded fp32 sum; the stored residual is the sum rounded once, and the next
            add reads that (vLLM's native ``fused_add_rms_norm`` run eagerly: vLLM-CPU eager);
            "fp32": the unrounded sum, and the post-attention sum stays fp32 into the MLP-side add; the
            layer-input sum is rounded once where it crosses an attention call (vLLM's piecewise compile);
            "fp32-stream": the residual stream is never rounded, across every layer into the final norm
            (vLLM-CPU's one-graph compile: nothing splits the graph at attention).
        qk_norm_rope: Qwen3 only. "split": the q/k norm output is rounded before RoPE;
            "fused": it stays fp32 into RoPE and only RoPE's output is rounded.
    """

    rope: str = "hf"
    swiglu: str = "hf"
    norm: str = "hf"
    residual: str = "bf16"
    qk_norm_rope: str = "split"

    def __post_init__(self):
        for name, allowed in (("rope", ("hf", "fused", "fused-rz")), ("swiglu", ("hf", "fused")), ("norm", ("hf", "fused")),
                              ("residual", RESIDUALS), ("qk_norm_rope", ("split", "fused"))):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"RoundingPlan.{name}={value!r}, expected one of {list(allowed)}")
        if self.residual in ("fp32", "fp32-stream") and self.norm != "fused":
            raise ValueError(f"RoundingPlan: residual={self.residual!r} needs norm='fused' (a compiled engine "
                             "fuses the norm that reads the fp32 sum)")
        if self.qk_norm_rope == "fused" and (self.norm, self.rope) != ("fused", "fused"):  # fused-rz is eager
            raise ValueError("RoundingPlan: qk_norm_rope='fused' needs both norm and rope 'fused'")

    @property
    def aligns_norm(self) -> bool:
        """Whether any RMSNorm or residual add departs from HF (the decoder layers and norms get patched)."""
        return self.norm == "fused" or self.residual != "bf16"

    @property
    def is_hf(self) -> bool:
        return self == RoundingPlan()


def cpu_kernel_build() -> str:
    """Which of vllm-cpu 0.31.0's x86 kernel libraries this machine loads, decided as vLLM decides it
    (``CpuPlatform.import_kernels``, vllm/platforms/cpu.py:612-643): ``_C`` (AVX-512 with BF16, AMX builds),
    ``_C_AVX512`` (AVX-512 without BF16) or ``_C_AVX2``. Reads torch's CPU capability checks only, so it works
    without vLLM installed."""
    import torch  # noqa: PLC0415 -- lazy: torch, off the torch-free figures path (roundalign.analysis)

    if torch.cpu._is_avx512_supported():
        return "_C" if torch.cpu._is_avx512_bf16_supported() else "_C_AVX512"
    return "_C_AVX2"


def cpu_rope_rounding(build: str | None = None) -> str:
    """How vLLM-CPU's C++ ``rotary_embedding`` kernel writes its fp32 result to bf16 with ``build``'s vector
    conversion (csrc/cpu/cpu_types_x86.hpp: ``BF16Vec8(FP32Vec8)``): ``_mm256_cvtneps_pbh`` (round to nearest
    even) in ``_C``; a shift that drops the low 16 bits (toward zero) in ``_C_AVX512`` and ``_C_AVX2``. Its scalar
    tail rounds to nearest, but it only runs when ``head_dim / 2`` is not a multiple of 8, which no head size
    vLLM's CPU attention supports has (all are multiples of 16). Products of bf16 values are exact in fp32,
    so the builds' FMA contraction changes nothing."""
    return "fused" if (build or cpu_kernel_build()) == "_C" else "fused-rz"


def check_engine(engine: str) -> str:
    spec(engine)  # a ValueError naming the registered engines
    return engine


def check_variant(variant: str) -> str:
    if variant not in VARIANTS:
        raise ValueError(f"unknown alignment variant {variant!r}; valid variants: {', '.join(VARIANTS)}")
    return variant


def engine_plan(engine: str) -> RoundingPlan:
    """Where the engine rounds, in every region (its registry record's ``plan``; RoPE for the kernel build this machine
    loads where the record says it depends on it: vLLM-CPU eager)."""
    s = spec(engine)
    return RoundingPlan(**{**s.plan, "rope": cpu_rope_rounding()} if s.rope_from_cpu_build else s.plan)


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
