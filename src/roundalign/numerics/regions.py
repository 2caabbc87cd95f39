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

import inspect
import types

import torch
import torch.nn.functional as F
from torch import Tensor

from roundalign.numerics.plan import KERNEL_MODES  # "eager", "compiled": defined once, in the torch-free plan module

__all__ = [
    "rope_hf",
    "rope_fused",
    "rope_fused_rz",
    "round_toward_zero",
    "swiglu_hf",
    "swiglu_fused",
    "rmsnorm_hf",
    "rmsnorm_fused",
    "sum_sq_in_order",
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


def round_toward_zero(x: Tensor, dtype: torch.dtype) -> Tensor:
    """fp32 -> bf16 by truncation (round toward zero: the low 16 bits of the fp32 pattern dropped), the
    conversion vLLM-CPU's C++ ``rotary_embedding`` kernel writes with (measured against vLLM 0.31.0's CPU
    build: ``tests/vllm_cpu/``; round-to-nearest-even matched 53% of elements, truncation all).
    The truncated pattern is a bf16 value, so the final cast is exact. Only bf16 has this conversion;
    other dtypes round to nearest (the fp32 model's no-op: ``x`` is returned as it is)."""
    if dtype != torch.bfloat16:
        return x.to(dtype)
    bits = x.float().contiguous().view(torch.int32) & -65536  # 0xFFFF0000 as an int32
    return bits.view(torch.float32).to(dtype)


def rope_fused_rz(x: Tensor, cos: Tensor, sin: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
    """``rope_fused`` with its one rounding toward zero: vLLM-CPU's eager ``rotary_embedding`` kernel (fp32
    inside, products of bf16 values exact, the fp32 result truncated to bf16)."""
    out_dtype = cos.dtype if out_dtype is None else out_dtype
    return round_toward_zero(rope_fused(x, cos, sin, out_dtype=torch.float32), out_dtype)


def swiglu_hf(gate: Tensor, up: Tensor) -> Tensor:
    """HF ``act_fn(gate_proj(x)) * up_proj(x)``: silu output rounded, then the product rounded."""
    return F.silu(gate) * up


def swiglu_fused(gate: Tensor, up: Tensor) -> Tensor:
    """vLLM ``SiluAndMul.forward_native`` compiled: ``silu(gate) * up`` in fp32, one rounding."""
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def rmsnorm_hf(x: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype | None = None) -> Tensor:
    """HF ``Qwen2RMSNorm.forward``: normalized value rounded to x's dtype, then a bf16 multiply.

    ``out_dtype`` (default: x's dtype, as HF) is where the normalized value is rounded before the weight
    multiply: the model dtype when ``x`` is an unrounded fp32 sum (vLLM's native ``fused_add_rms_norm`` run
    eagerly rounds there, ``x.to(weight.dtype) * weight``)."""
    input_dtype = x.dtype if out_dtype is None else out_dtype
    xf = x.to(torch.float32)
    variance = xf.pow(2).mean(-1, keepdim=True)
    xf = xf * torch.rsqrt(variance + eps)
    return weight * xf.to(input_dtype)


def sum_sq_in_order(xf: Tensor, order: tuple[int, int]) -> Tensor:
    """Sum of squares over the last dim of fp32 ``xf`` in the order of one vectorized Inductor CPU reduction,
    keepdim. ``order = (vec, n)``: the reduction loop steps over the row ``n * vec`` elements at a time into an
    accumulator of ``n`` SIMD vectors of ``vec`` fp32 lanes (``Vectorized<float>``: n = 1;
    ``VectorizedN<float, n>``: Inductor's bf16 tiling); each lane sums its elements' squares in row order (every
    square rounded to fp32 first: Inductor compiles with ``-ffp-contract=off``); ``vec_reduce_all`` then adds the n
    vectors one after another (ATen ``vec_n.h``) and folds the vec lanes by halves (``VecReduceAllSIMD``: a
    butterfly of shuffles, 16 lanes on AVX-512, 8 on AVX2; lane 0 ends with the total).

    Every step is an elementwise fp32 op (no reduction kernel decides an order), so eager torch and Inductor
    compute the same bits. The row length must be a multiple of ``n * vec`` (no tail loop)."""
    # Python ints: the loops below unroll anyway. The region kernels compile with dynamic=True, under which an int
    # argument is traced as a symbol; Inductor 2.13 then indexed the slices' scratch buffers with a wrong row
    # stride (NaNs in the output). int() makes Dynamo specialize on the values.
    vec, n = int(order[0]), int(order[1])
    width, size = vec * n, int(xf.shape[-1])
    if vec < 1 or vec & (vec - 1) or n < 1 or size % width:
        raise ValueError(f"reduction order (vec={vec}, n={n}) does not tile a row of {size} elements: vec must be a "
                         f"power of two and the row a multiple of vec * n")
    acc = None
    for j in range(0, size, width):
        sl = xf[..., j:j + width]
        sq = sl * sl
        acc = sq if acc is None else acc + sq  # the first add is to an accumulator of zeros: exact
    v = acc[..., :vec]
    for i in range(1, n):
        v = v + acc[..., i * vec:(i + 1) * vec]
    half = vec // 2
    while half:  # lane l < half: v[l] + v[l ^ half] = v[l] + v[l + half]; only lanes below half are read next
        v = v[..., :half] + v[..., half:2 * half]
        half //= 2
    return v


def rmsnorm_fused(x: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype | None = None,
                  keep_fp32: bool = False, sum_order: tuple[int, int] | None = None) -> Tensor:
    """vLLM ``RMSNorm`` native formula with the weight multiply in fp32 and one rounding.

    ``x`` may be bf16 or an fp32 value that was never rounded (the fused residual sum).
    ``out_dtype`` defaults to the weight's dtype; ``keep_fp32=True`` returns the fp32 result unrounded
    (Qwen3 q/k norm feeding RoPE inside one fused kernel). ``sum_order``: None (the mean of squares as torch
    reduces it) or the order of the engine kernel's reduction (``sum_sq_in_order``), then divided by the row
    length as Inductor's code does."""
    xf = x.to(torch.float32)
    if sum_order is None:
        variance = xf.pow(2).mean(-1, keepdim=True)
    else:
        variance = sum_sq_in_order(xf, sum_order) / xf.shape[-1]
    y = xf * torch.rsqrt(variance + eps)
    y = y * weight.float()
    if keep_fp32:
        return y
    return y.to(weight.dtype if out_dtype is None else out_dtype)


def add_rmsnorm_fp32_sum(x: Tensor, residual: Tensor, weight: Tensor, eps: float, keep_fp32_sum: bool = False,
                         norm: str = "fused", sum_order: tuple[int, int] | None = None) -> tuple[Tensor, Tensor]:
    """vLLM native ``RMSNorm(x, residual)``: the add happens in fp32 and the norm reads the
    UNROUNDED fp32 sum; the residual stream stored is the sum rounded once (bitwise HF's bf16 add).

    Returns ``(normed, new_residual)``, both in the weight's dtype; with ``keep_fp32_sum=True`` the new
    residual is the fp32 sum itself (a sum the compiled engine never rounds). ``residual`` may itself be an
    fp32 value (vLLM-CPU's one-graph compile keeps the whole stream in fp32). ``norm``: ``"fused"`` (the weight
    multiply in fp32, one rounding: compiled) or ``"hf"`` (normalized value rounded, then the bf16 weight
    multiply: the native formula run eagerly, vLLM-CPU eager). ``sum_order``: see ``rmsnorm_fused`` (fused only)."""
    s = x.float() + residual.float()
    if norm == "fused":
        normed = rmsnorm_fused(s, weight, eps, sum_order=sum_order)
    elif sum_order is None:
        normed = rmsnorm_hf(s, weight, eps, out_dtype=x.dtype)
    else:
        raise ValueError("a reduction order belongs to a compiled engine's fused norm, not to norm='hf'")
    return normed, (s if keep_fp32_sum else s.to(residual.dtype))


def add_rmsnorm_bf16_sum(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                         sum_order: tuple[int, int] | None = None) -> tuple[Tensor, Tensor]:
    """vLLM eager ``fused_add_rms_norm``: bf16 add, the norm reads the rounded sum and rounds its
    output once. Returns ``(normed, new_residual)``."""
    s = x + residual
    return rmsnorm_fused(s, weight, eps, sum_order=sum_order), s


def qk_norm_rope_fused(x: Tensor, weight: Tensor, eps: float, cos: Tensor, sin: Tensor) -> Tensor:
    """Qwen3 q/k norm feeding RoPE inside one fused kernel (vLLM compiled): ``x`` (B, T, H, D) bf16 ->
    (B, H, T, D); the normalized value stays fp32 into RoPE and only RoPE's output is rounded."""
    return rope_fused(rmsnorm_fused(x, weight, eps, keep_fp32=True).transpose(1, 2), cos, sin)


# -- kernel sets ---------------------------------------------------------------------------------
# "eager": the formulas above as separate torch ops (exact, the reference; each op is a memory pass,
# so the fp32 regions cost ~10% more than HF's bf16 ops on CPU). "compiled": the same formulas through
# torch.compile (Inductor), one fused kernel per region, as vLLM's compiled engine runs them. Inductor
# may reduce the RMSNorm mean in another order (~1e-5 of elements 1 ulp apart, tests/test_inductor.py).
#
# In both modes a region is one autograd node that saves only its inputs (bf16 activations, the norm
# weight; RoPE saves nothing but cos/sin) and recomputes its fp32 intermediates in backward. Left to
# autograd, the fp32 formulas keep fp32 copies of everything they touch (SwiGLU: gate, silu(gate) and up in
# fp32, 12 bytes per intermediate element where HF keeps 6), which made ``full`` keep 27% more activation
# bytes than ``baseline`` (tools/bench/memory.py). With eager kernels the backward is autograd of the
# eager formula, recomputed from the same inputs, so gradients are bitwise those of the plain formula; it is
# written with differentiable ops, so ``create_graph=True`` / double backward and ``retain_graph=True`` work
# in both modes. Compiled mode compiles the forward (it runs under no_grad inside the node) and, for a
# first-order backward, the region's ``torch.func.vjp`` as a separate inference graph: neither is an
# AOTAutograd training graph, so its donated buffers, which forbid ``retain_graph``/``create_graph`` in
# torch 2.13 (torch/_functorch/_aot_autograd/runtime_wrappers.py, ``_backward_impl``), never come into
# play. ``create_graph=True`` falls back to the eager formula.

_FUSED = ("rope_fused", "rope_fused_rz", "swiglu_fused", "rmsnorm_fused", "add_rmsnorm_fp32_sum", "add_rmsnorm_bf16_sum")
_KERNEL_CACHE: dict[str, object] = {}


class _RecomputeInBackward(torch.autograd.Function):
    """``kernel(*inputs, **kwargs)`` in forward; in backward, autograd of ``reference(*inputs, **kwargs)``
    recomputed from the saved inputs (``reference`` is the eager formula ``kernel`` computes). With compiled
    kernels, a first-order backward runs ``vjp`` instead: the same VJP compiled by Inductor (one fused kernel,
    its own rounding of the fp32 intermediates, like the forward); ``create_graph`` always takes the eager path."""

    @staticmethod
    def forward(ctx, reference, kernel, vjp, kwargs, *inputs):
        ctx.reference, ctx.vjp, ctx.kwargs = reference, vjp, kwargs
        ctx.save_for_backward(*inputs)
        return kernel(*inputs, **kwargs)

    @staticmethod
    def backward(ctx, *grad_outputs):
        inputs = ctx.saved_tensors
        needs = ctx.needs_input_grad[4:]
        create_graph = torch.is_grad_enabled()  # backward(create_graph=True): keep the graph to the real inputs
        if ctx.vjp is not None and not create_graph:  # materialize_grads (on): an unused output's gradient is zeros
            got = ctx.vjp(tuple(inputs), tuple(grad_outputs), ctx.kwargs)
            return (None, None, None, None, *(g if n else None for g, n in zip(got, needs)))
        if ctx.reference is swiglu_fused and not create_graph:
            grad_gate, grad_up = _swiglu_fused_backward(grad_outputs[0], *inputs)
            return None, None, None, None, grad_gate if needs[0] else None, grad_up if needs[1] else None
        with torch.enable_grad():
            if not create_graph:
                inputs = tuple(x.detach().requires_grad_(n) for x, n in zip(inputs, needs))
            outs = ctx.reference(*inputs, **ctx.kwargs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        pairs = [(o, g) for o, g in zip(outs, grad_outputs) if o.requires_grad and g is not None]
        wrt = [x for x, n in zip(inputs, needs) if n]
        grads = iter(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs],
                                         create_graph=create_graph, allow_unused=True))
        return (None, None, None, None, *(next(grads) if n else None for n in needs))


def _by_sum_order(build):
    """A callable taking ``sum_order=`` that runs ``build(sum_order)``, built once per order. The order reaches
    the compiled graph as a constant: passed as an argument of a ``dynamic=True`` compile its ints are traced as
    symbols, and Inductor 2.13 then indexed the slices' scratch buffers with a wrong row stride (NaNs)."""
    built = {}

    def call(*args, sum_order=None, **kwargs):
        key = None if sum_order is None else tuple(int(v) for v in sum_order)
        if key not in built:
            built[key] = build(key)
        return built[key](*args, **kwargs)

    return call


_SUM_ORDERS: dict[str, tuple[int, int]] = {}  # "16x2" -> (16, 2): orders bound into compiled region kernels


def _with_order(fn, order):
    """``fn`` with ``sum_order=order`` bound. Dynamo under ``dynamic=True`` traces the ints of an argument, of a
    ``functools.partial`` and of a closure cell as symbols; a string in a closure and the ints a module-level dict
    holds it treats as constants."""
    if order is None:
        return fn
    key = f"{order[0]}x{order[1]}"
    _SUM_ORDERS[key] = tuple(order)

    def bound(*args, **kwargs):
        return fn(*args, sum_order=_SUM_ORDERS[key], **kwargs)

    return bound


def _compiled_kernel(fn):
    """``fn`` compiled by Inductor (dynamic shapes), one graph per RMSNorm reduction order."""
    def build(order):
        return torch.compile(_with_order(fn, order), dynamic=True)
    return _by_sum_order(build) if "sum_order" in inspect.signature(fn).parameters else torch.compile(fn, dynamic=True)


def _compiled_vjp(reference):
    """``torch.func.vjp`` of ``reference`` compiled by Inductor: (inputs, output grads, kwargs) -> input grads."""

    def build(order):
        ref = _with_order(reference, order)

        def vjp(inputs, grads, kwargs):
            out, fn = torch.func.vjp(lambda *xs: ref(*xs, **kwargs), *inputs)
            return fn(grads if isinstance(out, tuple) else grads[0])

        return torch.compile(vjp, dynamic=True)

    by_order = _by_sum_order(build)

    def vjp(inputs, grads, kwargs):
        kwargs = dict(kwargs)
        return by_order(inputs, grads, kwargs, sum_order=kwargs.pop("sum_order", None))

    return vjp


# Rows per chunk of the eager SwiGLU region: its fp32 temporaries live for one chunk only. The region is
# elementwise, so chunking changes no bit; 2^16 elements = 256 KiB per fp32 temporary on a CPU. On an accelerator
# each chunk is ~5 kernel launches: 2^16 there made `full` 29x slower than `baseline` in the forward of a
# Qwen2.5-1.5B-sized model on an H200 (4 x 1024 tokens: 2240 chunks a layer; results/bench/gpu), so chunks hold
# 2^24 elements there (64 MiB per fp32 temporary, against the 2.3 GB of fp32 the whole activation would take).
_SWIGLU_CHUNK_ELEMS = 1 << 16
_SWIGLU_CHUNK_ELEMS_ACCELERATOR = 1 << 24


def _row_chunks(*tensors: Tensor):
    """Yield matching row slices of same-shape tensors viewed as (rows, last dim), ~_SWIGLU_CHUNK_ELEMS each
    (``_SWIGLU_CHUNK_ELEMS_ACCELERATOR`` off the CPU)."""
    last = tensors[0].shape[-1]
    flat = [t.reshape(-1, last) for t in tensors]
    elems = _SWIGLU_CHUNK_ELEMS if tensors[0].device.type == "cpu" else _SWIGLU_CHUNK_ELEMS_ACCELERATOR
    step = max(1, elems // max(last, 1))
    for r0 in range(0, flat[0].shape[0], step):
        yield tuple(f[r0:r0 + step] for f in flat)


def _swiglu_fused_chunked(gate: Tensor, up: Tensor) -> Tensor:
    """``swiglu_fused`` computed a chunk of rows at a time (same bits; fp32 temporaries of one chunk only)."""
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)  # contiguous: its row views are written
    for o, g, u in _row_chunks(out, gate, up):
        o.copy_(swiglu_fused(g, u))
    return out


def _swiglu_fused_backward(grad: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    """Gradients of ``swiglu_fused`` w.r.t. (gate, up): the ops autograd runs on the formula (ToCopy, Mul,
    SiluBackward, ToCopy), hence the same bits, a chunk of rows at a time, so the backward's fp32
    temporaries (up to four copies of the intermediate activation) exist for one chunk only."""
    grad_gate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)  # contiguous: row views are written
    grad_up = torch.empty(up.shape, dtype=up.dtype, device=up.device)
    for gg, gu, gr, g, u in _row_chunks(grad_gate, grad_up, grad, gate, up):
        g32 = g.float()
        s32 = F.silu(g32)
        grad32 = gr.float()
        gu.copy_((grad32 * s32).to(up.dtype))
        del s32
        grad_s = grad32 * u.float()
        del grad32
        gg.copy_(torch.ops.aten.silu_backward(grad_s, g32).to(gate.dtype))
    return grad_gate, grad_up


def _rope_fused_backward(grad: Tensor, cos: Tensor, sin: Tensor, x_dtype: torch.dtype) -> Tensor:
    """d rope_fused / d x applied to ``grad``: RoPE is linear in x, so this needs only cos/sin. Same fp32 ops
    autograd runs on ``rope_fused`` (each half of x gets two products, summed once), hence the same bits."""
    gf, cf, sf = grad.float(), cos.float(), sin.float()
    half = grad.shape[-1] // 2
    g1, g2 = gf[..., :half], gf[..., half:]
    c1, c2 = cf[..., :half], cf[..., half:]
    s1, s2 = sf[..., :half], sf[..., half:]
    return torch.cat((g1 * c1 + g2 * s2, g2 * c2 - g1 * s1), dim=-1).to(x_dtype)


class _RopeFused(torch.autograd.Function):
    """``rope_fused`` as one node that saves only cos/sin (the model's shared tables), not x."""

    @staticmethod
    def forward(ctx, kernel, x, cos, sin, out_dtype):
        ctx.save_for_backward(cos, sin)
        ctx.x_dtype = x.dtype
        return kernel(x, cos, sin, out_dtype)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return None, _rope_fused_backward(grad, cos, sin, ctx.x_dtype), None, None, None


def _one_node(name: str, kernel):
    reference = globals()[name]
    if name.startswith("rope_fused"):  # the backward of a rounding (either way) is the identity
        def rope(x, cos, sin, out_dtype=None):
            if torch.compiler.is_compiling():  # inside an outer torch.compile: AOTAutograd differentiates the formula
                return reference(x, cos, sin, out_dtype)
            if cos.requires_grad or sin.requires_grad:  # not in HF (cos/sin come from a buffer): keep x too
                return _RecomputeInBackward.apply(reference, kernel, None, {"out_dtype": out_dtype}, x, cos, sin)
            return _RopeFused.apply(kernel, x, cos, sin, out_dtype)
        return rope

    vjp = None if kernel is reference else _compiled_vjp(reference)

    def region(*inputs, **kwargs):
        if torch.compiler.is_compiling():  # inside an outer torch.compile: AOTAutograd differentiates the formula
            return reference(*inputs, **kwargs)
        if not all(isinstance(a, Tensor) for a in inputs):  # eps is a float: the node takes tensors positionally
            raise TypeError(f"{name}: pass non-tensor arguments by keyword in the kernel namespace")
        if kernel is reference and all(a.dtype == torch.float32 for a in inputs):
            # fp32 model: the formula makes no fp32 copies to save (``.float()`` is the identity), and plain
            # autograd accumulates the gradient of an input that also feeds ops outside the region (the residual
            # stream) in the same order as stock HF; one node would sum the region's share first, which in
            # fp32 changes the last bit (tests/test_patch.py::test_autograd_fp32_bitwise_equal_to_stock)
            return reference(*inputs, **kwargs)
        if name == "swiglu_fused" and kernel is reference:
            return _RecomputeInBackward.apply(reference, _swiglu_fused_chunked, None, kwargs, *inputs)
        return _RecomputeInBackward.apply(reference, kernel, vjp, kwargs, *inputs)
    return region


def region_kernels(mode: str = "eager"):
    """Namespace of the fused region functions in ``mode`` (compiled ones are built once per process), each
    one autograd node that recomputes its fp32 intermediates in backward (see above)."""
    if mode not in KERNEL_MODES:
        raise ValueError(f"unknown region kernel mode {mode!r}; valid: {', '.join(KERNEL_MODES)}")
    if mode not in _KERNEL_CACHE:
        fns = {name: globals()[name] for name in _FUSED}
        if mode == "compiled":
            fns = {name: _compiled_kernel(fn) for name, fn in fns.items()}
        _KERNEL_CACHE[mode] = types.SimpleNamespace(mode=mode, **{n: _one_node(n, f) for n, f in fns.items()})
    return _KERNEL_CACHE[mode]
