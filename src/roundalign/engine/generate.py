"""Sampling with the emulated engine: KV-cache decoding and vLLM's fp32 sampler.

``Engine.generate`` takes token-id prompts and returns, per prompt, the completion ids and the
sampling logprob of each sampled token, computed the way vLLM reports "processed" logprobs with
temperature T, top_k=0 (off) and top_p=1 (off): ``log_softmax(logits.float() / T)`` in fp32.

Decoding is prefill-then-one-token-at-a-time, like vLLM. Prompts of equal length are decoded
together as one batch (no padding: vLLM never pads), which is what GRPO's repeated prompts give.
Each sample draws from its own ``torch.Generator`` seeded from ``(seed, sample_index)``, so a
sample's tokens do not depend on how prompts were batched. The engine knows token ids and dtypes,
not datasets or tokenizers.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from roundalign.engine.model import EngineModel
from roundalign.numerics.sampler import apply_temperature as _apply_temperature
from roundalign.numerics.engines import DEFAULT_ENGINE


@dataclass
class Sample:
    """One generated completion.

    Attributes:
        prompt_ids: the prompt's token ids.
        completion_ids: sampled token ids, EOS included when it was sampled.
        logprobs: (len(completion_ids),) fp32 sampling logprob of each sampled token, in nats.
        layer_states: if recorded, per decoder layer a (len(prompt)+len(completion)-1, hidden)
            tensor of the engine's residual stream for every position whose output was computed.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: Tensor
    layer_states: list[Tensor] | None = field(default=None, repr=False)


class NonFiniteLogitsError(RuntimeError):
    """The engine's logits contain NaN or inf: the policy has diverged (a collapsed run)."""


def _sample_seed(seed: int, index: int) -> int:
    return (seed * 1_000_003 + index) % (2**63 - 1)


