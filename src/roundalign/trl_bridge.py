"""Everything that touches TRL's private surface, in one place (trl==1.16.0, pinned).

1. ``bridge_emulated_engine``: TRL's train/inference importance-sampling code and its sampling-logprob
   metrics run only when ``trainer.use_vllm and vllm_importance_sampling_correction``. To run the
   emulated CPU engine through that same gated path we set, after construction, ``trainer.use_vllm =
   True``, give the trainer an object with ``sync_weights()`` as ``trainer.vllm_generation`` (TRL calls
   it whenever ``global_step`` moved, i.e. after every optimizer step) and ``trainer._last_loaded_step =
   -1``. Generation itself goes through the public ``rollout_func`` hook.
2. ``RoundalignGRPOTrainer._generate_and_score_completions``: after TRL has scored a generation batch,
   we recompute the trainer's logprobs of the same tokens at the same (pre-update) weights through
   TRL's own ``_get_per_token_logps_and_entropies`` and log the full mismatch set of
   ``roundalign.metrics`` into TRL's ``_metrics`` (so it reaches ``report_to`` too).
3. ``vllm_llm_overrides``: TRL's colocated ``vllm.LLM(...)`` call has no ``enforce_eager`` or ``dtype``
   argument; for ``--engine vllm-eager`` and the fp16 variant we wrap the ``LLM`` name TRL's module uses.

``tests/test_trl_bridge.py`` fails loudly when any of these internals changes.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
from trl import GRPOTrainer

from . import metrics as M

# TRL metric names -> ours (metrics.jsonl); anything not listed keeps TRL's name.
TRL_RENAMES = {
    "reward": "reward/mean",
    "reward_std": "reward/std",
    "frac_reward_zero_std": "reward/frac_zero_std",
    "kl": "policy/kl",
    "entropy": "policy/entropy",
    "loss": "optim/loss",
    "grad_norm": "optim/grad_norm",
    "learning_rate": "optim/lr",
    "completions/mean_length": "completion/length_mean",
    "completions/max_length": "completion/length_max",
    "completions/min_length": "completion/length_min",
    "completions/clipped_ratio": "completion/truncated_frac",
    "sampling/sampling_logp_difference/mean": "is/trl_logp_diff_mean",
    "sampling/sampling_logp_difference/max": "is/trl_logp_diff_max",
    "sampling/importance_sampling_ratio/min": "is/ratio_min",
    "sampling/importance_sampling_ratio/mean": "is/ratio_mean",
    "sampling/importance_sampling_ratio/max": "is/ratio_max",
    "num_tokens": "tokens/total",
}


class EngineSync:
    """Stands in for TRL's ``VLLMGeneration``: TRL calls ``sync_weights()`` after each optimizer step."""

    def __init__(self, engine, model):
        self.engine, self.model = engine, model
        self.num_syncs = 0

    def sync_weights(self) -> None:
        self.engine.sync_weights(self.model)
        self.num_syncs += 1


def bridge_emulated_engine(trainer: GRPOTrainer, engine, model) -> EngineSync:
    """Route the emulated engine through TRL's vLLM-gated importance-sampling code path."""
    for attr in ("use_vllm", "vllm_importance_sampling_correction", "rollout_func"):
        if not hasattr(trainer, attr):
            raise RuntimeError(f"trl {_trl_version()}: GRPOTrainer has no attribute {attr!r}; "
                               "roundalign.trl_bridge targets trl 1.16.0")
    sync = EngineSync(engine, model)
    trainer.use_vllm = True
    trainer.vllm_generation = sync
    trainer._last_loaded_step = -1
    return sync


def _trl_version() -> str:
    import trl

    return trl.__version__


def _is_stats(delta: torch.Tensor, mask: torch.Tensor, mode: str, cap: float, clip_min: float | None) -> dict:
    """Fraction of tokens (token modes) or sequences (sequence modes) TRL's correction clips or masks."""
    seq = mode.startswith("sequence")
    d = (delta * mask).sum(-1) if seq else delta[mask]
    rho = torch.exp(d.double())
    outside = (rho > cap) | (rho < (-math.inf if clip_min is None else clip_min))  # TRL's bounds
    key = "is/clipped_frac" if mode.endswith("truncate") else "is/masked_frac"
    return {key: float(outside.double().mean())}


class RoundalignGRPOTrainer(GRPOTrainer):
    """GRPOTrainer that logs the full train-vs-engine mismatch set on every generation batch.

    ``mismatch_is`` = (mode, cap, clip_min) describes the IS correction in force (for the clipped/masked
    fraction), or None when no correction is applied."""

    log_mismatch: bool = True
    mismatch_is: tuple | None = None

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.log_mismatch and "sampling_per_token_logps" in output:
            self._log_mismatch(output)
        return output

    @torch.no_grad()
    def _log_mismatch(self, output: dict) -> None:
        from trl.models.utils import disable_gradient_checkpointing

        mode = "train" if self.model.training else "eval"
        prompt_ids, completion_ids = output["prompt_ids"], output["completion_ids"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        with disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            train_logp, entropy, _ = self._get_per_token_logps_and_entropies(
                self.model, input_ids, attention_mask, completion_ids.size(1),
                batch_size=self.args.per_device_train_batch_size, compute_entropy=True)
        mask = output["completion_mask"].bool()
        engine_logp = output["sampling_per_token_logps"]
        result = M.mismatch_metrics(train_logp.float(), engine_logp.float(), mask, entropy=entropy.float())
        for level, values in result.items():
            for name, value in values.items():
                key = f"mismatch/{'seq' if level == 'sequence' else level}/{name.removeprefix('mismatch_')}"
                self._metrics[mode][key].append(float(value))
        if self.mismatch_is is not None:
            mode_is, cap, clip_min = self.mismatch_is
            for key, value in _is_stats(train_logp.float() - engine_logp.float(), mask, mode_is, cap,
                                        clip_min).items():
                self._metrics[mode][key].append(value)


@contextlib.contextmanager
def vllm_llm_overrides(**llm_kwargs):
    """Add keyword arguments to TRL's colocated ``vllm.LLM(...)`` call while the trainer is built, e.g.
    ``enforce_eager=True`` (vLLM's CUDA custom ops) or ``dtype="float16"``; TRL exposes neither."""
    from trl.generation import vllm_generation

    original = getattr(vllm_generation, "LLM", None)
    if original is None:
        raise RuntimeError("trl.generation.vllm_generation has no LLM name: is vLLM installed? "
                           "(pip install -e '.[gpu]')")
    if not llm_kwargs:
        yield
        return
    vllm_generation.LLM = functools.partial(original, **llm_kwargs)
    try:
        yield
    finally:
        vllm_generation.LLM = original
