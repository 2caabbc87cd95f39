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
- residual add + RMSNorm: every RMSNorm multiplies by its weight in fp32 and rounds once; under the
  compiled engine the norm after a residual add reads the UNROUNDED fp32 sum. To get that sum to the
  next layer without touching ``Qwen2Model.forward``, an aligned decoder layer returns the fp32 sum
  itself; the next layer (or the final norm) reads it, and stores ``sum.to(bf16)`` as its residual,
  which is bitwise the residual stream HF would have stored. Qwen3's q/k norms follow the same rule,
  and under the compiled engine their fp32 output flows straight into RoPE (one rounding after RoPE).

Matmuls (q/k/v/o, gate/up/down, lm_head) and the attention kernel are untouched: the modules' own
``nn.Linear`` and ``ALL_ATTENTION_FUNCTIONS`` interface run exactly as in stock transformers.

Mechanics: the ``forward`` of individual module *instances* (decoder layers, attention, MLP, RMSNorms)
is replaced by an instance attribute; classes are never patched, so two models in one process
keep their own numerics. ``apply_alignment(model, "baseline")`` deletes those attributes again.

Guarantees (each enforced by a test in ``tests/test_patch.py``):

- baseline, or a model never aligned: outputs bitwise equal to stock transformers;
- fp32 model: every variant is bitwise equal to stock transformers (the fused formulas keep HF's
  operation order, so without bf16 rounding they compute the same bits);
- with the variant ``full``, the trainer's forward equals the emulated engine bitwise when both use
  the same GEMMs and eager attention (``tests/test_engine.py``);
- autograd flows through every replaced forward (no ``torch.no_grad``, no in-place ops).

