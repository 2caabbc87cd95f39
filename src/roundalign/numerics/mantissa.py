"""The rounding of a dose (``numerics.dose``): a value rounded to fewer mantissa bits, with a straight-through
gradient, and the hooks that put it on a model's modules. Imported by ``patch`` (the aligned attention's RoPE reads
it) and by ``dose``, which picks the modules; it imports neither."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from roundalign.numerics.engines import with_dose

#: bf16's explicit mantissa bits: the stock engine, no dose
NO_DOSE = 7
#: the engines whose emulated forward carries a dose
DOSE_ENGINES = with_dose()  # the registry's engines with ``dose`` (vLLM's eager modes)
HANDLES_ATTR = "_roundalign_dose_handles"
BITS_ATTR = "_roundalign_dose"
#: on an aligned attention module: the bits its RoPE'd q/k are rounded to (read by ``patch._qk_norm_rope``)
ROPE_DOSE_ATTR = "_roundalign_dose_bits"


def check_dose_bits(bits: int, engine: str | None = None) -> int:
    """``bits`` as an int in 1..7, and (with ``engine``) an engine that carries a dose; a clear error otherwise."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= NO_DOSE:
        raise ValueError(f"dose bits={bits!r}: the explicit mantissa bits an engine region keeps, an integer from 1 to "
                         f"{NO_DOSE} ({NO_DOSE} = bf16, no dose; 3 = fp8 e4m3's mantissa, 2 = e5m2's)")
    if engine is not None and bits < NO_DOSE and engine not in DOSE_ENGINES:
        raise ValueError(f"a rounding dose (bits={bits}) is emulated for the engines {', '.join(DOSE_ENGINES)} only, "
                         f"not {engine!r}: a compiled engine's rounding comes from Inductor's code")
    return bits


def round_mantissa(x: Tensor, bits: int) -> Tensor:
    """``x`` rounded to ``bits`` explicit mantissa bits (round to nearest, ties to even), in ``x``'s dtype.

    Works on the fp32 encoding: the bits below position ``23 - bits`` are rounded away with the usual integer trick
    (add ``2^(s-1) - 1`` plus the lowest kept bit, then clear the low ``s`` bits), so a carry into the exponent gives
    the next power of two, and past the largest finite value infinity, as IEEE rounding does. inf and NaN pass
    unchanged. ``bits = 7`` of an fp32 tensor is its bf16 rounding; of a bf16 tensor, the tensor itself."""
    check_dose_bits(bits)
    if x.dtype == torch.bfloat16 and bits == NO_DOSE:
        return x
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"round_mantissa rounds bf16, fp16 or fp32 tensors, not {x.dtype}")
    f = x.float()
    i = f.view(torch.int32)
    s = 23 - bits
    i = (i + ((1 << (s - 1)) - 1) + ((i >> s) & 1)) & ~((1 << s) - 1)
    out = torch.where(torch.isfinite(f), i.view(torch.float32), f)
    return out.to(x.dtype)


class _RoundStraightThrough(torch.autograd.Function):
    """Forward: ``round_mantissa``; backward: the incoming gradient unchanged (the rounding's straight-through
    estimator: its true derivative is 0 almost everywhere)."""

    @staticmethod
    def forward(ctx, x, bits):
        return round_mantissa(x, bits)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def round_mantissa_st(x: Tensor, bits: int) -> Tensor:
    """``round_mantissa`` with a straight-through gradient; ``x`` itself for ``bits = 7`` (no dose), in any dtype."""
    if bits == NO_DOSE:
        return x
    return _RoundStraightThrough.apply(x, bits)


def clear_dose(model: nn.Module) -> None:
    """Remove what ``dose.apply_dose`` put on ``model`` (its hooks, the bits on the attentions); a no-op where none."""
    model.__dict__.pop(BITS_ATTR, None)
    for h in model.__dict__.pop(HANDLES_ATTR, []):
        h.remove()
    for m in model.modules():
        m.__dict__.pop(ROPE_DOSE_ATTR, None)


def _round_output(bits):
    def hook(module, args, output):
        if isinstance(output, tuple):  # an aligned norm with a residual returns (normed, residual)
            return (round_mantissa_st(output[0], bits), *output[1:])
        return round_mantissa_st(output, bits)

    return hook


def _round_input(bits):
    def hook(module, args):
        return (round_mantissa_st(args[0], bits), *args[1:])

    return hook


def install_dose(model: nn.Module, bits: int, engine: str | None, sites: dict[str, list[nn.Module]]) -> nn.Module:
    """Put a dose of ``bits`` on ``model``, replacing an earlier one (``bits = 7``, or no sites: none is left): each
    module of ``sites["norm"]`` rounds its output, each of ``sites["swiglu"]`` its input (a ``down_proj``: the SwiGLU
    output), each attention of ``sites["rope"]`` its RoPE'd q/k (read by ``patch._qk_norm_rope``). ``engine`` must
    carry a dose (None: not asked, for a dose with no sites). In place; returns ``model``."""
    check_dose_bits(bits, engine)
    clear_dose(model)
    if bits == NO_DOSE or not any(sites.values()):
        return model
    handles = [m.register_forward_hook(_round_output(bits)) for m in sites.get("norm", ())]
    handles += [m.register_forward_pre_hook(_round_input(bits)) for m in sites.get("swiglu", ())]
    for attn in sites.get("rope", ()):
        setattr(attn, ROPE_DOSE_ATTR, bits)
    setattr(model, HANDLES_ATTR, handles)
    setattr(model, BITS_ATTR, bits)
    return model
