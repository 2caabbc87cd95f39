"""Run configuration for ``roundalign train``: one frozen dataclass, loaded from YAML and ``--set`` overrides.

Unknown keys, wrong types and inconsistent values raise ``ConfigError`` naming the key and the valid
choices, before any model or dataset is loaded. The help text of every key (with its units and choices) is written
once, in the field's ``metadata["help"]``; ``roundalign train --help``, the sweep schema's descriptions
(workflow/schemas/sweep.schema.yaml) and docs/settings.md show that text (scripts/gen_settings.py writes the latter
two from it).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from pathlib import Path

import yaml

from roundalign.engine.choices import ATTN_IMPLS, ENGINE_ATTN_IMPLS, ENGINE_GEMMS, KV_CACHE_DTYPES, NORM_REDUCTIONS
from roundalign.numerics.engines import CPU_ENGINES, ENGINES, GPU_ENGINES, with_dose
from roundalign.numerics.engines import names as engine_names, spec as engine_spec
from roundalign.numerics.plan import KERNEL_MODES, VARIANTS, default_kernel_mode

BACKENDS = ("emulated", "vllm")
TASKS = ("arith", "math", "digits")
TRAIN_KERNEL_MODES = ("auto", *KERNEL_MODES)  # auto: resolved to default_kernel_mode in __post_init__
DIGITS_OPS = ("copy", "reverse", "sort")
# fp32-head: LM head and logits in fp32 on both sides (TRL's cast_lm_head_to_fp32; MiniMax-M1's fp32 head), with
# baseline numerics elsewhere; full+fp32-head adds it to full; fp32: everything in fp32 on both sides, the floor
# of the share-of-gap metric.
TRAIN_VARIANTS = ("baseline", "rope", "swiglu", "norm", "full", "tis", "mis", "fp16", "fp32-head", "full+fp32-head",
                  "fp32")
VLLM_MODES = ("colocate", "server")
LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo")
PROMPT_STYLES = ("fixed", "variable")
DTYPES = ("bf16", "fp16", "fp32")
SCORINGS = ("trl", "engine")
VLLM_CPU_GEMMS = ("live", "stock", "repack")


class ConfigError(ValueError):
    """A configuration value is unknown, mistyped or inconsistent."""


def _one_of(choices, notes: dict | None = None, quote: bool = True, last: str = " or ") -> str:
    """``"a" (note), "b" or "c"``: every choice of a constant in its order, each with its note where it has one, so
    that a help text listing a constant names a choice added to it too."""
    notes = notes or {}
    stale = set(notes) - set(choices)
    if stale:
        raise ValueError(f"help notes for choices that do not exist: {', '.join(sorted(stale))}")
    items = [(f'"{c}"' if quote else c) + (f" ({notes[c]})" if c in notes else "") for c in choices]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + last + items[-1]


# choices read when a config is checked rather than when the module is imported: the engine registry's names, so that
# an engine registered later (roundalign.numerics.engines.register) is valid too
_LIVE_CHOICES = {"engine": engine_names}


def _setting(default=dataclasses.MISSING, *, help: str, choices: tuple | None = None):
    """A TrainConfig field carrying its own help (and valid choices), as TRL's and transformers' config fields do:
    the CLI (``roundalign train --help``), the sweep schema and docs/settings.md all show this text
    (scripts/gen_settings.py writes the latter two; tests/test_settings.py checks they agree)."""
    metadata = {"help": help} if choices is None else {"help": help, "choices": tuple(choices)}
    return dataclasses.field(default=default, metadata=metadata)


@dataclass(frozen=True)
class TrainConfig:
    """Settings of one GRPO run. Each field's help is in its ``metadata["help"]`` (its valid values, where it has a
    fixed set, in ``metadata["choices"]``); docs/settings.md lists them all."""

    model: str = _setting(
        help="Local model directory or a hub id (hub ids need the hub or a pre-filled HF cache).")
    variant: str = _setting(
        "full", choices=TRAIN_VARIANTS,
        help=f"Alignment variant ({_one_of(VARIANTS, quote=False, last=', ')}) or a remedy of other work: "
             + _one_of([v for v in TRAIN_VARIANTS if v not in VARIANTS], quote=False, last=", ", notes={
                 "tis": "token-level truncated importance sampling",
                 "mis": "sequence-level masked IS",
                 "fp16": "policy and engine both in FP16",
                 "fp32-head": "LM head and logits in FP32 on both sides",
                 "full+fp32-head": "both",
                 "fp32": "policy and engine in FP32: the floor of the share-of-gap metric"}) + ".")
    seed: int = _setting(0, help="Seed of data order, sampling and initialisation of any randomness.")
    backend: str = _setting(
        "emulated", choices=BACKENDS,
        help=_one_of(BACKENDS, {"emulated": "CPU engine in-process, through TRL's rollout_func", "vllm": "GPU"})
             + ".")
    engine: str = _setting(
        "vllm-compiled", choices=ENGINES,
        help="Engine rounding to align to and, for vllm, the vLLM mode launched: "
             + _one_of(GPU_ENGINES, {e: engine_spec(e).help for e in GPU_ENGINES})
             + " on a GPU; "
             + _one_of(CPU_ENGINES, {e: engine_spec(e).help for e in CPU_ENGINES})
             + " for vLLM's CPU build.")
    attn: str = _setting(
        "eager", choices=ATTN_IMPLS,
        help="Attention implementation on both sides: " + _one_of(ATTN_IMPLS, {
            "vllm_cpu": "vLLM-CPU's own kernel: the engine's forward with SDPA's gradient; needs vLLM's CPU build "
                        "and a CPU or the emulated engine",
            "vllm_flash": "the trainer calls vLLM's CUDA FlashAttention as vLLM's backend calls it for a prefill, "
                          "with SDPA's gradient; needs vLLM's CUDA build, a GPU and engine vllm-eager"}) + ".")
    engine_gemm: str = _setting(
        "same", choices=ENGINE_GEMMS,
        help="Emulated engine only: " + _one_of(ENGINE_GEMMS, {"same": "the trainer's GEMMs"}) + ".")
    engine_attn_decode: str | None = _setting(
        None, choices=ENGINE_ATTN_IMPLS,
        help="Emulated engine only: attention kernel of decode steps (one new token against the KV cache), "
             f"{_one_of(ENGINE_ATTN_IMPLS)}; None = the same as `attn` (prefill always uses `attn`). A value other "
             "than `attn` stands in for inference engines that decode with another kernel than they prefill.")
    engine_norm_reduction: str = _setting(
        "opaque", choices=NORM_REDUCTIONS,
        help="Emulated compiled engine only: " + _one_of(NORM_REDUCTIONS, {
            "opaque": "RMSNorm's mean of squares is the trainer's eager reduction",
            "inductor": "Inductor generates that reduction itself, another summation order"}) + ".")
    engine_kv_cache_dtype: str = _setting(
        "auto", choices=KV_CACHE_DTYPES,
        help="Emulated engine only: KV-cache storage, vLLM's names: "
             f"{_one_of(KV_CACHE_DTYPES, {'auto': 'model dtype'}, last=', ')}; the fp8 formats store K/V quantized, "
             "with scale 1.0.")
    engine_dose_bits: int = _setting(
        7, help="Emulated eager engines only (vllm-eager, vllm-cpu-eager): a rounding dose at the aligned regions "
                "(roundalign.numerics.dose): the engine rounds every RMSNorm output, the RoPE'd q/k and the SwiGLU "
                "output to this many mantissa bits (7 = bf16, no dose; 3 = fp8 e4m3's mantissa). The trainer rounds "
                "the regions its variant aligns the same way, with a straight-through gradient.")
    splitk_chunk: int = _setting(64, help="K-chunk of the emulated split-K GEMM, in elements.")
    kernels: str = _setting(
        "auto", choices=TRAIN_KERNEL_MODES,
        help="How aligned regions run in the trainer: "
             + _one_of(TRAIN_KERNEL_MODES, {"auto": "the mode that matches the engine, resolved when the config "
                                                         "is built: compiled for vllm-cpu-compiled unless fp32, else "
                                                         "eager", "eager": "separate torch ops",
                                                 "compiled": "torch.compile"}) + ".")
    scoring: str = _setting(
        "trl", choices=SCORINGS,
        help="How the trainer computes each sampled token's log-prob (the loss, the old and reference log-probs and "
             "the mismatch metrics): " + _one_of(SCORINGS, {
                 "trl": "TRL's fused LM head, an online log-sum-exp over vocabulary tiles",
                 "engine": "the engine sampler's formula (roundalign.numerics.sampler): the head's logits in fp32, "
                           "divided by the temperature, log-softmax over the whole vocabulary, with a gradient; "
                           "bitwise the engine's processed logprobs where the hidden states are"}) + ".")
    task: str = _setting(
        "arith", choices=TASKS,
        help=_one_of(TASKS, {
            "arith": "synthetic arithmetic, exact-match reward", "math": "dataset + math-verify",
            "digits": f"{'/'.join(DIGITS_OPS)} a digit string: long completions, prompts of varying length"}) + ".")
    math_dataset: str = _setting("DigitalLearningGmbH/MATH-lighteval",
                                 help="Hub dataset id or local json/jsonl file for task=math.")
    math_split: str = _setting("train", help="Dataset split for task=math.")
    num_train_prompts: int = _setting(
        512, help="Number of distinct prompts in the training set (arith), or a cap (math).")
    arith_max_operand: int = _setting(49, help="Largest operand of arith problems.")
    prompt_style: str = _setting(
        "fixed", choices=PROMPT_STYLES,
        help="arith prompts: " + _one_of(PROMPT_STYLES, {
            "fixed": "zero-padded operands, every prompt the same token length",
            "variable": "plain operands and three phrasings: prompts of different token lengths, left-padded by TRL "
                        "like MATH prompts"}) + ".")
    digits_op: str = _setting(
        "copy", choices=DIGITS_OPS, help=f"task=digits: {_one_of(DIGITS_OPS)} the prompt's digit string.")
    digits_min_len: int = _setting(8, help="task=digits: shortest digit string, in digits (= tokens).")
    digits_max_len: int = _setting(32, help="task=digits: longest digit string, in digits.")
    digits_len_step: int = _setting(
        1, help="task=digits: step between string lengths, in digits: lengths are digits_min_len, digits_min_len + "
                "step, ..., <= digits_max_len (fewer distinct prompt lengths = fewer engine decode groups per step, "
                "since the engine never pads).")
    steps: int = _setting(20, help="Optimizer steps (GRPO iterations).")
    learning_rate: float = _setting(1e-4, help="Peak learning rate (constant after warm-up).")
    warmup_steps: int = _setting(0, help="Linear warm-up steps.")
    lr_scheduler: str = _setting("constant_with_warmup",
                                 help="Learning-rate schedule after warm-up, a transformers scheduler name.")
    weight_decay: float = _setting(0.0, help="AdamW weight decay.")
    max_grad_norm: float = _setting(1.0, help="Gradient clipping threshold (global L2 norm).")
    prompts_per_step: int = _setting(
        4, help="Distinct prompts per optimizer step (each sampled num_generations times).")
    num_generations: int = _setting(4, help="Completions per prompt (the GRPO group size).")
    per_device_batch_size: int = _setting(
        16, help="Completions per forward/backward micro-batch, per device. Gradient accumulation makes up the rest: "
                 "prompts_per_step x num_generations completions per step = per_device_batch_size x number of "
                 "devices x accumulation steps.")
    max_completion_length: int = _setting(8, help="Completion cap, in tokens.")
    max_prompt_length: int = _setting(512, help="Prompts longer than this are dropped from the dataset, in tokens.")
    temperature: float = _setting(1.0, help="Sampling temperature (both sides divide logits by it).")
    beta: float = _setting(0.0, help="KL coefficient against the reference policy (0 = no reference model, no KL).")
    epsilon: float = _setting(0.2, help="PPO clip range (lower and upper).")
    loss_type: str = _setting(
        "dapo", choices=LOSS_TYPES, help=f"TRL loss aggregation: {_one_of(LOSS_TYPES, quote=False)}.")
    is_cap: float = _setting(
        3.0, help="Truncation cap C of the importance ratio for tis (and upper mask bound for mis).")
    is_correction: bool | None = _setting(
        None, help="Apply TRL's vLLM importance-sampling correction; None = only for tis/mis.")
    gradient_checkpointing: bool = _setting(
        False, help="Recompute activations in backward (saves memory, costs time).")
    dtype: str = _setting(
        "bf16", choices=DTYPES,
        help=f"Policy weight dtype ({_one_of(DTYPES)}); \"bf16\" except for the fp16 and fp32 variants (which force "
             "\"fp16\" / \"fp32\").")
    checkpoint_every: int = _setting(5, help="Save a resumable checkpoint every N optimizer steps.")
    keep_checkpoints: int = _setting(2, help="Number of most recent checkpoints kept.")
    report_to: tuple[str, ...] = _setting(
        (), help='Logging integrations passed to TRL (e.g. ["tensorboard"], ["wandb"]); none by default.')
    collapse_exit_code: int = _setting(
        0, help="Process exit code when a run collapses (NaN/inf), so a sweep goes on.")
    reward_collapse_window: int = _setting(
        10, help="Steps in the rolling reward mean of the reward-collapse detector.")
    reward_collapse_drop: float = _setting(
        0.5, help="Flag reward collapse when the rolling mean falls below this fraction of its best value so far "
                  "(after one full window).")
    reward_collapse_patience: int = _setting(
        1, help="Flag reward collapse only once the rolling mean has stayed below the reward_collapse_drop line for "
                "this many consecutive steps (1 = the first such step flags it).")
    grad_norm_collapse_factor: float = _setting(
        0.0, help="Flag a gradient-norm collapse when the (pre-clipping) gradient norm exceeds this multiple of the "
                  "median of all earlier steps' norms; 0 = off.")
    grad_norm_collapse_min_steps: int = _setting(
        10, help="Earlier steps needed before the gradient-norm median is trusted.")
    vllm_mode: str = _setting(
        "colocate", choices=VLLM_MODES,
        help="vLLM integration: " + _one_of(VLLM_MODES, {"colocate": "in-process", "server": "`trl vllm-serve`"})
             + ".")
    vllm_gpu_memory_utilization: float = _setting(
        0.3, help="Fraction of GPU memory vLLM may take in colocate mode.")
    vllm_server_base_url: str | None = _setting(
        None, help="URL of the vLLM server in server mode (None: host/port defaults).")
    vllm_tensor_parallel_size: int = _setting(1, help="Tensor parallelism of colocated vLLM.")
    vllm_cpu_gemm: str = _setting(
        "live", choices=VLLM_CPU_GEMMS,
        help="vLLM-CPU engines (backend vllm) only: " + _one_of(VLLM_CPU_GEMMS, {
            "live": "the runner replaces vLLM's CPU GEMM dispatch by F.linear on the live weight parameters, which "
                    "TRL's weight sync writes",
            "stock": "nothing replaced: vLLM's own dispatch, accepted where it keeps every weight in place (its "
                     "torch.nn.functional.linear fallback, as on AVX2 CPUs, where oneDNN builds no bf16 matmul); "
                     "where it prepacks weights (oneDNN, SGL, zentorch) TRL's sync cannot reach them, and the run "
                     "stops before step 1 naming the kernels",
            "repack": "vLLM's own GEMM kernels, whichever it picks on this CPU (prepacked oneDNN on AVX-512, SGL on "
                      "AMX), with the weights kept in place: after each TRL weight sync vLLM's own dispatch runs "
                      "again and prepacks the new weights (bridge.vllm_cpu.install_repack_gemm_dispatch)"}) + ".")
    heldout_prompts: int = _setting(
        0, help="Held-out problems on which the policy's reward is measured by the engine before the first step and "
                "after the last (run.json heldout_initial / heldout_final; roundalign.training.heldout); 0 = off. "
                "Task digits or arith; the emulated engine or TRL's colocated vLLM engine.")
    heldout_samples: int = _setting(4, help="Engine samples per held-out problem (at the run's temperature).")
    mismatch_metrics: bool = _setting(
        True, help="Log the full mismatch set (costs one extra no-grad forward per step).")

    def __post_init__(self):
        for f in dataclasses.fields(self):
            valid, value = _LIVE_CHOICES.get(f.name, lambda: f.metadata.get("choices"))(), getattr(self, f.name)
            if valid is None or value in valid or (value is None and f.name in _OPTIONAL):
                continue
            raise ConfigError(f"{f.name}={value!r} is not valid; choose one of: {', '.join(valid)}"
                              + (f" (or none: {_NONE_MEANS[f.name]})" if f.name in _NONE_MEANS else ""))
        positive = ("splitk_chunk", "num_train_prompts", "steps", "prompts_per_step", "num_generations",
                    "per_device_batch_size", "max_completion_length",
                    "max_prompt_length", "checkpoint_every", "keep_checkpoints", "reward_collapse_window",
                    "arith_max_operand", "vllm_tensor_parallel_size", "digits_min_len", "digits_max_len",
                    "digits_len_step", "reward_collapse_patience", "grad_norm_collapse_min_steps")
        for key in positive:
            if getattr(self, key) < 1:
                raise ConfigError(f"{key}={getattr(self, key)} must be >= 1")
        if isinstance(self.engine_dose_bits, bool) or not isinstance(self.engine_dose_bits, int) \
                or not 1 <= self.engine_dose_bits <= 7:
            raise ConfigError(f"engine_dose_bits={self.engine_dose_bits!r} must be an integer from 1 to 7 (7: no dose)")
        if self.engine_dose_bits < 7 and (self.backend != "emulated" or self.engine not in with_dose()):
            raise ConfigError(f"engine_dose_bits={self.engine_dose_bits}: the dose is emulated on the eager engines "
                              f"only (backend emulated, engine {' or '.join(with_dose())}), not backend "
                              f"{self.backend!r} with engine {self.engine!r}")
        for key in ("learning_rate", "temperature", "is_cap", "max_grad_norm"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"{key}={getattr(self, key)} must be > 0")
        if self.heldout_prompts < 0 or self.heldout_samples < 1:
            raise ConfigError(f"heldout_prompts={self.heldout_prompts} must be >= 0 and heldout_samples="
                              f"{self.heldout_samples} >= 1")
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
_OPTIONAL = {k for k, h in _HINTS.items() if type(None) in typing.get_args(h)}
# what None means for an optional key with choices, in the error naming the valid choices
_NONE_MEANS = {"engine_attn_decode": "the same as attn"}


def setting_help(key: str) -> str:
    """The help text of TrainConfig key ``key`` (its field's ``metadata["help"]``): the one source of the CLI's,
    the sweep schema's and docs/settings.md's description of that key."""
    return _FIELDS[key].metadata["help"]


def setting_choices(key: str) -> tuple | None:
    """The valid values of ``key`` (None as well where the key is optional), or None where any value of its type
    goes."""
    return _FIELDS[key].metadata.get("choices")


def setting_default(key: str):
    """The default of ``key`` (``dataclasses.MISSING`` for ``model``, which has none)."""
    return _FIELDS[key].default


def setting_type(key: str):
    """The type hint of ``key`` (``str``, ``int | None``, ``tuple[str, ...]`` ...)."""
    return _HINTS[key]


def show_value(value) -> str:
    """A setting's value as YAML spells it: ``null``, ``true``, ``[]``, ``[tensorboard]``, ``0.0001``, ``full``."""
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, str):
        return value
    return yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()


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
