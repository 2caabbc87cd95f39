"""Run configuration for ``roundalign train``: one frozen dataclass, loaded from YAML and ``--set`` overrides.

Unknown keys, wrong types and inconsistent values raise ``ConfigError`` naming the key and the valid
choices, before any model or dataset is loaded. The help text of every key lives in the docstring of
``TrainConfig`` (and is mirrored, with units, by ``workflow/schemas/`` for the sweep).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from pathlib import Path

import yaml

from roundalign.engine.choices import ATTN_IMPLS, ENGINE_ATTN_IMPLS, ENGINE_GEMMS, KV_CACHE_DTYPES, NORM_REDUCTIONS
from roundalign.numerics.plan import ENGINES, KERNEL_MODES, VARIANTS

BACKENDS = ("emulated", "vllm")
TASKS = ("arith", "math", "digits")
DIGITS_OPS = ("copy", "reverse", "sort")
# fp32-head: LM head and logits in fp32 on both sides (TRL's cast_lm_head_to_fp32; MiniMax-M1's fp32 head), with
# baseline numerics elsewhere; full+fp32-head adds it to full; fp32: everything in fp32 on both sides, the floor
# of the share-of-gap metric.
TRAIN_VARIANTS = ("baseline", "rope", "swiglu", "norm", "full", "tis", "mis", "fp16", "fp32-head", "full+fp32-head",
                  "fp32")
VLLM_MODES = ("colocate", "server")
LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo")
PROMPT_STYLES = ("fixed", "variable")


class ConfigError(ValueError):
    """A configuration value is unknown, mistyped or inconsistent."""


@dataclass(frozen=True)
class TrainConfig:
    """Settings of one GRPO run.

    Attributes:
        model: Local model directory or a hub id (hub ids need the hub or a pre-filled HF cache).
        variant: Alignment variant (baseline, rope, swiglu, norm, full) or a remedy of other work:
            tis (token-level truncated importance sampling), mis (sequence-level masked IS),
            fp16 (policy and engine both in FP16), fp32-head (LM head and logits in FP32 on both sides),
            full+fp32-head (both), fp32 (policy and engine in FP32: the floor of the share-of-gap metric).
        seed: Seed of data order, sampling and initialisation of any randomness.
        backend: "emulated" (CPU engine in-process, through TRL's rollout_func) or "vllm" (GPU).
        engine: Engine rounding to align to and, for vllm, the vLLM mode launched:
            "vllm-compiled" (default CUDA-graph/Inductor path) or "vllm-eager" (enforce_eager=True) on a GPU;
            "vllm-cpu-compiled" (one Inductor graph) or "vllm-cpu-eager" for vLLM's CPU build.
        attn: Attention implementation on both sides: "eager", "sdpa", "vllm_cpu" (vLLM-CPU's own kernel: the
            engine's forward with SDPA's gradient; needs vLLM's CPU build and a CPU or the emulated engine) or
            "vllm_flash" (the trainer calls vLLM's CUDA FlashAttention as vLLM's backend calls it for a prefill,
            with SDPA's gradient; needs vLLM's CUDA build, a GPU and engine vllm-eager).
        engine_gemm: Emulated engine only: "same" (the trainer's GEMMs) or "splitk".
        engine_attn_decode: Emulated engine only: attention kernel of decode steps (one new token against the KV
            cache), "eager" or "sdpa"; None = the same as ``attn`` (prefill always uses ``attn``). A value other
            than ``attn`` stands in for inference engines that decode with another kernel than they prefill.
        engine_norm_reduction: Emulated compiled engine only: "opaque" (RMSNorm's mean of squares is the trainer's
            eager reduction) or "inductor" (Inductor generates that reduction itself, another summation order).
        splitk_chunk: K-chunk of the emulated split-K GEMM, in elements.
        kernels: How aligned regions run in the trainer: "eager" ops or "compiled" (torch.compile).
        task: "arith" (synthetic arithmetic, exact-match reward), "math" (dataset + math-verify) or "digits"
            (copy/reverse/sort a digit string: long completions, prompts of varying length).
        digits_op: task=digits: "copy", "reverse" or "sort" the prompt's digit string.
        digits_min_len: task=digits: shortest digit string, in digits (= tokens).
        digits_max_len: task=digits: longest digit string, in digits.
        digits_len_step: task=digits: string lengths are min_len, min_len + step, ..., <= max_len (fewer distinct
            prompt lengths = fewer engine decode groups per step, since the engine never pads).
        math_dataset: Hub dataset id or local json/jsonl file for task=math.
        math_split: Dataset split for task=math.
        num_train_prompts: Number of distinct prompts in the training set (arith), or a cap (math).
        arith_max_operand: Largest operand of arith problems.
        prompt_style: arith prompts: "fixed" (zero-padded operands, every prompt the same token length) or
            "variable" (plain operands and three phrasings: prompts of different token lengths, left-padded
            by TRL like MATH prompts).
        steps: Optimizer steps (GRPO iterations).
        learning_rate: Peak learning rate (constant after warm-up).
        warmup_steps: Linear warm-up steps.
        lr_scheduler: Learning-rate schedule after warm-up, a transformers scheduler name.
        weight_decay: AdamW weight decay.
        max_grad_norm: Gradient clipping threshold (global L2 norm).
        prompts_per_step: Distinct prompts per optimizer step (each sampled num_generations times).
        num_generations: Completions per prompt (the GRPO group size).
        per_device_batch_size: Completions per forward/backward micro-batch, per device. Gradient
            accumulation makes up the rest: prompts_per_step x num_generations completions per step
            = per_device_batch_size x number of devices x accumulation steps.
        max_completion_length: Completion cap, in tokens.
        max_prompt_length: Prompts longer than this are dropped from the dataset, in tokens.
        temperature: Sampling temperature (both sides divide logits by it).
        beta: KL coefficient against the reference policy (0 = no reference model, no KL).
        epsilon: PPO clip range (lower and upper).
        loss_type: TRL loss aggregation: grpo, dapo, dr_grpo or bnpo.
        is_cap: Truncation cap C of the importance ratio for tis (and upper mask bound for mis).
        is_correction: Apply TRL's vLLM importance-sampling correction; None = only for tis/mis.
        gradient_checkpointing: Recompute activations in backward (saves memory, costs time).
        dtype: Policy weight dtype; "bf16" except for the fp16 and fp32 variants (which force "fp16" / "fp32").
        checkpoint_every: Save a resumable checkpoint every N optimizer steps.
        keep_checkpoints: Number of most recent checkpoints kept.
        report_to: Logging integrations passed to TRL (e.g. ["tensorboard"], ["wandb"]); none by default.
        collapse_exit_code: Process exit code when a run collapses (NaN/inf), so a sweep goes on.
        reward_collapse_window: Steps in the rolling reward mean of the reward-collapse detector.
        reward_collapse_drop: Flag reward collapse when the rolling mean falls below this fraction of its
            best value so far (after one full window).
        reward_collapse_patience: ... for this many consecutive steps (1 = the first such step flags it).
        grad_norm_collapse_factor: Flag a gradient-norm collapse when the (pre-clipping) gradient norm exceeds this
            multiple of the median of all earlier steps' norms; 0 = off.
        grad_norm_collapse_min_steps: Earlier steps needed before the gradient-norm median is trusted.
        vllm_mode: vLLM integration: "colocate" (in-process) or "server" (`trl vllm-serve`).
        vllm_gpu_memory_utilization: Fraction of GPU memory vLLM may take in colocate mode.
        vllm_server_base_url: URL of the vLLM server in server mode (None: host/port defaults).
        vllm_tensor_parallel_size: Tensor parallelism of colocated vLLM.
        mismatch_metrics: Log the full mismatch set (costs one extra no-grad forward per step).
    """

    model: str
    variant: str = "full"
    seed: int = 0
    backend: str = "emulated"
    engine: str = "vllm-compiled"
    attn: str = "eager"
    engine_gemm: str = "same"
    engine_attn_decode: str | None = None
    engine_norm_reduction: str = "opaque"
    engine_kv_cache_dtype: str = "auto"
    splitk_chunk: int = 64
    kernels: str = "eager"
    task: str = "arith"
    math_dataset: str = "DigitalLearningGmbH/MATH-lighteval"
    math_split: str = "train"
    num_train_prompts: int = 512
    arith_max_operand: int = 49
    prompt_style: str = "fixed"
    digits_op: str = "copy"
    digits_min_len: int = 8
    digits_max_len: int = 32
    digits_len_step: int = 1
    steps: int = 20
    learning_rate: float = 1e-4
    warmup_steps: int = 0
    lr_scheduler: str = "constant_with_warmup"
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    prompts_per_step: int = 4
    num_generations: int = 4
    per_device_batch_size: int = 16
    max_completion_length: int = 8
    max_prompt_length: int = 512
    temperature: float = 1.0
    beta: float = 0.0
    epsilon: float = 0.2
    loss_type: str = "dapo"
    is_cap: float = 3.0
    is_correction: bool | None = None
    gradient_checkpointing: bool = False
    dtype: str = "bf16"
    checkpoint_every: int = 5
    keep_checkpoints: int = 2
    report_to: tuple[str, ...] = ()
    collapse_exit_code: int = 0
    reward_collapse_window: int = 10
    reward_collapse_drop: float = 0.5
    reward_collapse_patience: int = 1
    grad_norm_collapse_factor: float = 0.0
    grad_norm_collapse_min_steps: int = 10
    vllm_mode: str = "colocate"
    vllm_gpu_memory_utilization: float = 0.3
    vllm_server_base_url: str | None = None
    vllm_tensor_parallel_size: int = 1
    mismatch_metrics: bool = True

    def __post_init__(self):
        choices = {"variant": TRAIN_VARIANTS, "backend": BACKENDS, "engine": ENGINES, "attn": ATTN_IMPLS,
                   "engine_gemm": ENGINE_GEMMS, "kernels": KERNEL_MODES, "task": TASKS, "vllm_mode": VLLM_MODES,
                   "dtype": ("bf16", "fp16", "fp32"), "loss_type": LOSS_TYPES,
                   "prompt_style": PROMPT_STYLES, "engine_norm_reduction": NORM_REDUCTIONS, "digits_op": DIGITS_OPS,
                   "engine_kv_cache_dtype": KV_CACHE_DTYPES}
        for key, valid in choices.items():
            if getattr(self, key) not in valid:
                raise ConfigError(f"{key}={getattr(self, key)!r} is not valid; choose one of: {', '.join(valid)}")
        if self.engine_attn_decode is not None and self.engine_attn_decode not in ENGINE_ATTN_IMPLS:
            raise ConfigError(f"engine_attn_decode={self.engine_attn_decode!r} is not valid; choose one of: "
                              f"{', '.join(ENGINE_ATTN_IMPLS)} (or none: the same as attn)")
        positive = ("splitk_chunk", "num_train_prompts", "steps", "prompts_per_step", "num_generations",
                    "per_device_batch_size", "max_completion_length",
                    "max_prompt_length", "checkpoint_every", "keep_checkpoints", "reward_collapse_window",
                    "arith_max_operand", "vllm_tensor_parallel_size", "digits_min_len", "digits_max_len",
                    "digits_len_step", "reward_collapse_patience", "grad_norm_collapse_min_steps")
        for key in positive:
            if getattr(self, key) < 1:
                raise ConfigError(f"{key}={getattr(self, key)} must be >= 1")
        for key in ("learning_rate", "temperature", "is_cap", "max_grad_norm"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"{key}={getattr(self, key)} must be > 0")
        if self.num_generations < 2:
            raise ConfigError(f"num_generations={self.num_generations}: GRPO needs >= 2 completions per prompt")
        if self.grad_norm_collapse_factor != 0 and not self.grad_norm_collapse_factor > 1:
            raise ConfigError(f"grad_norm_collapse_factor={self.grad_norm_collapse_factor} must be 0 (off) or > 1")
        if self.digits_min_len > self.digits_max_len:
            raise ConfigError(f"digits_min_len={self.digits_min_len} exceeds digits_max_len={self.digits_max_len}")
        if not 0 < self.reward_collapse_drop < 1:
            raise ConfigError(f"reward_collapse_drop={self.reward_collapse_drop} must be in (0, 1)")
        self.gradient_accumulation_steps(world_size=1)
        if self.variant == "fp16" and self.dtype != "fp16":
            object.__setattr__(self, "dtype", "fp16")
        if self.variant == "fp32" and self.dtype != "fp32":
            object.__setattr__(self, "dtype", "fp32")
        if self.dtype == "fp32" and self.variant != "fp32":
            raise ConfigError(f"dtype=fp32 is the fp32 floor run: use variant fp32 (got variant {self.variant!r})")
        if self.backend == "vllm" and (self.lm_head_fp32 or self.engine_attn_decode or
                                       self.engine_norm_reduction != "opaque" or self.engine_kv_cache_dtype != "auto"):
            raise ConfigError(f"variant={self.variant!r}, engine_attn_decode, engine_norm_reduction, "
                              "engine_kv_cache_dtype: emulated engine only "
                              "(backend vllm runs vLLM's own kernels and LM head)")
        if self.task == "digits" and self.max_completion_length < self.digits_max_len + 1:
            raise ConfigError(f"max_completion_length={self.max_completion_length} cannot hold the longest digits "
                              f"answer (digits_max_len={self.digits_max_len} digits + end of text)")
        if self.task == "arith" and self.num_train_prompts > (self.arith_max_operand + 1) ** 2 * 2:
            raise ConfigError(f"num_train_prompts={self.num_train_prompts} exceeds the distinct arith problems "
                              f"with arith_max_operand={self.arith_max_operand}")

    # -- derived settings -------------------------------------------------------------------------

    @property
    def alignment(self) -> str:
        """The numerics variant applied to the policy: the IS remedies and fp16 keep baseline numerics."""
        if self.variant == "full+fp32-head":
            return "full"
        return self.variant if self.variant in VARIANTS else "baseline"

    @property
    def lm_head_fp32(self) -> bool:
        """LM head weight and logits in fp32 on both sides (trainer: TRL's cast_lm_head_to_fp32)."""
        return self.variant.endswith("fp32-head")

    @property
    def use_is_correction(self) -> bool:
        return self.variant in ("tis", "mis") if self.is_correction is None else self.is_correction

    @property
    def is_mode(self) -> str:
        return "sequence_mask" if self.variant == "mis" else "token_truncate"

    @property
    def completions_per_step(self) -> int:
        return self.prompts_per_step * self.num_generations

    def gradient_accumulation_steps(self, world_size: int) -> int:
        """Micro-batches per optimizer step so that one step sees every completion of its prompts once."""
        micro = self.per_device_batch_size * world_size
        if self.completions_per_step % micro:
            raise ConfigError(
                f"inconsistent batch sizes: prompts_per_step x num_generations = {self.completions_per_step} "
                f"completions per step is not a multiple of per_device_batch_size x devices = "
                f"{self.per_device_batch_size} x {world_size}")
        return self.completions_per_step // micro

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["report_to"] = list(self.report_to)
        return d


_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
_HINTS = typing.get_type_hints(TrainConfig)


def _coerce(key: str, value):
    """Convert a YAML or ``--set`` value to the field's type, or raise ConfigError naming the key."""
    hint = _HINTS[key]
    args = typing.get_args(hint)
    optional = type(None) in args
    base = next(a for a in args if a is not type(None)) if optional else hint
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null") and optional):
        if optional:
            return None
        raise ConfigError(f"{key} may not be null")
    try:
        if typing.get_origin(base) is tuple or base is tuple:
            if isinstance(value, str):
                value = [v for v in value.split(",") if v]
            if not isinstance(value, (list, tuple)):
                raise TypeError
            return tuple(str(v) for v in value)
        if base is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
                return value.lower() in ("true", "1", "yes")
            raise TypeError
        if base is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise TypeError
            return int(value)
        if base is float:
            if isinstance(value, bool):
                raise TypeError
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}={value!r} is not a valid {getattr(base, '__name__', base)}") from None


def parse_set(items: list[str]) -> dict:
    """``["learning_rate=1e-5", "steps=3"]`` -> dict; values stay strings until coerced."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def build_config(base: dict | None = None, file: str | Path | None = None, overrides: dict | None = None) -> TrainConfig:
    """Merge (lowest to highest priority) ``base``, the YAML ``file`` and ``overrides`` into a TrainConfig."""
    merged: dict = {}
    sources = [("defaults", base or {})]
    if file is not None:
        path = Path(file)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping of keys to values")
        sources.append((str(path), data))
    sources.append(("--set", overrides or {}))
    for origin, data in sources:
        for key, value in data.items():
            if key not in _FIELDS:
                import difflib

                close = difflib.get_close_matches(key, list(_FIELDS), n=3, cutoff=0.6)
                hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
                raise ConfigError(f"unknown config key {key!r} (from {origin}); {hint}valid keys: {', '.join(_FIELDS)}")
            merged[key] = _coerce(key, value)
    if "model" not in merged:
        raise ConfigError("no model given (--model or model: in the config)")
    return TrainConfig(**merged)
