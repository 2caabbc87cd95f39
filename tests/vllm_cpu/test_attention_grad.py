"""Training with vLLM-CPU's own attention: ``VllmCpuAttentionFunction`` (roundalign.bridge.vllm_cpu_attention), the engine's forward
with SDPA's gradient at the same q/k/v.

References, none of them ours: vLLM's ops called directly (the forward), torch's SDPA (the backward it claims to
be), a float64 softmax-attention formula differentiated by autograd (the true gradient), and stock transformers
training with ``attn_implementation="sdpa"`` and with an fp32 model (the parameter gradients).
"""

import math

import pytest
import torch

from roundalign import apply_alignment

from roundalign.bridge import vllm_cpu_attention
from roundalign.models.tiny import random_qwen

torch.set_num_threads(1)


def _qkv(seed, b=3, h=4, h_kv=2, t=37, d=32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, t, d, generator=g).to(torch.bfloat16).requires_grad_() for n in (h, h_kv, h_kv)]


def _left_padded_mask(lengths, t):
    """A boolean (B, 1, T, T) causal mask of left-padded sequences, as transformers' sdpa_mask builds it: query i
    attends key j when j <= i and j is a token (a padded query row attends nothing)."""
    am = torch.zeros(len(lengths), t, dtype=torch.bool)
    for i, n in enumerate(lengths):
        am[i, t - n:] = True
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    return (causal & am[:, None, :] & am[:, :, None])[:, None], am


def _attention_f64(q, k, v, scale):
    """Causal softmax attention in float64 from the formula: (H, n, D) queries, (H_kv, n, D) keys/values."""
    rep = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    s = (q @ k.transpose(1, 2)) * scale
    n = q.shape[1]
    s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), -math.inf)
    return torch.softmax(s, -1) @ v


def test_forward_is_the_engines_ops_and_backward_is_sdpas_gradient_per_request():
    lengths, t = (37, 20, 5), 37
    q, k, v = _qkv(0, t=t)
    mask, _ = _left_padded_mask(lengths, t)
    scale = 32 ** -0.5
    out, _ = vllm_cpu_attention.vllm_cpu_attention(None, q, k, v, mask, scaling=scale)
    assert out.grad_fn is not None and type(out.grad_fn).__name__ == "VllmCpuAttentionFunctionBackward"
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    for b, n in enumerate(lengths):
        sl = slice(t - n, t)
        qb, kb, vb = (x.detach()[b, :, sl].clone() for x in (q, k, v))
        # forward: vLLM's ops on the request alone, padding removed (no grad: the plain forward path)
        with torch.no_grad():
            ref = vllm_cpu_attention.attend_one(qb.transpose(0, 1), kb.transpose(0, 1), vb.transpose(0, 1), scale)
        assert torch.equal(out[b, sl].detach(), ref)
        assert torch.equal(out[b, :t - n].detach(), torch.zeros_like(out[b, :t - n]))  # padded query rows
        # backward: torch SDPA's gradient at the same q/k/v, bitwise
        qs, ks, vs = (x.clone().requires_grad_() for x in (qb, kb, vb))
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        gq, gk, gv = torch.autograd.grad(o, (qs, ks, vs), dout[b, sl].transpose(0, 1))
        assert torch.equal(dq[b, :, sl], gq) and torch.equal(dk[b, :, sl], gk) and torch.equal(dv[b, :, sl], gv)
        for g in (dq, dk, dv):  # nothing flows into padding
            assert torch.count_nonzero(g[b, :, :t - n]) == 0
        # and that gradient is the true one to bf16 resolution: float64 formula, autograd
        q64, k64, v64 = (x.double().requires_grad_() for x in (qb, kb, vb))
        o64 = _attention_f64(q64, k64, v64, scale)
        t64 = torch.autograd.grad(o64, (q64, k64, v64), dout[b, sl].transpose(0, 1).double())
        for got, want in zip((dq[b, :, sl], dk[b, :, sl], dv[b, :, sl]), t64):
            rel = float((got.double() - want).norm() / want.norm())
            assert rel < 1e-2, rel  # bf16 has 8 significant bits: 2^-8 = 3.9e-3 per element
        # the engine's forward is SDPA's to bf16 resolution too (what makes SDPA's gradient the right one)
        rel = float((ref.double().transpose(0, 1) - o64.detach()).norm() / o64.detach().norm())
        assert rel < 1e-2, rel


