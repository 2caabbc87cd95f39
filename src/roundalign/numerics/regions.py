"""The three regions where a BF16 trainer and a BF16 inference engine round differently, each written
in both rounding styles.

Two styles per region (see ``shared/design/numerics.md`` and ``docs/numerics.md``):

- ``*_hf``: what Hugging Face transformers' eager Qwen2/Qwen3 modules compute. Every elementwise op
  runs in the activation dtype, so each intermediate is rounded to bf16.
- ``*_fused``: what one fused kernel computes: upcast the bf16 inputs to fp32, do the whole region in
  fp32, round once where the kernel writes its output. This is vLLM's default compiled path
  (Inductor drops the intermediate down-casts of the ``forward_native`` formulas) and, for RoPE and
  RMSNorm, also its eager CUDA ops.

The formulas below keep the operation order of vLLM's ``forward_native`` code (``x * rsqrt(var + eps)``
then ``* weight``; ``x1 * cos - x2 * sin``). In fp32 every ``*_fused`` function is therefore bitwise
equal to its ``*_hf`` twin, which is why alignment is a no-op on fp32 models. All functions are plain
differentiable torch ops: autograd through them is exact for the formula as written.

Shapes: ``x`` is ``(..., D)``; ``cos``/``sin`` broadcast against it (``(..., D)``, neox layout: the
two rotated halves are ``x[..., :D/2]`` and ``x[..., D/2:]``); norm weights are ``(D,)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "rope_hf",
    "rope_fused",
    "swiglu_hf",
    "swiglu_fused",
    "rmsnorm_hf",
    "rmsnorm_fused",
    "add_rmsnorm_fp32_sum",
    "add_rmsnorm_bf16_sum",
]


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_hf(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """HF ``apply_rotary_pos_emb`` on one tensor: ``x*cos + rotate_half(x)*sin`` in x's dtype.

    Three roundings in bf16: each product, then the sum."""
    return (x * cos) + (_rotate_half(x) * sin)


def rope_fused(x: Tensor, cos: Tensor, sin: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
    """vLLM ``_apply_rotary_emb_torch`` (neox) in fp32 with one rounding to ``out_dtype``.

    ``x`` may be bf16 (then each product of two bf16 values is exact in fp32, so only the sum is
    rounded, once, and an FMA would give the same bits) or fp32 (Qwen3's q/k norm output kept in
    fp32 by a fused norm+RoPE kernel). ``cos``/``sin`` are the model's bf16 tables, upcast exactly.
    ``out_dtype`` defaults to the dtype of ``cos`` (the model dtype)."""
    out_dtype = cos.dtype if out_dtype is None else out_dtype
    xf, cf, sf = x.float(), cos.float(), sin.float()
    half = x.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    c1, c2 = cf[..., :half], cf[..., half:]
    s1, s2 = sf[..., :half], sf[..., half:]
    o1 = x1 * c1 - x2 * s1
    o2 = x2 * c2 + x1 * s2
    return torch.cat((o1, o2), dim=-1).to(out_dtype)


def swiglu_hf(gate: Tensor, up: Tensor) -> Tensor:
    """HF ``act_fn(gate_proj(x)) * up_proj(x)``: silu output rounded, then the product rounded."""
    return F.silu(gate) * up


def swiglu_fused(gate: Tensor, up: Tensor) -> Tensor:
    """vLLM ``SiluAndMul.forward_native`` compiled: ``silu(gate) * up`` in fp32, one rounding."""
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def rmsnorm_hf(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF ``Qwen2RMSNorm.forward``: normalized value rounded to x's dtype, then a bf16 multiply."""
    input_dtype = x.dtype
    xf = x.to(torch.float32)
    variance = xf.pow(2).mean(-1, keepdim=True)
    xf = xf * torch.rsqrt(variance + eps)
    return weight * xf.to(input_dtype)


def rmsnorm_fused(x: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype | None = None,
                  keep_fp32: bool = False) -> Tensor:
    """vLLM ``RMSNorm`` native formula with the weight multiply in fp32 and one rounding.

    ``x`` may be bf16 or an fp32 value that was never rounded (the fused residual sum).
    ``out_dtype`` defaults to the weight's dtype; ``keep_fp32=True`` returns the fp32 result unrounded
    (Qwen3 q/k norm feeding RoPE inside one fused kernel)."""
    xf = x.to(torch.float32)
    variance = xf.pow(2).mean(-1, keepdim=True)
    y = xf * torch.rsqrt(variance + eps)
    y = y * weight.float()
    if keep_fp32:
        return y
    return y.to(weight.dtype if out_dtype is None else out_dtype)


def add_rmsnorm_fp32_sum(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """vLLM compiled ``RMSNorm(x, residual)``: the add happens in fp32 and the norm reads the
    UNROUNDED fp32 sum; the residual stream stored is the sum rounded once (bitwise HF's bf16 add).

    Returns ``(normed, new_residual)``, both in the weight's dtype."""
    s = x.float() + residual.float()
    return rmsnorm_fused(s, weight, eps), s.to(residual.dtype)


def add_rmsnorm_bf16_sum(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """vLLM eager ``fused_add_rms_norm``: bf16 add, the norm reads the rounded sum and rounds its
    output once. Returns ``(normed, new_residual)``."""
    s = x + residual
    return rmsnorm_fused(s, weight, eps), s


def qk_norm_rope_fused(x: Tensor, weight: Tensor, eps: float, cos: Tensor, sin: Tensor) -> Tensor:
    """Qwen3 q/k norm feeding RoPE inside one fused kernel (vLLM compiled): ``x`` (B, T, H, D) bf16 ->
    (B, H, T, D); the normalized value stays fp32 into RoPE and only RoPE's output is rounded."""
    return rope_fused(rmsnorm_fused(x, weight, eps, keep_fp32=True).transpose(1, 2), cos, sin)


# -- kernel sets ---------------------------------------------------------------------------------
# "eager": the formulas above as separate torch ops (exact, the reference; each op is a memory pass,
# so the fp32 regions cost ~10% more than HF's bf16 ops on CPU). "compiled": the same formulas through
# torch.compile (Inductor), one fused kernel per region, as vLLM's compiled engine runs them. Inductor
# may reduce the RMSNorm mean in another order (~1e-5 of elements 1 ulp apart, tests/test_inductor.py).

KERNEL_MODES = ("eager", "compiled")
_FUSED = ("rope_fused", "swiglu_fused", "rmsnorm_fused", "add_rmsnorm_fp32_sum", "add_rmsnorm_bf16_sum")
_KERNEL_CACHE: dict[str, object] = {}


def region_kernels(mode: str = "eager"):
    """Namespace of the fused region functions in ``mode`` (compiled ones are built once per process)."""
    import types

    if mode not in KERNEL_MODES:
        raise ValueError(f"unknown region kernel mode {mode!r}; valid: {', '.join(KERNEL_MODES)}")
    if mode not in _KERNEL_CACHE:
        fns = {name: globals()[name] for name in _FUSED}
        if mode == "compiled":
            fns = {name: torch.compile(fn, dynamic=True) for name, fn in fns.items()}
        _KERNEL_CACHE[mode] = types.SimpleNamespace(mode=mode, **fns)
    return _KERNEL_CACHE[mode]
