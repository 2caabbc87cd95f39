"""roundalign.bridge.vllm_flash (attn=vllm_flash) on CPU, against a stand-in for vLLM 0.31.0's ``vllm.vllm_flash_attn``.

This environment has no vLLM, let alone its CUDA build, and no GPU, so the kernel itself cannot run here. What is
checked is everything around it: the stand-in's ``flash_attn_varlen_func`` and ``get_scheduler_metadata`` have
exactly the signatures of vLLM 0.31.0 (``tests/fixtures/vllm_0_31_0_flash_attn.txt``, verbatim excerpts of the
released wheel: ``vllm/vllm_flash_attn/flash_attn_interface.py`` and ``vllm/v1/attention/backends/flash_attn.py``),
read K/V through the paged cache and block table as the CUDA kernels do, and compute attention from the float64
formula rounded to the input dtype, independently of the bridge. Then

(a) the bridge's forward over a left-padded batch is the stand-in run on each request alone, bitwise, and padded
    query rows are zero (so the varlen batch, cache layout, block table and scatter back are right);
(b) its backward is torch SDPA's gradient at the same q/k/v, bitwise, per request;
(c) it passes the keywords and values vLLM's FlashAttention backend passes for a prefill (flash_attn.py:1450-1475,
    :655-669, :1149-1155), on Hopper (FA3, AOT scheduler metadata) and Ampere (FA2, none);
(d) it fails clearly: no CUDA, no vLLM, a CPU build, head size, dtype, dropout, sliding window/softcap in training,
    VLLM_BATCH_INVARIANT, GPUs whose stock vLLM backend is not FlashAttention; train's preflight and the emulated
    engine refuse vllm_flash before anything runs.

Set ``ROUNDALIGN_VLLM_SRC`` to a folder holding ``vllm/`` of 0.31.0 (e.g. an unpacked wheel) to check the fixture
against the sources as well.
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import inspect
import json
import math
import os
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
from transformers.utils.generic import is_flash_attention_requested

from roundalign.bridge import vllm_flash
from roundalign.engine import Engine
from roundalign.models.load import load_model
from roundalign.models.tiny import random_qwen
from roundalign.training.config import ConfigError, TrainConfig
from roundalign.training.preflight import preflight

torch.set_num_threads(1)

FIXTURE = Path(__file__).parent / "fixtures" / "vllm_0_31_0_flash_attn.txt"
DEFAULT_FA_VERSION = 2  # flash_attn_interface.py:49


def _sections() -> dict[str, str]:
    out, name = {}, None
    for line in FIXTURE.read_text().splitlines():
        if line.startswith("## "):
            name = line[3:]
            out[name] = []
        elif name is not None:
            out[name].append(line)
    return {k: "\n".join(v) + "\n" for k, v in out.items()}


SECTIONS = _sections()


def _def(section: str) -> ast.FunctionDef:
    return ast.parse(SECTIONS[section] + "    ...\n").body[0]


def _call_keywords(section: str) -> list[str]:
    call = ast.parse(textwrap.dedent(SECTIONS[section]).removeprefix("return ")).body[0].value
    return [kw.arg for kw in call.keywords]


# ---------------------------------------------------------------------------------------------------------------
# the stand-in: vLLM 0.31.0's signatures, the float64 formula inside


def flash_attn_varlen_func(
    q,
    k,
    v,
    max_seqlen_q,
    cu_seqlens_q,
    max_seqlen_k,
    cu_seqlens_k=None,  # only used for non-paged prefill
    seqused_k=None,
    q_v=None,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size: list[int] | None = None,
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
    return_softmax_lse=False,
    out=None,
    # FA3 Only
    scheduler_metadata=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    num_splits: int = 0,
    # FA4 Only
    output_scale=None,
    # Version selector
    fa_version: int = DEFAULT_FA_VERSION,
    s_aux=None,
    cp_world_size=1,
    cp_rank=0,
    cp_tot_seqused_k=None,
    # FA4 only
    mask_mod=None,
    block_sparse_tensors=None,
    aux_tensors=None,
    aux_tensor_leading_dims=None,
    dynamic_causal: "torch.Tensor | None" = None,  # noqa: UP037  (vLLM 0.31.0 spells it so; compared verbatim)
):
    """Attention from the formula, in float64, rounded to q's dtype; K/V read as FlashAttention reads them: through
    ``block_table``/``seqused_k`` from a paged cache (num_pages, page_size, H_kv, D), or ``cu_seqlens_k`` from a packed
    (total_k, H_kv, D). Causal masks are bottom-right aligned; a row that sees no key is zero (the interface's
    docstring, flash_attn_interface.py:224-238)."""
    assert cu_seqlens_k is not None or seqused_k is not None
    assert (cu_seqlens_k is None) != (seqused_k is None)
    assert block_table is None or seqused_k is not None
    assert dropout_p == 0.0 and alibi_slopes is None and s_aux is None and mask_mod is None and q_v is None
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    wl, wr = (-1, -1) if window_size is None else window_size
    nh, nkv = q.shape[1], k.shape[-2]
    rows = []
    for i in range(cu_seqlens_q.numel() - 1):
        qi = q[int(cu_seqlens_q[i]):int(cu_seqlens_q[i + 1])].double()
        if block_table is not None:
            m = int(seqused_k[i])
            pos = torch.arange(m)
            blk, off = block_table[i].long()[pos // k.shape[1]], pos % k.shape[1]
            ki, vi = k[blk, off].double(), v[blk, off].double()
        else:
            ki = k[int(cu_seqlens_k[i]):int(cu_seqlens_k[i + 1])].double()
            vi = v[int(cu_seqlens_k[i]):int(cu_seqlens_k[i + 1])].double()
            m = ki.shape[0]
        n = qi.shape[0]
        ki, vi = ki.repeat_interleave(nh // nkv, 1), vi.repeat_interleave(nh // nkv, 1)
        s = torch.einsum("qhd,khd->hqk", qi, ki) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        row = torch.arange(n)[:, None] + (m - n)  # query i's own key position
        col = torch.arange(m)[None, :]
        keep = torch.ones(n, m, dtype=torch.bool)
        if causal:
            keep &= col <= row
        if wl >= 0:
            keep &= col >= row - wl
        if wr >= 0:
            keep &= col <= row + wr
        p = torch.softmax(s.masked_fill(~keep, -math.inf), -1).nan_to_num(0.0)
        rows.append(torch.einsum("hqk,khd->qhd", p, vi).to(q.dtype))
    res = torch.cat(rows)
    if out is None:
        return res
    out.copy_(res)
    return out


def get_scheduler_metadata(
    batch_size,
    max_seqlen_q,
    max_seqlen_k,
    num_heads_q,
    num_heads_kv,
    headdim,
    cache_seqlens: torch.Tensor,
    qkv_dtype=torch.bfloat16,
    headdim_v=None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k_new: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    page_size: int | None = None,
    max_seqlen_k_new=0,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    has_softcap=False,
    num_splits=0,  # Can be tuned for speed
    pack_gqa=None,  # Can be tuned for speed
    sm_margin=0,  # Can be tuned if some SMs are used for communication
):
    return torch.zeros(1 + 4 * batch_size, dtype=torch.int32)  # a tile-count semaphore and per-batch vectors


class StandIn:
    """``vllm``, ``vllm.vllm_flash_attn`` and ``vllm.v1.attention.backends.fa_utils`` as modules, recording calls."""

    def __init__(self, version: int):
        self.version = version
        self.calls, self.sched_calls, self.version_calls = [], [], []

    def install(self, monkeypatch):
        def varlen(*args, **kwargs):
            self.calls.append((args, kwargs))
            return flash_attn_varlen_func(*args, **kwargs)

        def sched(*args, **kwargs):
            self.sched_calls.append((args, kwargs))
            res = get_scheduler_metadata(*args, **kwargs)
            self.sched_result = res
            return res

        def get_flash_attn_version(*args, **kwargs):  # fa_utils.py:74-82; records what the bridge passes
            assert not args
            self.version_calls.append(kwargs)
            return self.version

        mods = {name: types.ModuleType(name) for name in (
            "vllm", "vllm.vllm_flash_attn", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.backends",
            "vllm.v1.attention.backends.fa_utils")}
        mods["vllm.vllm_flash_attn"].flash_attn_varlen_func = varlen
        mods["vllm.vllm_flash_attn"].get_scheduler_metadata = sched
        mods["vllm.v1.attention.backends.fa_utils"].get_flash_attn_version = get_flash_attn_version
        for name, mod in mods.items():
            monkeypatch.setitem(sys.modules, name, mod)
        monkeypatch.setattr(vllm_flash, "_check_device", lambda t: None)  # the stand-in runs on CPU
        monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
        return self


@pytest.fixture(params=[3, 2], ids=["hopper-fa3", "ampere-fa2"])
def stand_in(request, monkeypatch):
    return StandIn(request.param).install(monkeypatch)


def _qkv(seed, b=3, h=4, h_kv=2, t=37, d=32, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, t, d, generator=g).to(dtype).requires_grad_() for n in (h, h_kv, h_kv)]


def _left_padded_mask(lengths, t):
    """A boolean (B, 1, T, T) causal mask of left-padded sequences, as transformers' sdpa_mask builds it."""
    am = torch.zeros(len(lengths), t, dtype=torch.bool)
    for i, n in enumerate(lengths):
        am[i, t - n:] = True
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    return (causal & am[:, None, :] & am[:, :, None])[:, None]


