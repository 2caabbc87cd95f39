"""vLLM 0.31.0's native formulas, copied as written (vLLM is not a CPU dependency of this project).

These are what vLLM's default compiled path (-O2, ``CompilationMode.VLLM_COMPILE``, Inductor) runs: under
Inductor ``custom_ops`` is "none" and the RMSNorm IR ops lower to their ``native`` implementation
(``ir_op_priority``), so these Python formulas are traced into vLLM's FX graph, split into pieces at each
attention call and compiled piece by piece. ``roundalign.engine.compiled`` builds the emulated
``vllm-compiled`` engine from them the same way; ``tests/test_inductor.py`` and ``tools/gpu_check.py``
compare them compiled against the trainer's regions.

Sources (vllm-0.31.0 wheel):
- ``vllm/ir/ops/layernorm.py``: ``rms_norm``, ``fused_add_rms_norm`` (the ``native`` implementations that
  ``vllm/compilation/passes/ir/lowering_pass.py`` inlines into the graph);
- ``vllm/model_executor/layers/activation.py``: ``SiluAndMul.forward_native``;
- ``vllm/model_executor/layers/rotary_embedding/base.py``: ``RotaryEmbedding.forward_static``,
  ``_compute_cos_sin_cache`` (then ``.to(dtype)``: the cache is kept in the model dtype);
  ``.../rotary_embedding/common.py``: ``ApplyRotaryEmb.forward_static`` (``enable_fp32_compute=False``);
- ``.../rotary_embedding/{llama3_rope,linear_scaling_rope,dynamic_ntk_scaling_rope,yarn_scaling_rope}.py``: the
  scaled tables (``vllm_rope_table``);
- ``vllm/model_executor/models/qwen3.py``: ``Qwen3Attention.forward`` (per-head q/k norm before RoPE).

The only liberty taken: the RMSNorm mean of squares is written ``mean_sq(x_var)``, by default exactly
vLLM's ``x_var.pow(2).mean(dim=-1, keepdim=True)``; the emulated engine may pass an opaque op there that
runs the trainer's own eager reduction, so that the reduction order is not a difference between the two.
"""

import math

import torch
import torch.nn.functional as F

from roundalign.numerics.families import rope_type


def native_mean_sq(x_var):
    return x_var.pow(2).mean(dim=-1, keepdim=True)


def vllm_rms_norm(x, weight, epsilon, variance_size=None, mean_sq=native_mean_sq):
    """``vllm.ir.ops.rms_norm`` (native)."""
    orig_dtype = x.dtype
    x = x.to(torch.float32)
    x_var = x if variance_size is None else x[..., :variance_size]
    variance = mean_sq(x_var)
    x = x * torch.rsqrt(variance + epsilon)
    if weight is not None:
        x = x.to(weight.dtype) * weight
    return x.to(orig_dtype)


def vllm_fused_add_rms_norm(x, x_residual, weight, epsilon, variance_size=None, mean_sq=native_mean_sq):
    """``vllm.ir.ops.fused_add_rms_norm`` (native): returns ``(normed, x_residual)``."""
    orig_dtype = x.dtype
    x = x.to(torch.float32)
    x = x + x_residual.to(torch.float32)
    x_residual = x.to(orig_dtype)

    x_var = x if variance_size is None else x[..., :variance_size]
    variance = mean_sq(x_var)
    x = x * torch.rsqrt(variance + epsilon)
    if weight is not None:
        x = x.to(weight.dtype) * weight
    return x.to(orig_dtype), x_residual


