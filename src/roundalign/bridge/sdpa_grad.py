"""The backward that both engine-attention bridges take (``roundalign.bridge.vllm_cpu_attention``: vLLM-CPU's ops forward;
``roundalign.bridge.vllm_flash``: vLLM's CUDA FlashAttention call forward): the gradient of torch SDPA, recomputed per
request at the q/k/v the engine's forward saw. SDPA because it is the gradient a stock ``attn_implementation="sdpa"``
trainer takes: the bridges change where the forward rounds, not how the update is computed."""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel


def sdpa_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """torch SDPA over one request: ``q`` (H, n, D) the last n of the m positions of ``k``/``v`` (H_kv, m, D), causal
    and bottom-right aligned as the engines' kernels are (query i sees keys ``0 .. m - n + i``), GQA heads shared as
    they share them (query head h reads KV head h // (H / H_kv)). Requests of one shape may come stacked, with a
    leading batch dimension."""
    n, m = q.shape[-2], k.shape[-2]
    mask = None if n == m else torch.ones((n, m), dtype=torch.bool, device=q.device).tril(diagonal=m - n)
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=n == m, scale=scale, enable_gqa=q.shape[-3] != k.shape[-3])


def sdpa_grad_per_request(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, spans, scale: float,
                          grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the (B, H, Tq, D) ``query`` and (B, H_kv, Tk, D) ``key``/``value`` for ``grad_out`` (B, Tq, H, D):
    ``sdpa_reference``'s, request by request (``spans``: ``(b, q0, q1, lo, hi)``, queries ``q0:q1`` of row b against
    its keys ``lo:hi``), zero on padding. Runs outside autocast, in the inputs' dtype.

    On the CPU the requests of one shape run stacked, in one call: a request's own call is 3-D, for which torch picks
    its math kernel (fp32 inside for bf16 inputs), and the stacked call runs that kernel too
    (``SDPBackend.MATH``), which gives each request the same bits as its own call (tests/test_sdpa_grad.py) at a
    fraction of the per-call overhead: a GRPO batch of 32 short sequences took 28 ms a layer call by call and 9 ms
    stacked on an AVX2 CPU. Elsewhere (the CUDA bridge) each request keeps its own call."""
    if query.device.type == "cpu":
        return _sdpa_grad_stacked(query, key, value, spans, scale, grad_out)
    dq, dk, dv = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
    with torch.enable_grad(), torch.autocast(query.device.type, enabled=False):
        for b, q0, q1, lo, hi in spans:
            q = query[b, :, q0:q1].detach().requires_grad_()
            k = key[b, :, lo:hi].detach().requires_grad_()
            v = value[b, :, lo:hi].detach().requires_grad_()
            o = sdpa_reference(q, k, v, scale)
            gq, gk, gv = torch.autograd.grad(o, (q, k, v), grad_out[b, q0:q1].transpose(0, 1).to(o.dtype))
            dq[b, :, q0:q1] += gq
            dk[b, :, lo:hi] += gk
            dv[b, :, lo:hi] += gv
    return dq, dk, dv


def _sdpa_grad_stacked(query, key, value, spans, scale, grad_out):
    """``sdpa_grad_per_request`` with the requests of one (queries, keys) shape stacked into one math-kernel call."""
    dq, dk, dv = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
    groups: dict[tuple[int, int], list] = {}
    for span in spans:
        _, q0, q1, lo, hi = span
        groups.setdefault((q1 - q0, hi - lo), []).append(span)
    # the math kernel: what a request's own 3-D CPU call runs (the CPU flash kernel takes 4-D inputs only)
    with torch.enable_grad(), torch.autocast(query.device.type, enabled=False), sdpa_kernel(SDPBackend.MATH):
        for group in groups.values():
            q = torch.stack([query[b, :, q0:q1] for b, q0, q1, _, _ in group]).requires_grad_()
            k = torch.stack([key[b, :, lo:hi] for b, _, _, lo, hi in group]).requires_grad_()
            v = torch.stack([value[b, :, lo:hi] for b, _, _, lo, hi in group]).requires_grad_()
            g = torch.stack([grad_out[b, q0:q1].transpose(0, 1) for b, q0, q1, _, _ in group])
            o = sdpa_reference(q, k, v, scale)
            gq, gk, gv = torch.autograd.grad(o, (q, k, v), g.to(o.dtype))
            for i, (b, q0, q1, lo, hi) in enumerate(group):
                dq[b, :, q0:q1] += gq[i]
                dk[b, :, lo:hi] += gk[i]
                dv[b, :, lo:hi] += gv[i]
    return dq, dk, dv