def _attention_f64(q, k, v, scale):
    """Causal softmax attention in float64 from the formula: (H, n, D) queries, (H_kv, n, D) keys/values."""
    rep = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    n = q.shape[1]
    s = ((q @ k.transpose(1, 2)) * scale).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), -math.inf)
    return torch.softmax(s, -1) @ v


# ---------------------------------------------------------------------------------------------------------------
# the fixture and the stand-in are vLLM 0.31.0's


def test_stand_in_signatures_are_vllm_0_31_0s():
    for fn, section in ((flash_attn_varlen_func, "vllm/vllm_flash_attn/flash_attn_interface.py:176-217"),
                        (get_scheduler_metadata, "vllm/vllm_flash_attn/flash_attn_interface.py:122-143")):
        ours = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
        theirs = _def(section)
        assert ours.name == theirs.name
        assert ast.dump(ours.args) == ast.dump(theirs.args), fn.__name__
    assert SECTIONS["vllm/vllm_flash_attn/flash_attn_interface.py:49-49"].strip() == \
        f"DEFAULT_FA_VERSION = {DEFAULT_FA_VERSION}"


def test_fixture_is_verbatim_where_the_sources_are_at_hand():
    root = os.environ.get("ROUNDALIGN_VLLM_SRC")
    if not root:
        pytest.skip("set ROUNDALIGN_VLLM_SRC to a folder holding vllm/ of vLLM 0.31.0 to compare the fixture with it")
    for section, text in SECTIONS.items():
        path, lines = section.rsplit(":", 1)
        first, last = map(int, lines.split("-"))
        src = (Path(root) / path).read_text().splitlines()[first - 1:last]
        assert "\n".join(src) + "\n" == text, section


