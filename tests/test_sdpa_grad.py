"""The engine-attention bridges' backward (roundalign.bridge.sdpa_grad): on the CPU the requests of one shape run
stacked; each request's gradient must be bitwise what torch's SDPA gives that request in its own call."""

import pytest
import torch

from roundalign.bridge.sdpa_grad import sdpa_grad_per_request

torch.set_num_threads(1)


def _own_calls(query, key, value, spans, scale, grad_out):
    """Reference: one torch SDPA call per request (3-D, torch's own kernel choice), causal bottom-right."""
    dq, dk, dv = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
    for b, q0, q1, lo, hi in spans:
        q = query[b, :, q0:q1].detach().requires_grad_()
        k = key[b, :, lo:hi].detach().requires_grad_()
        v = value[b, :, lo:hi].detach().requires_grad_()
        n, m = q1 - q0, hi - lo
        mask = None if n == m else torch.ones(n, m, dtype=torch.bool).tril(m - n)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=n == m, scale=scale,
                                                             enable_gqa=q.shape[0] != k.shape[0])
        g = torch.autograd.grad(o, (q, k, v), grad_out[b, q0:q1].transpose(0, 1))
        dq[b, :, q0:q1], dk[b, :, lo:hi], dv[b, :, lo:hi] = g
    return dq, dk, dv


def _fp64(query, key, value, spans, scale, grad_out):
    """Reference: softmax attention in float64, GQA heads repeated."""
    dq, dk, dv = (torch.zeros_like(t, dtype=torch.float64) for t in (query, key, value))
    rep = query.shape[1] // key.shape[1]
    for b, q0, q1, lo, hi in spans:
        q = query[b, :, q0:q1].double().requires_grad_()
        k = key[b, :, lo:hi].double().requires_grad_()
        v = value[b, :, lo:hi].double().requires_grad_()
        n, m = q1 - q0, hi - lo
        s = (q @ k.repeat_interleave(rep, 0).transpose(1, 2)) * scale
        s = s.masked_fill(~torch.ones(n, m, dtype=torch.bool).tril(m - n), float("-inf"))
        o = s.softmax(-1) @ v.repeat_interleave(rep, 0)
        g = torch.autograd.grad(o, (q, k, v), grad_out[b, q0:q1].transpose(0, 1).double())
        dq[b, :, q0:q1], dk[b, :, lo:hi], dv[b, :, lo:hi] = g
    return dq, dk, dv


@pytest.mark.parametrize("heads,kv_heads,head_dim,decode", [(4, 2, 32, False), (8, 2, 64, False), (4, 4, 16, True)])
def test_stacked_requests_get_the_bits_of_their_own_calls(heads, kv_heads, head_dim, decode):
    g = torch.Generator().manual_seed(heads * 100 + head_dim)
    bsz, t = 12, 24
    q, go = (torch.randn(bsz, heads, t, head_dim, generator=g).bfloat16() for _ in range(2))
    go = go.transpose(1, 2).contiguous()  # (B, Tq, H, D)
    k, v = (torch.randn(bsz, kv_heads, t, head_dim, generator=g).bfloat16() for _ in range(2))
    # left padding of 0-3 tokens (several requests share a shape, some are alone); with ``decode`` the queries are
    # the last 5 positions of each request against all of its keys, as with a KV cache
    pads = torch.randint(0, 4, (bsz,), generator=g).tolist()
    spans = [(b, (t - 5) if decode else p, t, p, t) for b, p in enumerate(pads)]
    scale = head_dim ** -0.5
    got = sdpa_grad_per_request(q, k, v, spans, scale, go)
    want = _own_calls(q, k, v, spans, scale, go)
    for name, a, b in zip("qkv", got, want):
        assert torch.equal(a, b), (name, (a.float() - b.float()).abs().max().item())
    # and the gradient is the attention's: within bf16 rounding of float64 (the largest entries are ~10)
    for name, a, r in zip("qkv", got, _fp64(q, k, v, spans, scale, go)):
        assert (a.double() - r).abs().max() <= 2 ** -7 * r.abs().max(), name
    # nothing flows to padding: keys before each request's first token, queries outside its span
    for b, q0, _, lo, _ in spans:
        assert not got[0][b, :, :q0].any() and not got[1][b, :, :lo].any() and not got[2][b, :, :lo].any()