class Engine:
    """Emulated inference engine: ``EngineModel`` + KV-cache decoding + fp32 sampler.

    Args mirror ``EngineModel``; ``model`` is copied (weights only), so later changes to ``model``
    reach the engine only through ``sync_weights``.
    """

    def __init__(self, model: nn.Module, engine: str = DEFAULT_ENGINE, attn: str = "eager", gemm: str = "same",
                 splitk_chunk: int = 64, norm_reduction: str = "opaque", attn_decode: str | None = None,
                 lm_head_fp32: bool = False, kv_cache_dtype: str = "auto", dose_bits: int = 7):
        self.model = EngineModel(model, engine=engine, attn=attn, gemm=gemm, splitk_chunk=splitk_chunk,
                                 norm_reduction=norm_reduction, attn_decode=attn_decode, lm_head_fp32=lm_head_fp32,
                                 kv_cache_dtype=kv_cache_dtype, dose_bits=dose_bits)

    def sync_weights(self, model: nn.Module) -> None:
        self.model.sync_weights(model)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 1.0, seed: int = 0,
                 eos_token_id: int | None = None, record_layer_states: bool = False,
                 sample_indices: list[int] | None = None) -> list[Sample]:
        """Sample one completion per prompt.

        Args:
            prompts: token-id lists (repeat a prompt to get several samples of it).
            max_new_tokens: cap on completion length, in tokens.
            temperature: softmax temperature; 0 means greedy (logprobs then use T=1).
            seed: base seed; sample i draws from a generator seeded by (seed, sample_indices[i]).
            eos_token_id: stop a sample after it emits this token (the token is kept).
            record_layer_states: keep per-layer hidden states for attribution (memory heavy).
            sample_indices: global index of each prompt for seeding; defaults to 0..len(prompts)-1.
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        indices = list(range(len(prompts))) if sample_indices is None else list(sample_indices)
        groups: dict[int, list[int]] = defaultdict(list)
        for i, p in enumerate(prompts):
            groups[len(p)].append(i)
        out: list[Sample | None] = [None] * len(prompts)
        for _, members in sorted(groups.items()):
            for i, s in zip(members, self._generate_group([prompts[i] for i in members], [indices[i] for i in members],
                                                           max_new_tokens, temperature, seed, eos_token_id,
                                                           record_layer_states)):
                out[i] = s
        return out  # type: ignore[return-value]

    @torch.no_grad()
    def score(self, prompts: list[list[int]], completions: list[list[int]], *, temperature: float = 1.0,
              decode: bool = True) -> list[Tensor]:
        """The engine's fp32 logprob of each given completion token (nats).

        ``decode=True``: the tokens replayed through KV-cache decoding exactly as ``generate`` would have sampled
        them (the same prompt-length groups, decoded in lockstep), so the engine's own samples get back their
        sampling logprobs bit for bit. ``decode=False``: each prompt + completion in one prefill."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        if decode:
            groups: dict[int, list[int]] = defaultdict(list)
            for i, p in enumerate(prompts):
                groups[len(p)].append(i)
            out: list[Tensor | None] = [None] * len(prompts)
            for _, members in sorted(groups.items()):
                forced = [completions[i] for i in members]
                with torch.device(self.model.embed.device):
                    samples = self._generate_group_on_device([prompts[i] for i in members], members,
                                                             max(map(len, forced)), temperature, 0, None, False,
                                                             forced=forced)
                for i, s in zip(members, samples):
                    out[i] = s.logprobs
            return out  # type: ignore[return-value]
        res = []
        with torch.device(self.model.embed.device):
            for p, c in zip(prompts, completions):
                logits = self.model.forward(torch.tensor([p + c[:-1]]), self.model.new_cache())[0, len(p) - 1:]
                logp = torch.log_softmax(_apply_temperature(logits, temperature), dim=-1)
                res.append(logp.gather(-1, torch.tensor(c).unsqueeze(-1)).squeeze(-1).cpu())
        return res

    def _generate_group(self, prompts, indices, max_new_tokens, temperature, seed, eos_token_id, record):
        # The engine runs on the device of its weights (a GPU for paper-scale probes): engine/model.py creates
        # masks and positions without a device, so its forwards run under that default device. Sampling stays on
        # the CPU generators, so a sample depends on (seed, index) and the probabilities only, not the device.
        with torch.device(self.model.embed.device):
            return self._generate_group_on_device(prompts, indices, max_new_tokens, temperature, seed, eos_token_id,
                                                  record)

    def _generate_group_on_device(self, prompts, indices, max_new_tokens, temperature, seed, eos_token_id, record,
                                  forced: list[list[int]] | None = None):
        bsz = len(prompts)
        gens = [torch.Generator(device="cpu").manual_seed(_sample_seed(seed, i)) for i in indices]
        cache = self.model.new_cache()
        states: list[list[Tensor]] = []  # per forward call: list over layers of (B, T, hidden)
        step_states = [] if record else None
        logits = self.model.forward(torch.tensor(prompts), cache, step_states)[:, -1]
        if record:
            states.append(step_states)
        tokens: list[list[int]] = [[] for _ in range(bsz)]
        logps: list[list[Tensor]] = [[] for _ in range(bsz)]
        done = [False] * bsz
        for step in range(max_new_tokens):
            scaled = _apply_temperature(logits, temperature if temperature > 0 else 1.0)
            logp = torch.log_softmax(scaled, dim=-1)  # fp32, as vLLM's sampler
            if not torch.isfinite(logits).all():
                raise NonFiniteLogitsError(f"engine logits contain NaN/inf at completion position {step}")
            nxt = []
            for b in range(bsz):
                if forced is not None:  # score(): the given token; a finished row keeps decoding its last one
                    t = forced[b][min(step, len(forced[b]) - 1)]
                elif temperature == 0:
                    t = int(torch.argmax(logp[b]))
                else:
                    t = int(torch.multinomial(logp[b].exp().cpu(), 1, generator=gens[b]))
                nxt.append(t)
                if not done[b]:
                    tokens[b].append(t)
                    logps[b].append(logp[b, t])
                    done[b] = (eos_token_id is not None and t == eos_token_id) or (
                        forced is not None and len(tokens[b]) == len(forced[b]))
            if all(done) or step == max_new_tokens - 1:
                break
            step_states = [] if record else None
            logits = self.model.forward(torch.tensor(nxt).unsqueeze(1), cache, step_states)[:, -1]
            if record:
                states.append(step_states)
        samples = []
        for b in range(bsz):
            layer_states = None
            if record:
                n_pos = len(prompts[b]) + len(tokens[b]) - 1  # positions whose output produced a sampled token
                layer_states = [torch.cat([st[layer][b] for st in states], dim=0)[:n_pos].cpu()
                                for layer in range(len(self.model.layers))]
            samples.append(Sample(prompts[b], tokens[b], torch.stack(logps[b]).cpu(), layer_states))
        return samples