The replaced forwards re-state the stock forwards of transformers==5.17.0 (pinned);
``tests/test_patch.py::test_forwards_mirror_stock_transformers`` fails loudly when they drift.
"""

from __future__ import annotations

import sys
import types

import torch
from torch import nn

from . import regions
from .plan import RoundingPlan, check_engine, check_variant, plan_for

SUPPORTED_MODEL_CLASSES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2Model", "Qwen3Model")
_STATE_ATTR = "_roundalign_state"  # (variant, engine, kernels) on the top-level model
_PLAN_ATTR = "_roundalign_plan"  # RoundingPlan on each patched submodule
_KERNELS_ATTR = "_roundalign_kernels"  # regions.region_kernels(mode) namespace on each patched submodule


def decoder_trunk(model: nn.Module) -> nn.Module:
    """The ``Qwen*Model`` inside ``model`` (or ``model`` itself)."""
    cls = type(model).__name__
    if cls not in SUPPORTED_MODEL_CLASSES:
        raise TypeError(
            f"unsupported model class {cls}; roundalign supports {', '.join(SUPPORTED_MODEL_CLASSES)} "
            "(Qwen2.5 checkpoints load as Qwen2). Other architectures round in other places and need their own "
            "alignment."
        )
    return model.model if hasattr(model, "lm_head") else model


def _is_qwen3(attn: nn.Module) -> bool:
    return hasattr(attn, "q_norm")


# ----------------------------------------------------------------------------------------------
# Replacement forwards. Each reads its RoundingPlan from the instance.


def _rmsnorm_forward(self, hidden_states, residual=None):
    """RMSNorm with one rounding. With ``residual``: add first, as the engine's fused add+norm does, and
    return ``(normed, new_residual)``; the plan says whether the norm reads the fp32 or the rounded sum.
    Reads an unrounded fp32 ``hidden_states`` when the previous aligned layer returned one."""
    K = getattr(self, _KERNELS_ATTR)
    if residual is None:
        return K.rmsnorm_fused(hidden_states, self.weight, self.variance_epsilon)
    if getattr(self, _PLAN_ATTR).residual == "fp32":
        return K.add_rmsnorm_fp32_sum(hidden_states, residual, self.weight, self.variance_epsilon)
    return K.add_rmsnorm_bf16_sum(hidden_states, residual, self.weight, self.variance_epsilon)


def _rmsnorm_keep_fp32_forward(self, hidden_states):
    """Qwen3 q/k norm inside a fused norm+RoPE kernel: the normalized value stays fp32 for RoPE."""
    return getattr(self, _KERNELS_ATTR).rmsnorm_fused(hidden_states, self.weight, self.variance_epsilon,
                                                      keep_fp32=True)


def _decoder_layer_forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                           use_cache=False, position_embeddings=None, **kwargs):
    """Qwen2/Qwen3 decoder layer with aligned add + RMSNorm (installed only when plan.norm == "fused").

    ``hidden_states`` is the bf16 residual stream, or under ``residual == "fp32"`` (every layer but the
    first) the unrounded fp32 sum returned by the previous aligned layer. Norms are called as modules
    (not through their weights) so that parameter-gathering hooks (DeepSpeed ZeRO-3) still fire."""
    plan: RoundingPlan = getattr(self, _PLAN_ATTR)
    dtype = self.input_layernorm.weight.dtype
    residual = hidden_states.to(dtype)  # the residual stream HF stores: the sum rounded once
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(
        hidden_states=hidden_states,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        use_cache=use_cache,
        position_embeddings=position_embeddings,
        **kwargs,
    )
    hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
    hidden_states = self.mlp(hidden_states)
    if plan.residual == "fp32" and dtype != torch.float32:
        return residual.float() + hidden_states.float()  # unrounded: the next norm reads it
    return residual + hidden_states


def _mlp_forward(self, x):
    return self.down_proj(getattr(self, _KERNELS_ATTR).swiglu_fused(self.gate_proj(x), self.up_proj(x)))


def _qk_norm_rope(attn: nn.Module, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  plan: RoundingPlan, K) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k: (B, T, H, D) straight from the projections -> (B, H, T, D) after [q/k norm and] RoPE.
    The q/k norm modules' own (possibly aligned) forwards decide their rounding; under the fused
    norm->RoPE plan they return fp32, which ``rope_fused`` reads unrounded."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    out = []
    for x, norm in ((q, getattr(attn, "q_norm", None)), (k, getattr(attn, "k_norm", None))):
        if norm is not None:
            x = norm(x)
        x = x.transpose(1, 2)
        out.append(K.rope_fused(x, cos, sin) if plan.rope == "fused" else regions.rope_hf(x, cos, sin))
    return out[0], out[1]


def _attention_forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
    """Stock Qwen2/Qwen3 attention forward with the q/k norm + RoPE step per the plan."""
    plan: RoundingPlan = getattr(self, _PLAN_ATTR)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)

    query_states = self.q_proj(hidden_states).view(hidden_shape)
    key_states = self.k_proj(hidden_states).view(hidden_shape)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

    cos, sin = position_embeddings
    query_states, key_states = _qk_norm_rope(self, query_states, key_states, cos, sin, plan,
                                             getattr(self, _KERNELS_ATTR))

    if past_key_values is not None:
        key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)

    hf_module = sys.modules[type(self).__module__]
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

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
        sliding_window=self.sliding_window,
        **kwargs,
    )
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    attn_output = self.o_proj(attn_output)
    return attn_output, attn_weights


# ----------------------------------------------------------------------------------------------


def _install(module: nn.Module, fn, plan: RoundingPlan, kernels) -> None:
    module.forward = types.MethodType(fn, module)
    setattr(module, _PLAN_ATTR, plan)
    setattr(module, _KERNELS_ATTR, kernels)


def _uninstall(module: nn.Module) -> None:
    for attr in ("forward", _PLAN_ATTR, _KERNELS_ATTR):
        module.__dict__.pop(attr, None)


def apply_alignment(model: nn.Module, variant: str, engine: str = "vllm-compiled", kernels: str = "eager"
                    ) -> nn.Module:
    """Make ``model`` round like ``engine`` in the regions ``variant`` selects; in place, returns ``model``.

    Args:
        model: a ``Qwen2ForCausalLM``/``Qwen3ForCausalLM`` (or their ``*Model`` trunk) instance.
            Qwen2.5 checkpoints load as Qwen2. Works in bf16 and fp16; in fp32 every variant is a
            bitwise no-op.
        variant: ``baseline`` (stock HF numerics), ``rope``, ``swiglu``, ``norm`` (residual add feeding
            RMSNorm and every other RMSNorm) or ``full`` (every region where the engine differs).
        engine: ``vllm-compiled`` (vLLM's default: Inductor-fused native formulas) or ``vllm-eager``
            (``enforce_eager=True``: vLLM's CUDA custom ops).
        kernels: how the fp32 regions run: ``eager`` (separate torch ops; the exact reference, bitwise
            equal to the emulated engine) or ``compiled`` (``torch.compile``: one fused kernel per region,
            cheaper, as vLLM's compiled engine runs them; Inductor may order the RMSNorm reduction
            differently, ~1e-5 of elements 1 ulp apart). Compilation happens on the first forward.

    Re-applying replaces the previous alignment (applying the same variant twice is the same as
    once). Only this instance changes; the transformers classes are not touched.
    """
    check_variant(variant)
    check_engine(engine)
    trunk = decoder_trunk(model)
    act = getattr(trunk.config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"roundalign aligns SwiGLU MLPs (hidden_act='silu'); this model has hidden_act={act!r}")
    plan = plan_for(engine, variant)
    K = regions.region_kernels(kernels)

    for layer in trunk.layers:
        attn = layer.self_attn
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        qk_norms = [attn.q_norm, attn.k_norm] if _is_qwen3(attn) else []
        for m in (layer, attn, layer.mlp, *norms, *qk_norms):
            _uninstall(m)
        if plan.norm == "fused":
            _install(layer, _decoder_layer_forward, plan, K)
            for m in norms:
                _install(m, _rmsnorm_forward, plan, K)
            for m in qk_norms:
                _install(m, _rmsnorm_keep_fp32_forward if plan.qk_norm_rope == "fused" else _rmsnorm_forward, plan, K)
        if plan.rope == "fused":
            _install(attn, _attention_forward, plan, K)
        if plan.swiglu == "fused":
            _install(layer.mlp, _mlp_forward, plan, K)
    _uninstall(trunk.norm)
    if plan.norm == "fused":
        _install(trunk.norm, _rmsnorm_forward, plan, K)
    setattr(model, _STATE_ATTR, (variant, engine, kernels))
    return model


def alignment_of(model: nn.Module) -> tuple[str, str, str]:
    """``(variant, engine, kernels)`` last applied to ``model``; ``("baseline", "vllm-compiled", "eager")`` if
    never aligned."""
    return getattr(model, _STATE_ATTR, ("baseline", "vllm-compiled", "eager"))
