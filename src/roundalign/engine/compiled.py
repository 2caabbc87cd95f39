"""The ``vllm-compiled`` engine, produced by the compiler rather than re-stated.

vLLM 0.31 by default (-O2) traces the model's forward into one FX graph, splits it at every attention call
(``CompilationConfig.splitting_ops``: ``vllm::unified_attention_with_output`` and the KV-cache write) and
compiles each piece with Inductor. Inside a piece Inductor computes fused elementwise chains in fp32 and
rounds only what it writes to memory; a value that crosses an attention call is a piece output and is
stored in its graph dtype. Where rounding happens is therefore decided by the compiler, not by the
formulas, and this module does not guess it: it writes each piece the way vLLM writes the model
(``vllm/model_executor/models/qwen2.py`` / ``qwen3.py``: the decoder hands ``(hidden, residual)`` to the
next layer, the residual add happens inside the next norm; vLLM's native formulas from
``numerics.vllm_native``) and runs it through ``torch.compile`` (Inductor), one piece between two
attention calls:

    piece "first":  embedding -> layer 0 input norm -> q/k/v projections [-> q/k norm] -> RoPE
    piece "mid":    o_proj -> post-attention add+norm -> MLP -> next layer's input add+norm -> q/k/v [...] -> RoPE
    piece "last":   o_proj -> post-attention add+norm -> MLP -> final add+norm

Each kind of piece is compiled once (per model shape and option set, per process) and reused for every
layer: the weights are graph inputs. The token dimension is dynamic, as in vLLM (prefill and decode
share a graph; size 1 may get its own specialisation).

Opaque ops (``torch.library`` custom ops, which Inductor calls but cannot fuse into or reorder): the
GEMMs (by default the trainer's own ``F.linear`` on the trainer's separate q/k/v and gate/up weights),
attention (it is outside the pieces, as in vLLM) and, by default, the RMSNorm mean-of-squares
reduction (the trainer's eager reduction). So with the defaults the only difference left between this
engine and the trainer is *where* rounding happens. ``norm_reduction="inductor"`` lets Inductor reduce
the mean itself (its own summation order: a few elements in 1e5 one ulp apart), to show that source
separately.

Per-region engines: ``regions`` names the regions that take vLLM's native formula (compiled); every other
region runs Hugging Face's eager formula as an opaque op (rounded where HF rounds). ``regions="full"`` is
the real engine; ``"rope"``, ``"swiglu"``, ``"norm"`` are what a trainer aligned with that single-region
variant must match.

Not emulated here: vLLM's merged QKV / gate-up GEMMs and their cuBLAS tiles, FlashAttention, paged KV
blocks, CUDA graphs, custom fusion passes (none is on by default for these models on one GPU), tensor
parallelism. ``tools/gpu_check.py`` repeats the comparison with Triton on a GPU.
"""

from __future__ import annotations

import threading
import time
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor

from roundalign.engine.choices import NORM_REDUCTIONS  # re-exported
from roundalign.numerics import regions as R
from roundalign.numerics import vllm_native as V

REGION_SETS = {
    "full": frozenset({"rope", "swiglu", "norm"}),
    "rope": frozenset({"rope"}),
    "swiglu": frozenset({"swiglu"}),
    "norm": frozenset({"norm"}),
    "baseline": frozenset(),
}

# ----------------------------------------------------------------------------------------------
# Opaque ops. Each runs an eager kernel; Inductor sees a call it cannot look into.