def test_stand_in_is_the_formula():
    q, k, v = (x.detach()[0].transpose(0, 1).contiguous() for x in _qkv(9, b=1, t=11))
    cu = torch.tensor([0, 11], dtype=torch.int32)
    got = flash_attn_varlen_func(q, k, v, 11, cu, 11, cu_seqlens_k=cu, softmax_scale=0.3, causal=True)
    want = _attention_f64(*(x.transpose(0, 1).double() for x in (q, k, v)), 0.3).transpose(0, 1)
    assert (got.double() - want).abs().max() <= 2 ** -7 * want.abs().max()  # the same math, rounded once


# ---------------------------------------------------------------------------------------------------------------
# (a) forward, (b) backward


def test_forward_is_the_kernel_per_request_and_backward_is_sdpas_gradient(stand_in):
    lengths, t = (37, 20, 5), 37
    q, k, v = _qkv(0, t=t)
    mask = _left_padded_mask(lengths, t)
    scale = 32 ** -0.5
    out, _ = vllm_flash.vllm_flash_attention(None, q, k, v, mask, scaling=scale)
    assert type(out.grad_fn).__name__ == "VllmFlashAttentionFunctionBackward"
    assert len(stand_in.calls) == 1  # the whole batch is one varlen call
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    for b, n in enumerate(lengths):
        sl = slice(t - n, t)
        qb, kb, vb = (x.detach()[b, :, sl].clone() for x in (q, k, v))
        # (a) the kernel on the request alone, K/V passed packed (no cache), bitwise
        cu = torch.tensor([0, n], dtype=torch.int32)
        ref = flash_attn_varlen_func(qb.transpose(0, 1).contiguous(), kb.transpose(0, 1).contiguous(),
                                     vb.transpose(0, 1).contiguous(), n, cu, n, cu_seqlens_k=cu,
                                     softmax_scale=scale, causal=True)
        assert torch.equal(out[b, sl].detach(), ref)
        assert torch.count_nonzero(out[b, :t - n]) == 0  # padded query rows
        # (b) torch SDPA's gradient at the same q/k/v, bitwise
        qs, ks, vs = (x.clone().requires_grad_() for x in (qb, kb, vb))
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        gq, gk, gv = torch.autograd.grad(o, (qs, ks, vs), dout[b, sl].transpose(0, 1))
        assert torch.equal(dq[b, :, sl], gq) and torch.equal(dk[b, :, sl], gk) and torch.equal(dv[b, :, sl], gv)
        for g in (dq, dk, dv):  # nothing flows into padding
            assert torch.count_nonzero(g[b, :, :t - n]) == 0
        # and both are the formula's to bf16 resolution
        q64, k64, v64 = (x.double().requires_grad_() for x in (qb, kb, vb))
        o64 = _attention_f64(q64, k64, v64, scale)
        rel = float((ref.double().transpose(0, 1) - o64.detach()).norm() / o64.detach().norm())
        assert rel < 1e-2, rel
        want = torch.autograd.grad(o64, (q64, k64, v64), dout[b, sl].transpose(0, 1).double())
        for got, w in zip((dq[b, :, sl], dk[b, :, sl], dv[b, :, sl]), want):
            assert float((got.double() - w).norm() / w.norm()) < 1e-2