@pytest.mark.parametrize("shape", [(32, 4, 2, 40, 32), (5, 8, 2, 300, 64), (3, 4, 4, 130, 128)])
def test_one_call_for_the_whole_batch_is_each_requests_own_call(shape):
    """The bridge runs a batch as one call of vLLM's ops with every sequence its own request (attend_requests), as
    the engine batches prefills; each request's output equals vLLM's ops called for that request alone, with
    left padding of varying length, requests spanning several 128-token KV blocks, and decode-shaped (tail) queries."""
    b, h, h_kv, t, d = shape
    g = torch.Generator().manual_seed(sum(shape))
    q, k, v = (torch.randn(b, n, t, d, generator=g).to(torch.bfloat16) for n in (h, h_kv, h_kv))
    starts = torch.randint(0, t // 2, (b,), generator=g).tolist()
    for tq in (t, t // 4):
        qs = q[:, :, t - tq:]
        spans = [(i, max(lo - (t - tq), 0), tq, lo, t) for i, lo in enumerate(starts)]
        got = vllm_cpu_attention.attend_requests(qs, k, v, spans, d ** -0.5)
        ref = torch.zeros_like(got)
        for i, q0, q1, lo, hi in spans:
            ref[i, q0:q1] = vllm_cpu_attention.attend_one(qs[i, :, q0:q1].transpose(0, 1), k[i, :, lo:hi].transpose(0, 1),
                                                v[i, :, lo:hi].transpose(0, 1), d ** -0.5)
        assert torch.equal(got, ref), (shape, tq)


def test_decode_shaped_queries_take_the_bottom_right_causal_gradient():
    # 5 new queries against 12 cached positions (what a chunked prefill would train on): query i sees 0 .. 7 + i
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 5, 32, generator=g).to(torch.bfloat16).requires_grad_()
    k, v = (torch.randn(1, 2, 12, 32, generator=g).to(torch.bfloat16).requires_grad_() for _ in range(2))
    out, _ = vllm_cpu_attention.vllm_cpu_attention(None, q, k, v, None, scaling=0.2)
    dout = torch.randn(out.shape, generator=g).to(torch.bfloat16)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (x.detach()[0].double().requires_grad_() for x in (q, k, v))
    kk, vv = k64.repeat_interleave(2, 0), v64.repeat_interleave(2, 0)
    s = (q64 @ kk.transpose(1, 2)) * 0.2
    s = s.masked_fill(~torch.ones(5, 12, dtype=torch.bool).tril(diagonal=7), -math.inf)
    o64 = torch.softmax(s, -1) @ vv
    want = torch.autograd.grad(o64, (q64, k64, v64), dout[0].transpose(0, 1).double())
    for got, w in zip((dq[0], dk[0], dv[0]), want):
        assert float((got.double() - w).norm() / w.norm()) < 1e-2
    assert float((out[0].detach().double().transpose(0, 1) - o64.detach()).norm() / o64.detach().norm()) < 1e-2


def test_training_refuses_what_sdpas_gradient_does_not_have():
    q, k, v = _qkv(3, b=1, t=8)
    with pytest.raises(NotImplementedError, match="sliding window and softcap"):
        vllm_cpu_attention.vllm_cpu_attention(None, q, k, v, None, sliding_window=4)
    with torch.no_grad():  # scoring with a window is the engine's forward, no gradient needed
        vllm_cpu_attention.vllm_cpu_attention(None, q, k, v, None, sliding_window=4)


LENGTHS = (29, 17, 8, 23)  # a left-padded batch, as TRL scores it


def _batch(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = max(LENGTHS)
    ids = torch.zeros(len(LENGTHS), t, dtype=torch.long)
    am = torch.zeros_like(ids)
    for i, n in enumerate(LENGTHS):
        ids[i, t - n:] = torch.randint(1, vocab, (n,), generator=g)
        am[i, t - n:] = 1
    return ids, am


def _grads(model, ids, am, attn):
    """Parameter gradients of a GRPO-like loss: mean next-token logprob over the non-padded positions."""
    model.set_attn_implementation(attn)
    model.zero_grad(set_to_none=True)
    pos = (am.cumsum(-1) - 1).clamp(min=0)  # position ids that start at 0 at each sequence's first token
    logits = model(input_ids=ids, attention_mask=am, position_ids=pos).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    m = (am[:, :-1] * am[:, 1:]).float()
    loss = -(lp * m).sum() / m.sum()
    loss.backward()
    return {n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a, b, names):
    num = sum(float((a[n] - b[n]).pow(2).sum()) for n in names)
    den = sum(float(b[n].pow(2).sum()) for n in names)
    return math.sqrt(num / den)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_parameter_gradients_equal_sdpa_trainings_to_bf16_noise(arch):
    """The bound: the bridge's parameter gradients are no farther from the fp32 model's than stock SDPA's are,
    up to a factor 1.5, and no farther from SDPA's than SDPA's own are from stock eager attention's, up to 2x
    (two stock bf16 kernels of the same formula: the bf16 noise level of this model and batch)."""
    vllm_cpu_attention.register()
    model = random_qwen(arch, tie=False, layers=2, hidden=128, heads=4, kv_heads=2, vocab=256, seed=5)
    ids, am = _batch(256)
    model.train()
    bridge = _grads(model, ids, am, "vllm_cpu")
    sdpa = _grads(model, ids, am, "sdpa")
    eager = _grads(model, ids, am, "eager")
    ref = _grads(model.float(), ids, am, "eager")  # the fp32 model: what bf16 approximates
    names = sorted(ref)
    assert set(bridge) == set(sdpa) == set(ref) and len(names) > 10
    noise = _rel(eager, sdpa, names)
    assert 1e-4 < noise < 5e-2, noise  # a real bf16-level difference, not zero, not broken
    assert _rel(bridge, sdpa, names) < 2 * noise, (_rel(bridge, sdpa, names), noise)
    assert _rel(bridge, ref, names) < 1.5 * _rel(sdpa, ref, names), (_rel(bridge, ref, names), _rel(sdpa, ref, names))
    for n in names:  # and parameter by parameter, with room for the smallest tensors' noise
        assert _rel(bridge, ref, [n]) < 2 * _rel(sdpa, ref, [n]) + 1e-3, n


@pytest.mark.parametrize("variant,kernels", [("full", "compiled"), ("full", "eager"), ("rope", "eager"),
                                             ("baseline", "eager")])
def test_trains_aligned_and_gradient_checkpointing_recomputes_the_same_gradient(variant, kernels):
    vllm_cpu_attention.register()
    model = random_qwen("qwen3", tie=True, layers=2, hidden=128, heads=4, kv_heads=2, vocab=256, seed=6)
    apply_alignment(model, variant, "vllm-cpu-compiled", kernels=kernels)
    ids, am = _batch(256, seed=1)
    model.train()
    plain = _grads(model, ids, am, "vllm_cpu")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ckpt = _grads(model, ids, am, "vllm_cpu")
    assert all(torch.isfinite(g).all() for g in plain.values())
    assert plain.keys() == ckpt.keys() and all(torch.equal(plain[n], ckpt[n]) for n in plain)