@torch.library.custom_op("roundalign::linear", mutates_args=())
def _linear(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    return F.linear(x, w, b)


@_linear.register_fake
def _(x, w, b):
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def splitk_linear(x: Tensor, w: Tensor, b: Tensor | None, chunk: int) -> Tensor:
    """A split-K GEMM with reduced-precision reduction: each K-chunk's partial product is accumulated in
    fp32 and stored in the output dtype, the partials are summed in fp32 in chunk order and rounded once.

    This is the split-K reduction cuBLAS may pick for bf16 GEMMs while PyTorch's default
    ``torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True`` allows it (partials in
    the output type). An fp32 workspace alone would hardly differ from one fp32 accumulation: products of
    bf16 values are exact in fp32 and short fp32 sums of them are mostly exact too, so on the tiny models
    such a kernel left no mismatch at all; rounding the partials is what makes split-K a mismatch source.
    """
    acc = None
    for k0 in range(0, x.shape[-1], chunk):
        part = (x[..., k0:k0 + chunk].float() @ w[:, k0:k0 + chunk].float().T).to(x.dtype).float()
        acc = part if acc is None else acc + part
    if b is not None:
        acc = acc + b.float()
    return acc.to(x.dtype)


@torch.library.custom_op("roundalign::linear_splitk", mutates_args=())
def _linear_splitk(x: Tensor, w: Tensor, b: Tensor | None, chunk: int) -> Tensor:
    return splitk_linear(x, w, b, chunk)


@_linear_splitk.register_fake
def _(x, w, b, chunk):
    return x.new_empty((*x.shape[:-1], w.shape[0]))


@torch.library.custom_op("roundalign::mean_sq", mutates_args=())
def _mean_sq(x: Tensor) -> Tensor:
    """The trainer's eager reduction (``regions.rmsnorm_fused``: ``xf.pow(2).mean(-1, keepdim=True)``)."""
    return x.pow(2).mean(-1, keepdim=True)


@_mean_sq.register_fake
def _(x):
    return x.new_empty((*x.shape[:-1], 1))


def _full_tables(cos_sin: Tensor, heads_dim: int = -2) -> tuple[Tensor, Tensor]:
    """vLLM cache rows (N, D) -> HF-layout neox tables (N, 1, D)."""
    cos, sin = cos_sin.chunk(2, dim=-1)
    return torch.cat((cos, cos), -1).unsqueeze(heads_dim), torch.cat((sin, sin), -1).unsqueeze(heads_dim)


@torch.library.custom_op("roundalign::hf_rope", mutates_args=())
def _hf_rope(x: Tensor, cos_sin: Tensor) -> Tensor:
    """HF ``apply_rotary_pos_emb`` on x (N, H, D) with the bf16 table rows (N, D): 3 roundings."""
    cos, sin = _full_tables(cos_sin)
    return R.rope_hf(x, cos, sin)


@_hf_rope.register_fake
def _(x, cos_sin):
    return torch.empty_like(x)


@torch.library.custom_op("roundalign::hf_swiglu", mutates_args=())
def _hf_swiglu(gate: Tensor, up: Tensor) -> Tensor:
    return R.swiglu_hf(gate, up)


@_hf_swiglu.register_fake
def _(gate, up):
    return torch.empty_like(gate)


@torch.library.custom_op("roundalign::hf_rmsnorm", mutates_args=())
def _hf_rmsnorm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return R.rmsnorm_hf(x, w, eps)


@_hf_rmsnorm.register_fake
def _(x, w, eps):
    return torch.empty_like(x)


@torch.library.custom_op("roundalign::hf_add_rmsnorm", mutates_args=())
def _hf_add_rmsnorm(x: Tensor, residual: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """HF decoder: bf16 residual add (rounded), then HF RMSNorm of the rounded sum."""
    s = residual + x
    return R.rmsnorm_hf(s, w, eps), s


@_hf_add_rmsnorm.register_fake
def _(x, residual, w, eps):
    return torch.empty_like(x), torch.empty_like(x)


# Attention of the one-graph engine: an opaque op that appends the new K/V to the cache (the engine's own
# ``KVCache`` rules, fp8 storage included) and attends; the engine instance is found by a handle, so the graph
# carries no Python object.
_ATTENTION_OWNERS: dict = {}


def register_attention_owner(owner) -> Tensor:
    """A handle (0-dim int64 tensor) by which the one-graph engine's attention op finds ``owner``."""
    handle = id(owner)
    _ATTENTION_OWNERS[handle] = owner
    weakref.finalize(owner, _ATTENTION_OWNERS.pop, handle, None)
    return torch.tensor(handle, dtype=torch.int64)


@torch.library.custom_op("roundalign::engine_attention", mutates_args=())
def _engine_attention(q: Tensor, k: Tensor, v: Tensor, k_past: Tensor, v_past: Tensor, bsz: int, handle: Tensor
                      ) -> tuple[Tensor, Tensor, Tensor]:
    # the handle is a tensor, not an int: Dynamo would specialise the graph on every engine instance's id
    return _ATTENTION_OWNERS[int(handle)].attend_with_past(q, k, v, k_past, v_past, bsz)


@_engine_attention.register_fake
def _(q, k, v, k_past, v_past, bsz, handle):
    new = q.shape[0] // bsz
    shape = (*k_past.shape[:2], k_past.shape[2] + new, k_past.shape[3])
    return q.new_empty(q.shape), k_past.new_empty(shape), v_past.new_empty(shape)


# ----------------------------------------------------------------------------------------------
# The pieces, written the way vLLM writes Qwen2/Qwen3, each region either vLLM-native (compiled) or HF
# (opaque).


class _Spec:
    """Everything that fixes a piece's graph (besides tensor shapes): hashable, the compile-cache key."""

    def __init__(self, *, regions: frozenset, gemm: str, splitk_chunk: int, norm_reduction: str, eps: float,
                 head_dim: int, qk_norm: bool, whole: bool = False):
        self.regions, self.gemm, self.splitk_chunk = regions, gemm, splitk_chunk
        self.norm_reduction, self.eps, self.head_dim, self.qk_norm = norm_reduction, eps, head_dim, qk_norm
        self.whole = whole
        self.key = (tuple(sorted(regions)), gemm, splitk_chunk, norm_reduction, eps, head_dim, qk_norm, whole)

    # -- building blocks ---------------------------------------------------------------------------

    def linear(self, x, w, b=None):
        if self.gemm == "splitk":
            return torch.ops.roundalign.linear_splitk(x, w, b, self.splitk_chunk)
        return torch.ops.roundalign.linear(x, w, b)

    def _mean_sq(self):
        return torch.ops.roundalign.mean_sq if self.norm_reduction == "opaque" else V.native_mean_sq

    def norm(self, x, w):
        if "norm" in self.regions:
            return V.vllm_rms_norm(x, w, self.eps, mean_sq=self._mean_sq())
        return torch.ops.roundalign.hf_rmsnorm(x, w, self.eps)

    def add_norm(self, x, residual, w):
        if "norm" in self.regions:
            return V.vllm_fused_add_rms_norm(x, residual, w, self.eps, mean_sq=self._mean_sq())
        return torch.ops.roundalign.hf_add_rmsnorm(x, residual, w, self.eps)

    def rope(self, positions, q, k, cache):
        if "rope" in self.regions:
            return V.vllm_rope_forward_native(positions, q, k, self.head_dim, cache)
        cos_sin = cache.index_select(0, positions)
        n = positions.shape[0]
        q = torch.ops.roundalign.hf_rope(q.view(n, -1, self.head_dim), cos_sin).view(q.shape)
        k = torch.ops.roundalign.hf_rope(k.view(n, -1, self.head_dim), cos_sin).view(k.shape)
        return q, k

    def silu_and_mul(self, gate, up):
        if "swiglu" in self.regions:
            # vLLM runs one merged gate_up GEMM and SiluAndMul on its halves; the halves of a cat are the
            # same values, and the cat is fused away by Inductor.
            return V.vllm_silu_and_mul(torch.cat((gate, up), dim=-1))
        return torch.ops.roundalign.hf_swiglu(gate, up)

    # -- one layer, split at attention -------------------------------------------------------------

    def head(self, x, residual, positions, cache, ln1, wq, bq, wk, bk, wv, bv, qn, kn):
        """Input (add+)norm, projections, [q/k norm], RoPE: -> q, k, v, residual."""
        if residual is None:
            residual = x
            h = self.norm(x, ln1)
        else:
            h, residual = self.add_norm(x, residual, ln1)
        q, k, v = self.linear(h, wq, bq), self.linear(h, wk, bk), self.linear(h, wv, bv)
        if self.qk_norm:
            if "norm" in self.regions:
                q, k = V.vllm_qwen3_qk_norm(q, k, qn, kn, self.head_dim, self.eps, mean_sq=self._mean_sq())
            else:
                q = torch.ops.roundalign.hf_rmsnorm(q.view(q.shape[0], -1, self.head_dim), qn, self.eps).view(q.shape)
                k = torch.ops.roundalign.hf_rmsnorm(k.view(k.shape[0], -1, self.head_dim), kn, self.eps).view(k.shape)
        q, k = self.rope(positions, q, k, cache)
        return q, k, v, residual

    def tail(self, attn, residual, wo, ln2, wg, wu, wd):
        """o_proj, post-attention add+norm, MLP: -> mlp_out, residual (neither written by this piece)."""
        x = self.linear(attn, wo)
        x, residual = self.add_norm(x, residual, ln2)
        x = self.silu_and_mul(self.linear(x, wg), self.linear(x, wu))
        return self.linear(x, wd), residual

    # -- the three kinds of piece ------------------------------------------------------------------

    def piece_first(self, input_ids, positions, embed, cache, *w):
        x = F.embedding(input_ids, embed)
        return self.head(x, None, positions, cache, *w)

    def piece_mid(self, attn, residual, positions, cache, wo, ln2, wg, wu, wd, *w_next):
        x, residual = self.tail(attn, residual, wo, ln2, wg, wu, wd)
        return self.head(x, residual, positions, cache, *w_next)

    def piece_last(self, attn, residual, wo, ln2, wg, wu, wd, final_norm):
        """-> (final hidden, residual stream after the last layer). vLLM discards the second; returning it
        only adds a store of ``x_residual`` (the norm reads the fp32 sum, not that copy)."""
        x, residual = self.tail(attn, residual, wo, ln2, wg, wu, wd)
        return self.add_norm(x, residual, final_norm)

    # -- the whole model as one graph (vLLM's CPU platform) ------------------------------------------------

    def piece_whole(self, input_ids, positions, embed, cache, final_norm, layer_w, past, bsz: int, handle):
        """vLLM-CPU's compiled forward: every layer in ONE graph, attention (with its KV-cache write) an opaque
        op inside it (``roundalign::engine_attention``), as ``CompilationMode.DYNAMO_TRACE_ONCE`` traces the
        model with no splitting ops. ``layer_w``: per layer the 9 head weights then the 5 tail weights;
        ``past``: per layer the cached K then V, (B, H_kv, T_past, D). Returns the final hidden states, the
        new K/V per layer, and the residual stream after each layer in fp32: vLLM's ``x_residual`` upcast, which
        Inductor folds into the unrounded sum (a bf16 output would be a stored rounding that later kernels could
        read instead of the sum; the caller rounds these copies for the per-layer comparison)."""
        x = F.embedding(input_ids, embed)
        residual = None
        new_kv, states = [], []
        for i, w in enumerate(layer_w):
            q, k, v, residual = self.head(x, residual, positions, cache, *w[:9])
            if i > 0:  # the input add of layer i formed the stream after layer i - 1
                states.append(residual.float())
            attn, k_all, v_all = torch.ops.roundalign.engine_attention(q, k, v, past[2 * i], past[2 * i + 1],
                                                                       bsz, handle)
            new_kv += [k_all, v_all]
            x, residual = self.tail(attn, residual, *w[9:])
        hidden, last = self.add_norm(x, residual, final_norm)
        states.append(last.float())
        return hidden, new_kv, states


# Compiled pieces per process: {(spec key, piece kind): compiled callable}
_COMPILED: dict[tuple, object] = {}
_LOCK = threading.Lock()
COMPILE_STATS = {"graphs": 0, "compile_s": 0.0}
_WARM: set = set()


def _configure_dynamo() -> None:
    # A compiled piece must never fall back to eager silently: that would run the native formulas with
    # eager (HF-like) rounding and still look like an engine.
    cfg = torch._dynamo.config
    cfg.cache_size_limit = max(getattr(cfg, "cache_size_limit", 8), 64)
    if hasattr(cfg, "recompile_limit"):
        cfg.recompile_limit = max(cfg.recompile_limit, 64)
    if hasattr(cfg, "fail_on_recompile_limit_hit"):
        cfg.fail_on_recompile_limit_hit = True


def compiled_piece(spec: _Spec, kind: str):
    """The compiled callable for one kind of piece (built once per process and spec)."""
    key = (spec.key, kind)
    with _LOCK:
        fn = _COMPILED.get(key)
        if fn is None:
            _configure_dynamo()
            fn = torch.compile(getattr(spec, f"piece_{kind}"), backend="inductor", fullgraph=True, dynamic=None)
            _COMPILED[key] = fn
            COMPILE_STATS["graphs"] += 1
    return fn


def _call(fn, *args):
    """Run a compiled piece; the token dimension (dim 0 of the activations) is dynamic, as in vLLM. The wall
    time of a call that compiled (the first of its piece kind and token-count class) goes to COMPILE_STATS."""
    for a in args[:2]:
        if isinstance(a, Tensor) and a.dim() >= 1:
            torch._dynamo.maybe_mark_dynamic(a, 0)
    bucket = (id(fn), args[0].shape[0] == 1)
    if bucket in _WARM:
        return fn(*args)
    t0 = time.perf_counter()
    out = fn(*args)
    _WARM.add(bucket)
    COMPILE_STATS["compile_s"] += time.perf_counter() - t0
    return out


def make_spec(*, regions: str, gemm: str, splitk_chunk: int, norm_reduction: str, eps: float, head_dim: int,
              qk_norm: bool, whole: bool = False) -> _Spec:
    if regions not in REGION_SETS:
        raise ValueError(f"unknown engine region set {regions!r}; valid: {', '.join(REGION_SETS)}")
    if norm_reduction not in NORM_REDUCTIONS:
        raise ValueError(f"unknown norm_reduction {norm_reduction!r}; valid: {', '.join(NORM_REDUCTIONS)}")
    return _Spec(regions=REGION_SETS[regions], gemm=gemm, splitk_chunk=splitk_chunk, norm_reduction=norm_reduction,
                 eps=eps, head_dim=head_dim, qk_norm=qk_norm, whole=whole)


def run_model(spec: _Spec, m, input_ids: Tensor, positions: Tensor, attend, layer_states: list | None) -> Tensor:
    """One forward of the engine model ``m`` (an ``EngineModel``) over flattened tokens.

    ``input_ids``/``positions``: (N,); ``attend(i, q, k, v) -> (N, H*D)`` runs attention of layer ``i``
    (KV-cache write included) outside the compiled pieces. Returns the final hidden states (N, hidden),
    bf16. ``layer_states`` (if a list) receives the residual stream after each layer, (N, hidden)."""
    L = m.layers

    def wts(layer):
        return (layer.ln1, layer.wq, layer.bq, layer.wk, layer.bk, layer.wv, layer.bv, layer.q_norm, layer.k_norm)

    q, k, v, residual = _call(compiled_piece(spec, "first"), input_ids, positions, m.embed, m.cos_sin_cache,
                              *wts(L[0]))
    for i in range(len(L)):
        attn = attend(i, q, k, v)
        tail_w = (L[i].wo, L[i].ln2, L[i].w_gate, L[i].w_up, L[i].w_down)
        if i + 1 < len(L):
            q, k, v, residual = _call(compiled_piece(spec, "mid"), attn, residual, positions, m.cos_sin_cache,
                                      *tail_w, *wts(L[i + 1]))
            if layer_states is not None:
                layer_states.append(residual)
        else:
            hidden, residual = _call(compiled_piece(spec, "last"), attn, residual, *tail_w, m.final_norm)
            if layer_states is not None:
                layer_states.append(residual)
    return hidden


def run_model_whole(spec: _Spec, m, input_ids: Tensor, positions: Tensor, past: list, bsz: int,
                    layer_states: list | None) -> tuple[Tensor, list]:
    """One forward of ``m`` (an ``EngineModel`` of ``vllm-cpu-compiled``) as one compiled graph. ``past``: per layer
    [K, V] of the cache, (B, H_kv, T_past, D), empty along T on a prefill. Returns (final hidden (N, hidden), new
    K/V per layer)."""
    fn = compiled_piece(spec, "whole")
    layer_w = [(L.ln1, L.wq, L.bq, L.wk, L.bk, L.wv, L.bv, L.q_norm, L.k_norm, L.wo, L.ln2, L.w_gate, L.w_up,
                L.w_down) for L in m.layers]
    for t in past:
        if t.shape[2] > 1:
            torch._dynamo.maybe_mark_dynamic(t, 2)
    hidden, new_kv, states = _call(fn, input_ids, positions, m.embed, m.cos_sin_cache, m.final_norm, layer_w, past,
                                   bsz, m.attention_handle)
    if layer_states is not None:
        layer_states.extend(t.to(m.dtype) for t in states)
    return hidden, new_kv
