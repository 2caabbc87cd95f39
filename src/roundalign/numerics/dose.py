"""A rounding dose at the aligned regions: the engine rounds the regions' outputs to fewer mantissa bits than bf16.

What it is for (docs/prereg-dose.md): the paper's claim is that where the
two stacks round decides how off-policy an "on-policy" update is. The stock mismatch of a bf16 engine is small
(token k3 ~1e-4 here), so a test of the consequence needs a mismatch *at the regions the alignment acts on* that can
be turned up in steps. The dose does that: the engine rounds

- every RMSNorm output (input, post-attention, final and Qwen3's q/k norms),
- the RoPE'd q and k,
- the SwiGLU output (the input of ``down_proj``),

to ``bits`` explicit mantissa bits, round to nearest even, keeping bf16's (fp32's) exponent range. ``bits = 7`` is
bf16 itself: no dose. ``bits = 3`` is the mantissa of fp8 e4m3, ``2`` that of e5m2: how an FP8-activation rollout
rounds the inputs of its GEMMs (without the narrower exponent range and the per-token scales, which change the
rounding of no value in range; docs/prereg-dose.md says why this is the dose and not a real fp8 GEMM).

The trainer side (``apply_dose``): a variant that aligns a region rounds that region's output exactly as the engine
does, in the forward; the backward passes the gradient through unchanged (straight-through). ``full`` aligns every
region and so stays exactly on-policy at every dose (with the engine's kernels: ``tests/test_dose.py``); ``rope``
rounds only the RoPE'd q/k; ``baseline`` rounds nothing, as a stock trainer would against such an engine.

The dose is defined for the engines whose forward the emulated engine writes by hand (``DOSE_ENGINES``: vLLM's eager
modes); a compiled engine's rounding is produced by Inductor (``engine/compiled.py``) and has no hook for it.
"""

from __future__ import annotations

from torch import nn

from roundalign.numerics.mantissa import (BITS_ATTR, DOSE_ENGINES, HANDLES_ATTR, NO_DOSE, ROPE_DOSE_ATTR,  # noqa: F401
                                          check_dose_bits, clear_dose, install_dose, round_mantissa, round_mantissa_st)
from roundalign.numerics.patch import _STOCK, alignment_of, region_sites

#: the regions each alignment variant rounds as the engine does (and so receives the engine's dose in)
DOSE_REGIONS = {"baseline": (), "rope": ("rope",), "swiglu": ("swiglu",), "norm": ("norm",),
                "full": ("norm", "rope", "swiglu")}


def remove_dose(model: nn.Module) -> None:
    """Undo ``apply_dose`` on ``model`` (a no-op where none was applied)."""
    clear_dose(model)


def apply_dose(model: nn.Module, bits: int, variant: str) -> nn.Module:
    """Round, in ``model``'s forward, the regions ``variant`` aligns as a dosed engine rounds them (module docstring).

    Call it after ``apply_alignment(model, variant, engine)`` with an engine of ``DOSE_ENGINES``: the RoPE dose sits
    in the aligned attention (``rope``/``full``). Replaces an earlier dose; ``bits = 7`` (no dose) removes it. In
    place; returns ``model``."""
    if variant not in DOSE_REGIONS:
        raise ValueError(f"unknown alignment variant {variant!r} for a dose; valid: {', '.join(DOSE_REGIONS)}")
    regions = DOSE_REGIONS[variant]
    aligned, engine, _ = alignment_of(model)
    sites = region_sites(model) if regions else {}
    dosed = bool(regions) and bits != NO_DOSE
    if dosed:
        if aligned != variant:
            raise ValueError(f"apply_dose(variant={variant!r}) on a model aligned as {aligned!r}: "
                             f"apply_alignment(model, {variant!r}, engine) first, so that the regions round as the "
                             "engine's before its dose")
        if "swiglu" in regions and len(sites["swiglu"]) < len(sites["rope"]):
            raise ValueError("the rounding dose is not defined for an MoE model's expert kernel")
        foreign = [type(attn).__name__ for attn in sites["rope"] if type(attn) not in _STOCK] if "rope" in regions else []
        if foreign:  # the RoPE dose lives in the aligned attention
            raise RuntimeError(f"{foreign[0]} is not roundalign's aligned attention: a RoPE dose needs "
                               "apply_alignment's fused RoPE")
    return install_dose(model, bits, engine if dosed else None, {r: sites[r] for r in regions})


def dose_of(model: nn.Module) -> int:
    """The bits of the dose ``apply_dose`` left on ``model`` (7 where none)."""
    return getattr(model, BITS_ATTR, NO_DOSE)