def vllm_silu_and_mul(x):
    """``SiluAndMul.forward_native``: x is the merged gate_up projection output."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def vllm_apply_rotary_emb_torch(x, cos, sin, is_neox_style=True):
    """``ApplyRotaryEmb.forward_static`` with ``enable_fp32_compute=False``: x (T, H, rot_dim), cos/sin
    (T, rot_dim // 2)."""
    cos = cos.unsqueeze(-2).to(x.dtype)
    sin = sin.unsqueeze(-2).to(x.dtype)
    if is_neox_style:
        x1, x2 = torch.chunk(x, 2, dim=-1)
    else:
        x1 = x[..., ::2]
        x2 = x[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox_style:
        return torch.cat((o1, o2), dim=-1)
    return torch.stack((o1, o2), dim=-1).flatten(-2)


def vllm_rope_forward_native(positions, query, key, head_size, cos_sin_cache, is_neox_style=True):
    """``RotaryEmbedding.forward_static`` with rotary_dim == head_size."""
    positions = positions.flatten()
    num_tokens = positions.shape[0]
    cos_sin = cos_sin_cache.index_select(0, positions)
    cos, sin = cos_sin.chunk(2, dim=-1)

    query_shape = query.shape
    query = query.view(num_tokens, -1, head_size)
    query = vllm_apply_rotary_emb_torch(query, cos, sin, is_neox_style).reshape(query_shape)

    key_shape = key.shape
    key = key.view(num_tokens, -1, head_size)
    key = vllm_apply_rotary_emb_torch(key, cos, sin, is_neox_style).reshape(key_shape)
    return query, key


def vllm_llama3_inv_freq(inv_freqs, scaling_factor, low_freq_factor, high_freq_factor, orig_max_position):
    """``Llama3RotaryEmbedding._compute_inv_freq`` after the base class's (vllm/model_executor/layers/rotary_embedding/
    llama3_rope.py)."""
    low_freq_wavelen = orig_max_position / low_freq_factor
    high_freq_wavelen = orig_max_position / high_freq_factor

    wave_len = 2 * math.pi / inv_freqs
    if low_freq_factor != high_freq_factor:
        smooth = (orig_max_position / wave_len - low_freq_factor) / (
            high_freq_factor - low_freq_factor
        )
    else:
        smooth = 0
    new_freqs = torch.where(
        wave_len < high_freq_wavelen,
        inv_freqs,
        torch.where(
            wave_len > low_freq_wavelen,
            inv_freqs / scaling_factor,
            (1 - smooth) * inv_freqs / scaling_factor + smooth * inv_freqs,
        ),
    )
    return new_freqs


def vllm_cos_sin_cache(head_size, max_pos, base, dtype, device=None, llama3=None):
    """``RotaryEmbedding._compute_cos_sin_cache`` then ``.to(dtype)`` (vLLM keeps the cache in the model dtype);
    with ``llama3`` (the keyword arguments of ``vllm_llama3_inv_freq`` but the first) Llama 3's scaled frequencies."""
    inv_freq = _inv_freq(base, head_size, device)
    if llama3 is not None:
        inv_freq = vllm_llama3_inv_freq(inv_freq, **llama3)
    t = torch.arange(max_pos, dtype=torch.float, device=device)
    freqs = torch.einsum("i,j -> ij", t, inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


def _inv_freq(base, head_size, device=None):
    """``RotaryEmbedding._compute_inv_freq``."""
    return 1.0 / (base ** (torch.arange(0, head_size, 2, dtype=torch.float, device=device) / head_size))


#: the ``rope_type`` values ``vllm_rope_table`` builds, as ``get_rope`` (rotary_embedding/__init__.py) dispatches them
ROPE_TYPES = ("default", "llama3", "linear", "dynamic", "yarn")


def vllm_rope_table(head_size, max_pos, rope_parameters, dtype, device=None):
    """The bf16 cos/sin cache ``get_rope(head_size, max_pos, is_neox_style=True, rope_parameters=...)`` builds,
    for the rope types of ``ROPE_TYPES`` (full rotary dim; no ``partial_rotary_factor``, ``mrope_section``, dual-chunk
    or ``alpha`` variants). Sources, vllm-0.31.0: ``rotary_embedding/{base,llama3_rope,linear_scaling_rope,
    dynamic_ntk_scaling_rope,yarn_scaling_rope,common}.py``. The table has ``max_pos`` rows, ``max_pos * factor``
    for linear and ``original_max_position_embeddings * factor`` for YaRN, as vLLM's."""
    rope = dict(rope_parameters or {})
    kind = rope_type(rope)
    base = rope.get("rope_theta", 10000)
    if kind not in ROPE_TYPES:
        raise ValueError(f"vLLM's {kind!r} RoPE table is not emulated; emulated: {', '.join(ROPE_TYPES)}")
    if kind == "default":
        return vllm_cos_sin_cache(head_size, max_pos, base, dtype, device)
    if kind == "llama3":
        return vllm_cos_sin_cache(head_size, max_pos, base, dtype, device, llama3=dict(
            scaling_factor=rope["factor"], low_freq_factor=rope["low_freq_factor"],
            high_freq_factor=rope["high_freq_factor"], orig_max_position=rope["original_max_position_embeddings"]))
    factor = rope["factor"]
    scale = 1.0
    if kind == "linear":  # LinearScalingRotaryEmbedding: the positions are divided, not the frequencies
        inv_freq = _inv_freq(base, head_size, device)
        t = torch.arange(max_pos * factor, dtype=torch.float, device=device) / factor
    elif kind == "dynamic":  # DynamicNTKScalingRotaryEmbedding
        trained = rope.get("max_trained_positions", max_pos)
        base = base * ((factor * max_pos / trained) - (factor - 1)) ** (head_size / (head_size - 2))
        inv_freq = _inv_freq(base, head_size, device)
        t = torch.arange(max_pos, dtype=torch.float, device=device)
    else:  # YaRNScalingRotaryEmbedding, built by get_rope with max_position = original_max_position_embeddings
        inv_freq, scale = _yarn(head_size, rope["original_max_position_embeddings"], base, factor, rope, device)
        t = torch.arange(rope["original_max_position_embeddings"] * factor, dtype=torch.float32, device=device)
    freqs = torch.einsum("i,j -> ij", t, inv_freq)
    return torch.cat((freqs.cos() * scale, freqs.sin() * scale), dim=-1).to(dtype)  # scale 1.0 but for YaRN: exact


def _yarn_mscale(scale=1, mscale=1):
    """``yarn_get_mscale``."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rotary_dim, max_pos, base, factor, rope, device):
    """``YaRNScalingRotaryEmbedding.__init__``'s mscale and ``_compute_inv_freq``, with ``yarn_find_correction_range``
    and ``yarn_linear_ramp_mask``."""
    beta_fast, beta_slow = rope.get("beta_fast", 32), rope.get("beta_slow", 1)
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if rope.get("attention_factor") is not None:
        scale = float(rope["attention_factor"])
    elif mscale and mscale_all_dim:
        scale = float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    else:
        scale = float(_yarn_mscale(factor))
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float, device=device) / rotary_dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)

    def correction_dim(rotations):
        return (rotary_dim * math.log(max_pos / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(rotary_dim // 2, dtype=torch.float) - low) / (high - low), 0, 1).to(device)
    inv_freq_mask = 1 - ramp
    inv_freq = inv_freq_interpolation * (1 - inv_freq_mask) + inv_freq_extrapolation * inv_freq_mask
    return inv_freq, scale


def vllm_qwen3_qk_norm(q, k, q_weight, k_weight, head_dim, eps=1e-6, mean_sq=native_mean_sq):
    """``Qwen3Attention.forward`` between the qkv split and RoPE: per-head q/k RMSNorm."""
    q_by_head = q.view(*q.shape[:-1], q.shape[-1] // head_dim, head_dim)
    q_by_head = vllm_rms_norm(q_by_head, q_weight, eps, mean_sq=mean_sq)
    q = q_by_head.view(q.shape)
    k_by_head = k.view(*k.shape[:-1], k.shape[-1] // head_dim, head_dim)
    k_by_head = vllm_rms_norm(k_by_head, k_weight, eps, mean_sq=mean_sq)
    k = k_by_head.view(k.shape)
    return q, k


def vllm_qwen3_qk_norm_rope(positions, q, k, q_weight, k_weight, cos_sin_cache, head_dim, eps=1e-6):
    """Qwen3Attention.forward between the qkv split and attention: per-head q/k RMSNorm, then RoPE."""
    q, k = vllm_qwen3_qk_norm(q, k, q_weight, k_weight, head_dim, eps)
    return vllm_rope_forward_native(positions, q, k, head_dim, cos_sin_cache)
