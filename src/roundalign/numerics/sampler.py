"""The engine's logprob of a sampled token, computed by the trainer, with a gradient.

vLLM's sampler returns, with ``logprobs_mode="processed_logprobs"`` (what TRL's colocated engine asks for), the
log-probability of each sampled token under the distribution it sampled from (vllm 0.31.0
``vllm/v1/sample/sampler.py`` ``Sampler.forward`` -> ``sample`` -> ``apply_temperature``;
``ops/topk_topp_sampler.py`` ``forward_cpu``/``forward_native``):

    logits = lm_head(hidden)                       # the model dtype's GEMM (bf16), or head_dtype's
    x = logits.to(torch.float32)
    x = x.div_(temperature[:, None])               # a true division by an fp32 tensor
    logprobs = x.log_softmax(dim=-1, dtype=torch.float32)
    logprob = logprobs.gather(-1, sampled)

TRL 1.16 scores the same tokens with its fused LM head (``trl.kernels.ChunkedLogProbFunction``): an online
log-sum-exp over 32k-column tiles that multiplies by ``1 / temperature``. Same mathematics, other roundings: with
bit-identical hidden states, only 0.2-6.7% of the tokens' logprobs came out bitwise equal to the engine's. This
module computes the engine's formula instead, over the whole vocabulary of each row as the engine does, in chunks of
rows so that the fp32 logits of a 152k vocabulary are never all held at once. Its result is the engine's where the
head GEMM gives a row the same bits whatever other rows share the call: the engine's decode batches hold a varying
number of rows. On an AVX2 CPU (torch 2.13) bf16 and fp16 ``F.linear`` do, fp32 does not (1, 2, 3 or 7 rows give
other bits than 8 or more): an fp32 head is not exact that way (tests/test_sampler.py, tests/vllm_cpu).

Exact only for what the formula covers: temperature scaling (any T > 0), top_k off (0 or -1) and top_p = 1, no
penalties, no logit bias, no min_p. Top-k/top-p change the engine's distribution (masked logits) and the GRPO loss
would have to model the truncated distribution; the runner samples with both off.

The backward is the gradient of that formula: d logp_target / dx = onehot - softmax(x), times 1/T, cast back to the
logits' dtype as the forward's upcast is, then the LM head's GEMM gradients: a row's hidden-state gradient in one
GEMM in the head's dtype (F.linear's own backward), the weight's and bias' summed over the chunks in fp32 (as TRL's
kernel sums them). The entropy (of the same distribution, for TRL's metrics and entropy masks) has its own
gradient, -p (log p + H).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

#: fp32 elements of one chunk's (rows x vocab) logits: 2^24 is 64 MiB, ~110 rows of a 152k vocabulary. A chunk holds
#: the head's output, its fp32 copy and the log-softmax (and, in the backward, the gradient) at once.
CHUNK_ELEMENTS = 1 << 24
#: head rows converted to fp32 at a time in the backward (TRL's vocabulary chunk)
VOCAB_TILE = 32768


def chunk_rows(vocab: int, elements: int = CHUNK_ELEMENTS) -> int:
    """Rows per chunk for a vocabulary of ``vocab`` so that a chunk's fp32 logits hold at most ``elements``."""
    return max(1, elements // max(vocab, 1))


def apply_temperature(logits: Tensor, temperature: float) -> Tensor:
    """fp32 logits / T as vLLM's sampler divides them (sampler.py ``apply_temperature``): a true division by an fp32
    tensor, one value per row. On CUDA a Python-float divisor becomes a multiply by 1/T, one ulp off on part of the
    logits unless T is a power of two; on the CPU both are the true division. The emulated engine samples with it."""
    x = logits.float()
    return x / torch.full((*x.shape[:-1], 1), temperature, dtype=torch.float32, device=x.device)


def _scaled_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    """vLLM's processed logits of these rows: head GEMM in the head's dtype, then ``apply_temperature``."""
    return apply_temperature(F.linear(hidden.to(weight.dtype), weight, bias), temperature)


def engine_logprobs_reference(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                              temperature: float) -> Tensor:
    """The formula in one piece (no chunks, no gradient bookkeeping): what the engine returns for ``targets``."""
    lp = _scaled_logits(hidden, weight, bias, temperature).log_softmax(dim=-1, dtype=torch.float32)
    return lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


class EngineLogprobFunction(torch.autograd.Function):
    """(logprob of each target, entropy or None) of rows ``hidden`` [N, H] under the LM head ``weight`` [V, H],
    as the engine's sampler computes them; chunks of ``rows`` rows."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float,
                rows: int, want_entropy: bool):
        ctx.set_materialize_grads(False)
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(n, dtype=torch.float32, device=hidden.device) if want_entropy else None
        for s in range(0, n, rows):
            e = min(s + rows, n)
            lp = _scaled_logits(hidden[s:e], weight, bias, temperature).log_softmax(dim=-1, dtype=torch.float32)
            logp[s:e] = lp.gather(-1, targets[s:e].unsqueeze(-1)).squeeze(-1)
            if want_entropy:
                entropy[s:e] = -(lp.exp() * lp).sum(-1)
            del lp
        ctx.save_for_backward(hidden, weight, bias, targets, entropy)
        ctx.temperature, ctx.rows = temperature, rows
        if entropy is None:
            return logp, None
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor | None, grad_entropy: Tensor | None):
        hidden, weight, bias, targets, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if grad_logp is None and grad_entropy is None:
            return None, None, None, None, None, None, None
        n, t = hidden.shape[0], ctx.temperature
        # fp32 GEMMs on the gradient rounded to the logits' dtype, the head taken in vocabulary tiles of VOCAB_TILE
        # rows (one tile's fp32 copy at a time): a CPU without native bf16 runs them far faster than bf16 GEMMs, and
        # the weight's and bias' gradients sum over the chunks in fp32, as TRL's kernel sums them
        grad_h = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        for s in range(0, n, ctx.rows):
            e = min(s + ctx.rows, n)
            lp = _scaled_logits(hidden[s:e], weight, bias, t).log_softmax(dim=-1, dtype=torch.float32)
            p = lp.exp()
            grad_x = torch.zeros_like(lp)
            if grad_logp is not None:  # d logp_target / dx_j = 1[j = target] - p_j
                g = grad_logp[s:e].float().unsqueeze(-1)
                grad_x.sub_(p * g)
                grad_x.scatter_add_(-1, targets[s:e].unsqueeze(-1), g)
            if grad_entropy is not None:  # d H / dx_j = -p_j (log p_j + H)
                grad_x.sub_(grad_entropy[s:e].float().unsqueeze(-1) * p * (lp + entropy[s:e].unsqueeze(-1)))
            del lp, p
            # through x / T, then the upcast of the head's output (its gradient is cast back to that dtype)
            grad_logits = grad_x.div_(t).to(weight.dtype)
            del grad_x
            g32 = grad_logits.float()
            del grad_logits
            if grad_h is not None:
                grad_h[s:e].zero_()
                for v in range(0, weight.shape[0], VOCAB_TILE):
                    grad_h[s:e].addmm_(g32[:, v:v + VOCAB_TILE], weight[v:v + VOCAB_TILE].to(torch.float32))
            if grad_w is not None:
                grad_w.addmm_(g32.t(), hidden[s:e].to(torch.float32))
            if grad_b is not None:
                grad_b.add_(g32.sum(0))
            del g32
        return (grad_h.to(hidden.dtype) if grad_h is not None else None,
                grad_w.to(weight.dtype) if grad_w is not None else None,
                grad_b.to(bias.dtype) if grad_b is not None else None, None, None, None, None)


def engine_logprobs(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float, *,
                    entropy: bool = False, rows: int | None = None) -> tuple[Tensor, Tensor | None]:
    """Each row's logprob of its target as the engine's sampler computes it (module docstring), with a gradient
    to ``hidden``, ``weight`` and ``bias``; and the entropy of that distribution when ``entropy``. ``hidden``:
    [N, H]; ``targets``: [N] token ids. Each chunk of ``rows`` rows is bitwise ``engine_logprobs_reference`` of
    those rows."""
    if not temperature > 0:
        raise ValueError(f"temperature={temperature!r}: the engine's processed logprobs need a temperature > 0")
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"hidden must be [N, H] and targets [N], got {tuple(hidden.shape)} and {tuple(targets.shape)}")
    rows = rows or chunk_rows(weight.shape[0])
    return EngineLogprobFunction.apply(hidden, weight, bias, targets, float(temperature), rows, entropy)


__all__ = ["CHUNK_ELEMENTS", "apply_temperature", "EngineLogprobFunction", "chunk_rows", "engine_logprobs", "engine_logprobs_reference"]