def test_queries_behind_cached_keys_are_bottom_right_causal(stand_in):
    # 5 new queries against 12 positions (a cached forward): query i sees keys 0 .. 7 + i, forward and backward
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 5, 32, generator=g).to(torch.bfloat16).requires_grad_()
    k, v = (torch.randn(1, 2, 12, 32, generator=g).to(torch.bfloat16).requires_grad_() for _ in range(2))
    out, _ = vllm_flash.vllm_flash_attention(None, q, k, v, None, scaling=0.2)
    (_, kw), = stand_in.calls
    assert kw["max_seqlen_q"] == 5 and kw["max_seqlen_k"] == 12 and kw["cu_seqlens_q"].tolist() == [0, 5]
    dout = torch.randn(out.shape, generator=g).to(torch.bfloat16)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (x.detach()[0].double().requires_grad_() for x in (q, k, v))
    s = (q64 @ k64.repeat_interleave(2, 0).transpose(1, 2)) * 0.2
    o64 = torch.softmax(s.masked_fill(~torch.ones(5, 12, dtype=torch.bool).tril(diagonal=7), -math.inf), -1) \
        @ v64.repeat_interleave(2, 0)
    want = torch.autograd.grad(o64, (q64, k64, v64), dout[0].transpose(0, 1).double())
    for got, w in zip(grads, want):
        assert float((got[0].double() - w).norm() / w.norm()) < 1e-2
    assert float((out[0].detach().double().transpose(0, 1) - o64.detach()).norm() / o64.detach().norm()) < 1e-2


# ---------------------------------------------------------------------------------------------------------------
# (c) the arguments are the backend's


