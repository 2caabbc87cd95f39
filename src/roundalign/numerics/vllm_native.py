"""vLLM's ``forward_native`` formulas, copied as written (vLLM is not a CPU dependency of this project).

These are the reference the ``vllm-compiled`` rounding style is checked against: compiled with
``torch.compile`` (Inductor, as vLLM's default V1 path compiles them) they must equal
``roundalign.numerics.regions``' fused formulas (``tests/test_inductor.py`` on CPU,
``scripts/gpu_check.py`` with Triton on a GPU). Sources: vllm/model_executor/layers/layernorm.py
(``RMSNorm.forward_static``), activation.py (``SiluAndMul.forward_native``), rotary_embedding
(``_apply_rotary_emb_torch``, ``RotaryEmbedding.forward_native``, ``_compute_cos_sin_cache``) and
models/qwen3.py (``Qwen3Attention.forward``'s q/k norm before RoPE).
"""

import torch
import torch.nn.functional as F


def vllm_rms_norm(x, weight, eps, residual=None):
    """``RMSNorm.forward_static`` (no variance_size_override)."""
    orig_dtype = x.dtype
    x = x.to(torch.float32)
    if residual is not None:
        x = x + residual
        residual = x.to(orig_dtype)
    variance = x.pow(2).mean(dim=-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    x = x.to(orig_dtype)
    if weight is not None:
        x = x * weight
    if residual is None:
        return x
    return x, residual


def vllm_silu_and_mul(x):
    """``SiluAndMul.forward_native``: x is the merged gate_up projection output."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def vllm_apply_rotary_emb_torch(x, cos, sin, is_neox_style=True):
    """``_apply_rotary_emb_torch``: x (T, H, rot_dim), cos/sin (T, rot_dim // 2)."""
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
    """``RotaryEmbedding.forward_native`` with rotary_dim == head_size."""
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


def vllm_cos_sin_cache(head_size, max_pos, base, dtype, device=None):
    """``RotaryEmbedding._compute_cos_sin_cache`` then ``.to(dtype)`` (vLLM keeps the cache in the model dtype)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_size, 2, dtype=torch.float, device=device) / head_size))
    t = torch.arange(max_pos, dtype=torch.float, device=device)
    freqs = torch.einsum("i,j -> ij", t, inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


def vllm_qwen3_qk_norm_rope(positions, q, k, q_weight, k_weight, cos_sin_cache, head_dim, eps=1e-6):
    """Qwen3Attention.forward between the qkv split and attention: per-head q/k RMSNorm, then RoPE."""
    q_by_head = q.view(*q.shape[:-1], q.shape[-1] // head_dim, head_dim)
    q_by_head = vllm_rms_norm(q_by_head, q_weight, eps)
    q = q_by_head.view(q.shape)
    k_by_head = k.view(*k.shape[:-1], k.shape[-1] // head_dim, head_dim)
    k_by_head = vllm_rms_norm(k_by_head, k_weight, eps)
    k = k_by_head.view(k.shape)
    return vllm_rope_forward_native(positions, q, k, head_dim, cos_sin_cache)
