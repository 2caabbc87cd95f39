"""Weights updated in place reach the real CPU engine: after each of several optimizer steps, the engine updated
by ``load_weights`` (the call TRL's colocated sync makes) gives logprobs bitwise equal to a freshly built engine
loaded from the same weights, and an engine left unsynced does not."""

import copy
import gc

import pytest
import torch

from roundalign.bridge import vllm_cpu
from roundalign.bridge.vllm_internals import inprocess_model
from roundalign.models.tiny import random_qwen

pytestmark = pytest.mark.vllm032  # also run in .venv-vllm032 (vLLM 0.32.0)

VOCAB = 256


def _save_bf16(policy, path):
    """The fp32 masters rounded to bf16, saved (the policy itself keeps its fp32 masters)."""
    copy.deepcopy(policy).to(torch.bfloat16).save_pretrained(path)


def _engine(path, mode):
    from vllm import LLM  # noqa: PLC0415 -- optional: vllm

    return LLM(model=str(path), skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=mode == "eager", seed=0,
               max_model_len=256, max_num_seqs=4)


def _logps(llm, seqs):
    from vllm import SamplingParams  # noqa: PLC0415 -- optional: vllm

    out = []
    for s in seqs:
        r = llm.generate([{"prompt_token_ids": s}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
        out.append(torch.tensor([r.prompt_logprobs[i][s[i]].logprob for i in range(1, len(s))]))
    return torch.cat(out)


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_in_place_sync_equals_a_fresh_engine_after_every_step(tmp_path, mode):
    vllm_cpu.install_live_gemm_dispatch()
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (9, 31, 64)]
    policy = random_qwen("qwen2", hidden=128, layers=2, heads=4, kv_heads=2, vocab=VOCAB, dtype=torch.float32, seed=7)
    opt = torch.optim.SGD(policy.parameters(), lr=0.05)  # large enough to move every bf16 weight
    _save_bf16(policy, tmp_path / "step0")
    live = _engine(tmp_path / "step0", mode)
    kernels = vllm_cpu.engine_kernels(live)
    assert set(kernels["gemm"]) == {vllm_cpu.LIVE_GEMM}, kernels["gemm"]
    vmodel = inprocess_model(live)
    before = _logps(live, seqs)
    synced = []
    for step in (1, 2, 3):
        ids = torch.randint(0, VOCAB, (4, 32), generator=g)
        opt.zero_grad()
        policy(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        bf16 = [(n, p.detach().to(torch.bfloat16)) for n, p in policy.named_parameters()]
        vmodel.load_weights(bf16)  # what TRL's colocated sync calls, model.load_weights([(name, param)])
        synced.append(_logps(live, seqs))
        _save_bf16(policy, tmp_path / f"step{step}")
    del live, vmodel
    gc.collect()
    # vLLM's process-wide parallel groups allow one engine at a time: the fresh engines are built afterwards
    for step, got in enumerate(synced, 1):
        fresh_llm = _engine(tmp_path / f"step{step}", mode)
        fresh = _logps(fresh_llm, seqs)
        del fresh_llm
        gc.collect()
        assert torch.equal(got, fresh), (step, int((got != fresh).sum()))
        assert not torch.equal(got, before), step  # the weights moved: a stale engine would be caught
        before = got
