"""A built ``vllm.LLM`` (the real engine, GPU or vLLM's CPU build) driven through vLLM's public API: one completion
per prompt with the logprob of each sampled token, and the engine's own logprobs of given tokens in one prefill.
The emulated engine's samples (``engine.generate.Sample``) have the same form, so that the probes and TRL's
colocated engine compare the two alike.

vLLM calls checked against the vllm 0.31.0 wheel: ``LLM.generate(prompts, sampling_params=[...], use_tqdm=False)``
with ``{"prompt_token_ids": ids}`` prompts (as TRL passes them); ``SamplingParams(temperature, top_p, top_k, min_p,
seed, max_tokens, logprobs, prompt_logprobs)`` (vllm/sampling_params.py; top_k=0 disables top-k);
``CompletionOutput.logprobs[i][token_id].logprob`` and ``RequestOutput.prompt_logprobs[i][token_id].logprob``
(vllm/outputs.py, vllm/logprobs.py: a list of dicts or ``FlatLogprobs``, both indexed by position, the sampled or
given token always included).
"""

from __future__ import annotations

import torch

from roundalign.bridge.vllm_internals import inprocess_model
from roundalign.engine.generate import Sample


def sample_with_logprobs(llm, prompts: list[list[int]], *, temperature: float, max_new_tokens: int, seed: int,
                         top_p: float = 1.0, top_k: int = 0) -> list[Sample]:
    """One completion per prompt from a built ``vllm.LLM``, each with the logprob vLLM reports for every sampled
    token (in the LLM's ``logprobs_mode``); prompt i samples with seed ``seed * 1_000_003 + i``."""
    import vllm  # noqa: PLC0415 -- optional: vllm (the real engine; the emulated one needs none)

    params = [vllm.SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=0.0,
                                  seed=seed * 1_000_003 + i, max_tokens=max_new_tokens, logprobs=0)
              for i in range(len(prompts))]
    outputs = llm.generate([{"prompt_token_ids": list(ids)} for ids in prompts], sampling_params=params,
                           use_tqdm=False)
    samples = []
    for ids, out in zip(prompts, outputs, strict=True):
        comp = out.outputs[0]
        tokens = list(comp.token_ids)
        if comp.logprobs is None or len(comp.logprobs) < len(tokens):
            raise RuntimeError("vLLM returned no logprob for some sampled token (SamplingParams(logprobs=0) "
                               "asks for the sampled token's); check the vLLM version (0.31.0 expected)")
        logps = torch.tensor([comp.logprobs[i][t].logprob for i, t in enumerate(tokens)], dtype=torch.float32)
        samples.append(Sample(list(ids), tokens, logps, None))
    return samples


def teacher_forced(llm, samples: list[Sample], temperature: float) -> list[Sample]:
    """The engine's own logprobs of each sample's completion tokens given everything before them, in one prefill
    of prompt+completion (``SamplingParams(prompt_logprobs=0)``: fp32 log-softmax of the prefill's logits / T),
    one request per call. Layer states come from hooks on the in-process model's decoder layers, which return
    ``(mlp_out, residual)`` as vLLM's Qwen2/Qwen3 decoders do; the stream after the layer is their fp32 sum
    rounded once (what the next norm's add stores)."""
    import vllm  # noqa: PLC0415 -- optional: vllm (the GPU environment or .venv-vllm)

    model = inprocess_model(llm)
    layers = list(getattr(getattr(model, "model", None), "layers", []) or [])
    captured: list[torch.Tensor] = []

    def hook(_m, _a, out):
        h, r = out
        captured.append((r.float() + h.float()).to(h.dtype).cpu())

    hooks = [layer.register_forward_hook(hook) for layer in layers]
    sp = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=temperature, top_p=1.0, top_k=0, min_p=0.0)
    out = []
    try:
        for s in samples:
            ids = s.prompt_ids + s.completion_ids
            captured.clear()
            res = llm.generate([{"prompt_token_ids": ids}], sampling_params=sp, use_tqdm=False)[0]
            n0 = len(s.prompt_ids)
            logps = torch.tensor([res.prompt_logprobs[i][ids[i]].logprob for i in range(n0, len(ids))],
                                 dtype=torch.float32)
            # the prefill is the first forward of the request (the one sampled token's decode step follows)
            states = [c[:len(ids) - 1] for c in captured[:len(layers)]] if len(captured) >= len(layers) > 0 else None
            out.append(Sample(list(s.prompt_ids), list(s.completion_ids), logps, states))
    finally:
        for h in hooks:
            h.remove()
    return out