def test_passes_what_vllms_flash_attention_backend_passes_for_a_prefill(stand_in):
    lengths, t, d, nh, nkv = (37, 20, 5), 37, 32, 4, 2
    q, k, v = _qkv(4, t=t, d=d)
    with torch.no_grad():
        out, _ = vllm_flash.vllm_flash_attention(None, q, k, v, _left_padded_mask(lengths, t), scaling=0.125)
    (args, kw), = stand_in.calls
    assert args == ()
    # the very keywords, in the order, of FlashAttentionImpl.forward's call (flash_attn.py:1450-1475)
    assert list(kw) == _call_keywords("vllm/v1/attention/backends/flash_attn.py:1450-1475")
    total_q = sum(lengths)
    assert kw["q"].shape == (total_q, nh, d) and kw["out"].shape == (total_q, nh, d)
    assert kw["cu_seqlens_q"].dtype == torch.int32 and kw["cu_seqlens_q"].tolist() == [0, 37, 57, 62]
    assert kw["seqused_k"].dtype == torch.int32 and kw["seqused_k"].tolist() == list(lengths)
    assert kw["max_seqlen_q"] == 37 and kw["max_seqlen_k"] == 37
    assert kw["softmax_scale"] == 0.125 and kw["causal"] is True and kw["window_size"] == [-1, -1]
    assert kw["softcap"] == 0 and kw["alibi_slopes"] is None and kw["s_aux"] is None and kw["dynamic_causal"] is None
    assert kw["mask_mod"] is None and kw["aux_tensors"] is None
    assert kw["num_splits"] == 0  # vllm-eager: no CUDA graphs, max_num_splits = 0 (flash_attn.py:856)
    assert kw["fa_version"] == stand_in.version
    for name in ("q_descale", "k_descale", "v_descale"):  # layer scales 1.0 expanded to (num_reqs, num_kv_heads)
        assert kw[name].shape == (3, nkv) and kw[name].dtype == torch.float32 and bool((kw[name] == 1).all())
    # K/V: the key/value halves of an LBNHC paged cache, block size 16, read through the block table
    key_cache, value_cache, bt = kw["k"], kw["v"], kw["block_table"]
    assert key_cache.shape == value_cache.shape and key_cache.shape[1:] == (16, nkv, d)
    assert key_cache.stride() == (16 * nkv * 2 * d, nkv * 2 * d, 2 * d, 1) == value_cache.stride()
    assert value_cache.data_ptr() - key_cache.data_ptr() == d * key_cache.element_size()
    assert bt.dtype == torch.int32 and bt.shape == (3, 3)  # ceil(37 / 16) blocks for the longest request
    used = [int(x) for i, n in enumerate(lengths) for x in bt[i, :math.ceil(n / 16)]]
    assert len(set(used)) == len(used) and 0 not in used  # distinct blocks; block 0 is vLLM's null block
    for i, n in enumerate(lengths):  # the cache holds each request's keys in order
        pos = torch.arange(n)
        cached = key_cache[bt[i].long()[pos // 16], pos % 16]
        assert torch.equal(cached, k.detach()[i, :, t - n:].transpose(0, 1))
    # FA3 (Hopper): AOT scheduler metadata of the same batch (flash_attn.py:655-669); FA2: none
    if stand_in.version == 3:
        (sargs, skw), = stand_in.sched_calls
        assert sargs == () and list(skw) == _call_keywords("vllm/v1/attention/backends/flash_attn.py:655-669")
        assert kw["scheduler_metadata"] is stand_in.sched_result
        assert (skw["batch_size"], skw["max_seqlen_q"], skw["max_seqlen_k"]) == (3, 37, 37)
        assert (skw["num_heads_q"], skw["num_heads_kv"], skw["headdim"]) == (nh, nkv, d)
        assert skw["cache_seqlens"] is kw["seqused_k"] and skw["cu_seqlens_q"] is kw["cu_seqlens_q"]
        assert skw["qkv_dtype"] == torch.bfloat16 and skw["page_size"] == 16 and skw["causal"] is True
        assert skw["window_size"] == (-1, -1) and skw["num_splits"] == 0
    else:
        assert stand_in.sched_calls == [] and kw["scheduler_metadata"] is None
    # the version is asked of vLLM as FlashAttentionImpl asks it (flash_attn.py:1149-1155)
    assert stand_in.version_calls[-1] == dict(requires_alibi=False, head_size=d, has_sinks=False,
                                              requires_softcap=False, supports_fa4_hd256=True)
    assert list(stand_in.version_calls[-1]) == _call_keywords("vllm/v1/attention/backends/flash_attn.py:1149-1155")


def test_register_sets_num_splits_and_no_grad_scoring_takes_a_sliding_window(stand_in, monkeypatch):
    monkeypatch.setitem(vllm_flash._settings, "max_num_splits", 0)
    vllm_flash.register(max_num_splits=vllm_flash.MAX_NUM_SPLITS_FOR_CUDA_GRAPH)
    q, k, v = _qkv(5, b=1, t=20)
    with torch.no_grad():
        out, _ = vllm_flash.vllm_flash_attention(None, q, k, v, None, scaling=0.2, sliding_window=4)
    (_, kw), = stand_in.calls
    assert kw["num_splits"] == 32 and kw["window_size"] == [3, 0]
    assert stand_in.version != 3 or stand_in.sched_calls[0][1]["num_splits"] == 32
    qq, kk, vv = (x.detach()[0].transpose(0, 1).contiguous() for x in (q, k, v))
    cu = torch.tensor([0, 20], dtype=torch.int32)
    ref = flash_attn_varlen_func(qq, kk, vv, 20, cu, 20, cu_seqlens_k=cu, softmax_scale=0.2, causal=True,
                                 window_size=[3, 0])
    assert torch.equal(out[0], ref)


def test_a_model_trains_through_the_bridge_and_load_model_switches_to_it(stand_in, tmp_path):
    vllm_flash.register()
    model = random_qwen("qwen2", tie=False, layers=2, hidden=128, heads=4, kv_heads=2, vocab=256, seed=5)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 256, (3, 12), generator=g)
    am = torch.ones_like(ids)
    am[1, :4] = 0
    am[2, :9] = 0
    grads = {}
    for attn in (vllm_flash.HF_ATTN_NAME, "sdpa"):
        model.set_attn_implementation(attn)
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, attention_mask=am, labels=ids.masked_fill(am == 0, -100)).loss.backward()
        grads[attn] = {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}
    assert len(stand_in.calls) == 2  # one varlen call per layer
    ours = grads[vllm_flash.HF_ATTN_NAME]
    num = sum(float((ours[n] - grads["sdpa"][n]).pow(2).sum()) for n in grads["sdpa"])
    den = sum(float(grads["sdpa"][n].pow(2).sum()) for n in grads["sdpa"])
    assert set(ours) == set(grads["sdpa"]) and math.isfinite(num) and num > 0
    assert math.sqrt(num / den) < 5e-2  # the same gradient up to bf16 noise
    model.save_pretrained(tmp_path / "m")
    loaded = load_model(str(tmp_path / "m"), attn="vllm_flash")
    assert loaded.config._attn_implementation == vllm_flash.HF_ATTN_NAME == "vllm_fa"
    # transformers takes any name with "flash" in it for flash-attn: why the bridge is registered as vllm_fa
    assert is_flash_attention_requested(requested_attention_implementation="vllm_flash")
    assert not is_flash_attention_requested(requested_attention_implementation=vllm_flash.HF_ATTN_NAME)


