"""PEFT (LoRA) on aligned models, peft pinned in pyproject.toml.

The alignment swaps the classes of the decoder layer, attention, MLP and norm modules (roundalign.numerics.patch)
and leaves every nn.Linear alone, so PEFT's LoRA wrappers go around the projections the aligned forwards call,
and ``merge_and_unload()`` (which replaces the wrappers by plain Linears with merged weights) keeps the swapped
classes. What is checked here, against stock transformers + stock PEFT as the reference:
- the LoRA delta reaches the aligned forward: in fp32, where ``full`` is a no-op by construction, an aligned LoRA
  model gives the stock LoRA model's logits bitwise (an aligned forward that read ``q_proj.weight`` instead of
  calling ``q_proj`` would drop the delta and fail);
- the gradients of the LoRA parameters are the stock ones (fp32) and an aligned LoRA model trains (bf16);
- a merged model is still aligned: ``alignment_of`` says so, and its bf16 logits equal, bitwise, the merged
  weights loaded into a fresh model and aligned afresh, and differ from stock numerics on the same weights.
"""

import copy

import pytest
import torch
from conftest import random_qwen
from peft import LoraConfig, get_peft_model

from roundalign import alignment_of, apply_alignment

torch.set_num_threads(1)
IDS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ENGINES = ["vllm-compiled", "vllm-cpu-eager"]


def _lora(model, seed=0):
    # init_lora_weights=False: B is random too, so the adapter changes the output from the start
    torch.manual_seed(seed)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False))


def _logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


@pytest.mark.parametrize("engine", ENGINES)
def test_lora_delta_reaches_the_aligned_forward_and_its_gradients_are_stock(arch, engine):
    base = random_qwen(arch, dtype=torch.float32)
    stock = _lora(copy.deepcopy(base))
    aligned = _lora(apply_alignment(copy.deepcopy(base), "full", engine))
    assert alignment_of(aligned.base_model.model)[0] == "full"
    assert not torch.equal(_logits(stock), _logits(base))  # the adapter acts
    assert torch.equal(_logits(aligned), _logits(stock))
    grads = []
    for model in (stock, aligned):
        model.zero_grad()
        out = model(input_ids=IDS, labels=IDS)
        out.loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 2 * len(TARGETS) * base.config.num_hidden_layers
    for name, g in grads[0].items():
        assert g.abs().sum() > 0, name
        torch.testing.assert_close(grads[1][name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_an_aligned_lora_model_trains_in_bf16(arch):
    model = _lora(apply_alignment(random_qwen(arch), "full", "vllm-compiled"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = model(input_ids=IDS, labels=IDS).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses
    assert alignment_of(model.base_model.model)[0] == "full"


@pytest.mark.parametrize("engine", ENGINES)
def test_merge_and_unload_keeps_the_alignment_bitwise(arch, engine):
    base = random_qwen(arch)  # bf16, where full is not a no-op
    merged = _lora(apply_alignment(copy.deepcopy(base), "full", engine)).merge_and_unload()
    assert alignment_of(merged) == ("full", engine, "eager")
    assert merged.config.roundalign["variant"] == "full"
    weights = merged.state_dict()
    # merging is weight arithmetic, the same with or without the alignment
    stock_merged = _lora(copy.deepcopy(base)).merge_and_unload().state_dict()
    assert weights.keys() == stock_merged.keys()
    assert all(torch.equal(weights[k], stock_merged[k]) for k in weights)
    fresh = copy.deepcopy(base)
    fresh.load_state_dict(weights)
    stock_logits = _logits(fresh)
    apply_alignment(fresh, "full", engine)
    assert torch.equal(_logits(merged), _logits(fresh))
    assert not torch.equal(_logits(merged), stock_logits)  # still aligned numerics, not silently stock
