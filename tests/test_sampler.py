"""The engine's sampler formula with a gradient (roundalign.numerics.sampler), and the TRL head that uses it.

References: the formula as vLLM 0.31.0's sampler writes it (sampler.py ``apply_temperature`` + ``compute_logprobs`` /
topk_topp_sampler.py ``forward_cpu``), written out here op by op; fp64 autograd for the gradient; TRL's own fused
head (trl.trainer.utils.add_fused_lm_head) for what the trainer computed before. The real engine's own logprobs are
the reference of tests/vllm_cpu/test_grpo_real.py."""

import pytest
import torch
import torch.nn.functional as F
from trl.trainer.utils import add_fused_lm_head

from roundalign.models.tiny import random_qwen
from roundalign.numerics.sampler import chunk_rows, engine_logprobs
from roundalign.training.trl_bridge import add_engine_scored_lm_head


def _vllm_formula(hidden, weight, bias, targets, temperature):
    # vllm/v1/sample/sampler.py: logits.to(float32); logits.div_(temp.unsqueeze(dim=1)) with temp an fp32 tensor of
    # one value per request; topk_topp_sampler.py forward_cpu: logits.log_softmax(dim=-1, dtype=torch.float32)
    logits = F.linear(hidden, weight, bias).to(torch.float32)
    temp = torch.full((logits.shape[0],), temperature, dtype=torch.float32)
    lp = logits.div_(temp.unsqueeze(dim=1)).log_softmax(dim=-1, dtype=torch.float32)
    return lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _data(n=29, h=48, v=700, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) * 0.3).to(dtype)
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, targets


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_bitwise_the_engines_formula_chunk_by_chunk(temperature, dtype):
    # each chunk is bitwise the formula on those rows. Whether it is also the formula on any other set of rows is the
    # head GEMM's property, not this module's: on an AVX2 CPU fp32 F.linear gives a row other bits when 1, 2, 3 or 7
    # rows share the call (bf16 and fp16: none); the real engine's decode batches are the reference for that
    # (tests/vllm_cpu/test_grpo_real.py)
    hidden, weight, targets = _data(dtype=dtype)
    for rows in (1, 4, 29, 64, None):
        lp, ent = engine_logprobs(hidden, weight, None, targets, temperature, entropy=True, rows=rows)
        step = rows or chunk_rows(weight.shape[0])
        ref = torch.cat([_vllm_formula(hidden[s:s + step], weight, None, targets[s:s + step], temperature)
                         for s in range(0, len(targets), step)])
        assert torch.equal(lp, ref), (rows, (lp - ref).abs().max())
        full = F.linear(hidden, weight).float().div(temperature).log_softmax(-1)
        torch.testing.assert_close(ent, -(full.exp() * full).sum(-1), rtol=1e-5, atol=1e-6)


def test_chunk_rows_bounds_a_chunks_logits():
    assert chunk_rows(151_936) == (1 << 24) // 151_936 == 110  # a Qwen vocabulary: 110 rows, 64 MiB of fp32
    assert chunk_rows(10) == (1 << 24) // 10 and chunk_rows(1 << 30) == 1


def test_gradient_is_the_formulas_fp64_gradient():
    hidden, weight, targets = _data(dtype=torch.float32, seed=1)
    bias = torch.randn(weight.shape[0], generator=torch.Generator().manual_seed(2))
    g = torch.Generator().manual_seed(4)
    g_lp, g_ent = torch.randn(len(targets), generator=g), torch.randn(len(targets), generator=g)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    lp, ent = engine_logprobs(*leaves, targets, 0.7, entropy=True, rows=5)
    (lp * g_lp + ent * g_ent).sum().backward()
    ref_leaves = [t.double().requires_grad_() for t in (hidden, weight, bias)]
    x = F.linear(*ref_leaves).div(0.7).log_softmax(-1)
    ref_lp, ref_ent = x.gather(-1, targets[:, None]).squeeze(-1), -(x.exp() * x).sum(-1)
    (ref_lp * g_lp.double() + ref_ent * g_ent.double()).sum().backward()
    for ours, ref in zip(leaves, ref_leaves):
        # fp32 against fp64: the entropy's gradient, p (log p + H), cancels, so the error is relative to the
        # gradient's scale (measured up to ~2e-6 of its largest entry over 30 draws), not to each entry
        torch.testing.assert_close(ours.grad.double(), ref.grad, rtol=1e-4, atol=1e-5 * float(ref.grad.abs().max()))


def test_bf16_gradients_accumulate_in_fp32_over_chunks():
    # one chunk or many: the same gradient up to the fp32 sums' order (bf16 sums of chunks would differ by ~1e-2)
    hidden, weight, targets = _data(n=64, v=300, seed=3)
    grads = []
    for rows in (64, 3):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lp, _ = engine_logprobs(h, w, None, targets, 1.0, rows=rows)
        lp.sum().backward()
        assert h.grad.dtype == w.grad.dtype == torch.bfloat16
        grads.append((h.grad.float(), w.grad.float()))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-3)


def test_bad_input_is_named():
    hidden, weight, targets = _data()
    with pytest.raises(ValueError, match="temperature"):
        engine_logprobs(hidden, weight, None, targets, 0.0)
    with pytest.raises(ValueError, match=r"targets \[N\]"):
        engine_logprobs(hidden, weight, None, targets[:-1], 1.0)


# ---------------------------------------------------------------------------------------------- TRL's head


def _tiny_with_trl_head(temperature):
    model = random_qwen("qwen2", layers=2, dtype=torch.bfloat16)
    add_fused_lm_head(model, temperature=temperature, outputs=("log_probs", "entropy"))
    return model


def _batch(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-5] = -100  # the last 5 tokens are the completion
    return dict(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)


def test_engine_scored_head_is_the_formula_on_the_models_hidden_states():
    model = _tiny_with_trl_head(0.9)
    batch = _batch(model)
    trl_out = model(**batch)
    add_engine_scored_lm_head(model, 0.9)
    out = model(**batch)
    with torch.no_grad():
        hidden = model.base_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
                                  ).last_hidden_state[:, :-1]
    labels = batch["labels"][:, 1:]
    mask = labels != -100
    ref = _vllm_formula(hidden[mask], model.lm_head.weight, None, labels[mask], 0.9)
    assert torch.equal(out.label_mask, mask) and torch.equal(out.log_probs[mask], ref)
    assert (out.log_probs[~mask] == 0).all() and out.entropy is not None
    # TRL's online log-sum-exp: the same values to fp32 rounding, not the same bits everywhere
    torch.testing.assert_close(out.log_probs, trl_out.log_probs, rtol=0, atol=1e-4)
    torch.testing.assert_close(out.entropy, trl_out.entropy, rtol=0, atol=1e-4)
    # the gradient reaches the weights, close to TRL's own
    out.loss.backward()
    ours = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    assert "lm_head.weight" in ours and len(ours) == sum(1 for _ in model.parameters())
    # generation (no fused_lm_head) still goes through the model's own forward
    plain = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    assert plain.logits.shape == (3, 12, model.config.vocab_size)


def test_engine_scored_head_needs_trls_head():
    with pytest.raises(RuntimeError, match="add_fused_lm_head"):
        add_engine_scored_lm_head(random_qwen("qwen2", layers=1), 1.0)