# ---------------------------------------------------------------------------------------------------------------
# (d) clear errors


def test_refuses_what_it_cannot_reproduce(stand_in, monkeypatch):
    q, k, v = _qkv(3, b=1, t=8)
    with pytest.raises(NotImplementedError, match="sliding window and softcap"):
        vllm_flash.vllm_flash_attention(None, q, k, v, None, sliding_window=4)
    with pytest.raises(NotImplementedError, match="sliding window and softcap"):
        vllm_flash.vllm_flash_attention(None, q, k, v, None, softcap=30.0)
    with pytest.raises(ValueError, match="no dropout"):
        vllm_flash.vllm_flash_attention(None, q, k, v, None, dropout=0.1)
    for d in (36, 272):
        qd, kd, vd = _qkv(3, b=1, t=8, d=d)
        with pytest.raises(ValueError, match=f"multiples of 8 up to 256.*head_dim={d}"):
            vllm_flash.vllm_flash_attention(None, qd, kd, vd, None)
    qf, kf, vf = _qkv(3, b=1, t=8, dtype=torch.float32)
    with pytest.raises(TypeError, match="fp16/bf16 only"):
        vllm_flash.vllm_flash_attention(None, qf, kf, vf, None)
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    with pytest.raises(RuntimeError, match="VLLM_BATCH_INVARIANT"):
        vllm_flash.vllm_flash_attention(None, q, k, v, None)
    monkeypatch.delenv("VLLM_BATCH_INVARIANT")
    stand_in.version = 4
    with pytest.raises(RuntimeError, match="version 4"):
        vllm_flash.vllm_flash_attention(None, q, k, v, None)


