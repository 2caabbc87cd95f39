"""Run configuration for ``roundalign train``: one frozen dataclass, loaded from YAML and ``--set`` overrides.

Each field is a setting of the settings tree (``roundalign.settings``), which holds its type, default, choices and
help; ``roundalign train --help``, the sweep schema's descriptions (workflow/schemas/sweep.schema.yaml) and
docs/settings.md show that text. Unknown keys, wrong types, inconsistent values and settings this run would not use
raise ``ConfigError`` naming the key and the valid choices, before any model or dataset is loaded.
"""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path

import yaml

from roundalign.numerics.engines import CPU_ENGINES, with_dose
from roundalign.numerics.engines import spec as engine_spec
from roundalign.numerics.plan import VARIANTS, default_kernel_mode
from roundalign.settings import (BACKENDS, DIGITS_OPS, DTYPES, LOSS_TYPES, PROMPT_STYLES, SCORINGS,  # noqa: F401
                                 TASKS, TRAIN_KERNEL_MODES, TRAIN_VARIANTS, VLLM_CPU_GEMMS, VLLM_MODES, SettingError,
                                 check, coerce, configclass, refuse_unused, setting, show_value, use)

# the name the training code, the sweep and its tests have for a bad setting
ConfigError = SettingError


@configclass
class TrainConfig:
    """Settings of one GRPO run; docs/settings.md lists them all, from the settings tree."""

    model: str = use("model")
    variant: str = use("variant")
    seed: int = use("seed")
    backend: str = use("backend")
    engine: str = use("engine")
    attn: str = use("attn")
    engine_gemm: str = use("engine_gemm")
    engine_attn_decode: str | None = use("engine_attn_decode")
    engine_norm_reduction: str = use("engine_norm_reduction")
    engine_kv_cache_dtype: str = use("engine_kv_cache_dtype")
    engine_dose_bits: int = use("engine_dose_bits")
    splitk_chunk: int = use("splitk_chunk")
    kernels: str = use("kernels")
    scoring: str = use("scoring")
    task: str = use("task")
    math_dataset: str = use("math_dataset")
    math_split: str = use("math_split")
    num_train_prompts: int = use("num_train_prompts")
    arith_max_operand: int = use("arith_max_operand")
    prompt_style: str = use("prompt_style")
    digits_op: str = use("digits_op")
    digits_min_len: int = use("digits_min_len")
    digits_max_len: int = use("digits_max_len")
    digits_len_step: int = use("digits_len_step")
    steps: int = use("steps")
    learning_rate: float = use("learning_rate")
    warmup_steps: int = use("warmup_steps")
    lr_scheduler: str = use("lr_scheduler")
    weight_decay: float = use("weight_decay")
    max_grad_norm: float = use("max_grad_norm")
    prompts_per_step: int = use("prompts_per_step")
    num_generations: int = use("num_generations")
    per_device_batch_size: int = use("per_device_batch_size")
    max_completion_length: int = use("max_completion_length")
    max_prompt_length: int = use("max_prompt_length")
    temperature: float = use("temperature")
    beta: float = use("beta")
    epsilon: float = use("epsilon")
    loss_type: str = use("loss_type")
    is_cap: float = use("is_cap")
    is_correction: bool | None = use("is_correction")
    gradient_checkpointing: bool = use("gradient_checkpointing")
    dtype: str = use("dtype")
    checkpoint_every: int = use("checkpoint_every")
    keep_checkpoints: int = use("keep_checkpoints")
    report_to: tuple[str, ...] = use("report_to")
    collapse_exit_code: int = use("collapse_exit_code")
    reward_collapse_window: int = use("reward_collapse_window")
    reward_collapse_drop: float = use("reward_collapse_drop")
    reward_collapse_patience: int = use("reward_collapse_patience")
    grad_norm_collapse_factor: float = use("grad_norm_collapse_factor")
    grad_norm_collapse_min_steps: int = use("grad_norm_collapse_min_steps")
    vllm_mode: str = use("vllm_mode")
    vllm_gpu_memory_utilization: float = use("vllm_gpu_memory_utilization")
    vllm_server_base_url: str | None = use("vllm_server_base_url")
    vllm_tensor_parallel_size: int = use("vllm_tensor_parallel_size")
    vllm_cpu_gemm: str = use("vllm_cpu_gemm")
    heldout_prompts: int = use("heldout_prompts")
    heldout_samples: int = use("heldout_samples")
    mismatch_metrics: bool = use("mismatch_metrics")

    def __post_init__(self):
        check(self)
        refuse_unused(self, _USED_ONLY)
        if self.engine_dose_bits < 7 and (self.backend != "emulated" or self.engine not in with_dose()):
            raise ConfigError(f"engine_dose_bits={self.engine_dose_bits}: the dose is emulated on the eager engines "
                              f"only (backend emulated, engine {' or '.join(with_dose())}), not backend "
                              f"{self.backend!r} with engine {self.engine!r}")
        if self.heldout_prompts and (self.task not in ("digits", "arith")
                                     or (self.backend == "vllm" and self.vllm_mode != "colocate")):
            raise ConfigError(f"heldout_prompts={self.heldout_prompts}: the held-out evaluation covers the tasks digits "
                              f"and arith, sampled by the emulated engine or TRL's colocated vLLM engine; not task "
                              f"{self.task!r} with backend {self.backend!r} in vllm_mode {self.vllm_mode!r}")
        if self.vllm_cpu_gemm != "live" and (self.backend != "vllm" or not engine_spec(self.engine).cpu):
            raise ConfigError(f"vllm_cpu_gemm={self.vllm_cpu_gemm!r} applies to vLLM-CPU engines only (backend vllm, "
                              f"engine {' or '.join(CPU_ENGINES)}), not backend {self.backend!r} with engine "
                              f"{self.engine!r}")
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
        if self.kernels == "auto":  # resolved here, so that run.json records the mode that ran
            object.__setattr__(self, "kernels", default_kernel_mode(self.engine, fp32=self.dtype == "fp32"))
        if self.dtype == "fp32" and self.variant != "fp32":
            raise ConfigError(f"dtype=fp32 is the fp32 floor run: use variant fp32 (got variant {self.variant!r})")
        if self.backend == "vllm" and self.lm_head_fp32:
            raise ConfigError(f"variant={self.variant!r}: the fp32 LM head is the emulated engine's (backend vllm "
                              "runs vLLM's own LM head, in the model dtype)")
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
# settings that act only with others: a value other than the default where they do not act is refused
_EMULATED = (lambda c: c.backend == "emulated", "with backend emulated (the emulated engine's kernels)")
_USED_ONLY = {
    "engine_gemm": _EMULATED,
    "engine_attn_decode": _EMULATED,
    "engine_kv_cache_dtype": _EMULATED,
    "engine_norm_reduction": (lambda c: c.backend == "emulated" and engine_spec(c.engine).compiled,
                              "with backend emulated and a compiled engine (the emulated compiled engine's RMSNorm)"),
    "splitk_chunk": (lambda c: c.backend == "emulated" and c.engine_gemm == "splitk",
                     "with backend emulated and engine_gemm splitk"),
    "math_dataset": (lambda c: c.task == "math", "with task math"),
    "math_split": (lambda c: c.task == "math", "with task math"),
    "digits_op": (lambda c: c.task == "digits", "with task digits"),
    "digits_min_len": (lambda c: c.task == "digits", "with task digits"),
    "digits_max_len": (lambda c: c.task == "digits", "with task digits"),
    "digits_len_step": (lambda c: c.task == "digits", "with task digits"),
    "prompt_style": (lambda c: c.task == "arith", "with task arith"),
    "heldout_samples": (lambda c: c.heldout_prompts > 0, "with heldout_prompts > 0"),
    "grad_norm_collapse_min_steps": (lambda c: c.grad_norm_collapse_factor > 0, "with grad_norm_collapse_factor > 0"),
    "vllm_mode": (lambda c: c.backend == "vllm", "with backend vllm"),
    "vllm_gpu_memory_utilization": (lambda c: c.backend == "vllm", "with backend vllm"),
    "vllm_tensor_parallel_size": (lambda c: c.backend == "vllm", "with backend vllm"),
    "vllm_server_base_url": (lambda c: c.backend == "vllm" and c.vllm_mode == "server",
                             "with backend vllm in vllm_mode server"),
}


def setting_help(key: str) -> str:
    """The help text of train setting ``key`` (the settings tree's): the one source of the CLI's, the sweep schema's
    and docs/settings.md's description of that key."""
    return setting(key).help


def setting_choices(key: str) -> tuple | None:
    """The valid values of ``key`` (None as well where the key is optional), or None where any value of its type
    goes."""
    return setting(key).valid()


def setting_default(key: str):
    """The default of ``key`` (``dataclasses.MISSING`` for ``model``, which has none)."""
    return _FIELDS[key].default


def setting_type(key: str):
    """The type of ``key`` (``str``, ``int | None``, ``tuple[str, ...]`` ...)."""
    return setting(key).type


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
                close = difflib.get_close_matches(key, list(_FIELDS), n=3, cutoff=0.6)
                hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
                raise ConfigError(f"unknown config key {key!r} (from {origin}); {hint}valid keys: {', '.join(_FIELDS)}")
            merged[key] = coerce(key, value)
    if "model" not in merged:
        raise ConfigError("no model given (--model or model: in the config)")
    return TrainConfig(**merged)