def test_needs_cuda_and_a_gpu_whose_stock_backend_is_flash_attention():
    q, k, v = _qkv(3, b=1, t=8)
    with pytest.raises(RuntimeError, match="must be on a CUDA GPU"):
        vllm_flash.vllm_flash_attention(None, q, k, v, None)
    assert vllm_flash.capability_problem((9, 0)) is None and vllm_flash.capability_problem((8, 0)) is None
    assert vllm_flash.capability_problem((12, 0)) is None
    assert "needs >= 8.0" in vllm_flash.capability_problem((7, 5))
    assert "FlashInfer" in vllm_flash.capability_problem((10, 0))


def test_needs_vllms_cuda_build(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(vllm_flash.VllmFlashUnavailable, match="needs vLLM's CUDA build"):
        vllm_flash._vllm()
    assert not vllm_flash.available()
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn", None)  # a CPU build: no CUDA extensions to import
    with pytest.raises(vllm_flash.VllmFlashUnavailable, match="CPU .*or ROCm build"):
        vllm_flash._vllm()


def test_cuda_build_problem_reads_the_installed_files(monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec

    def find(found):
        return lambda name, *a: found if name == "vllm" else real_find_spec(name, *a)

    monkeypatch.setattr(importlib.util, "find_spec", find(None))
    assert "not installed" in vllm_flash.cuda_build_problem()
    pkg = tmp_path / "vllm"
    (pkg / "vllm_flash_attn").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    spec = importlib.machinery.ModuleSpec("vllm", None, origin=str(pkg / "__init__.py"))
    monkeypatch.setattr(importlib.util, "find_spec", find(spec))
    monkeypatch.setattr(vllm_flash.importlib.metadata, "version", lambda name: "0.31.0")
    assert "no FlashAttention CUDA extensions" in vllm_flash.cuda_build_problem()
    (pkg / "vllm_flash_attn" / "_vllm_fa3_C.abi3.so").write_bytes(b"")
    assert vllm_flash.cuda_build_problem() is None
    monkeypatch.setattr(vllm_flash.importlib.metadata, "version", lambda name: "0.31.0+cpu")
    assert "CPU build" in vllm_flash.cuda_build_problem()


def _tiny_model_dir(tmp_path, hidden=128, heads=4):
    d = tmp_path / f"m{hidden}x{heads}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": hidden,
                                               "num_attention_heads": heads}))
    return str(d)


def test_preflight_refuses_vllm_flash_before_anything_loads(tmp_path, monkeypatch):
    model = _tiny_model_dir(tmp_path)

    def refused(match, **kw):
        with pytest.raises(RuntimeError, match=match):
            preflight(TrainConfig(model=model, attn="vllm_flash", **kw), tmp_path / "out")

    refused("the emulated engine runs on CPU")
    refused("engine 'vllm-cpu-eager' runs on CPU", backend="vllm", engine="vllm-cpu-eager")
    refused("use --engine vllm-eager", backend="vllm", engine="vllm-compiled")
    refused("fp16/bf16 only", backend="vllm", engine="vllm-eager", variant="fp32")
    monkeypatch.setattr(vllm_flash, "cuda_build_problem", lambda: "vLLM is not installed here")
    refused("needs vLLM's CUDA build.*not installed", backend="vllm", engine="vllm-eager")
    monkeypatch.setattr(vllm_flash, "cuda_build_problem", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    refused("needs a CUDA GPU", backend="vllm", engine="vllm-eager")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (10, 0))
    refused("FlashInfer", backend="vllm", engine="vllm-eager")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    with pytest.raises(RuntimeError, match="head_dim=36"):
        preflight(TrainConfig(model=_tiny_model_dir(tmp_path, 144, 4), attn="vllm_flash", backend="vllm",
                              engine="vllm-eager"), tmp_path / "out")


def test_the_emulated_engine_refuses_vllm_flash():
    model = random_qwen("qwen2", layers=1, hidden=64, heads=2, kv_heads=1, vocab=64, seed=0)
    with pytest.raises(ValueError, match="unknown attention implementation 'vllm_flash'.*eager, sdpa, vllm_cpu"):
        Engine(model, attn="vllm_flash")
    with pytest.raises(ConfigError, match="engine_attn_decode='vllm_flash'"):
        TrainConfig(model="m", engine_attn_decode="vllm_flash")
