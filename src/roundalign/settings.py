"""The settings tree: every setting of ``roundalign train``, ``probe`` and ``attribute`` defined once.

A setting is one ``Setting`` record, defined here once: its key, its section (model, alignment, engine, sampling,
task, training, run, probe, attribute, sweep), its type, its default, its valid choices and its help. The commands'
configurations (``training.config.TrainConfig``, ``probes.probe.ProbeConfig``, ``probes.attribute.AttributeConfig``)
are dataclasses whose fields name a setting (``use("engine")``), with a default or a narrower set of choices of their
own where a command needs one. From the same records come the command line (``add_arguments``), the checks of types,
choices and bounds (``check``), the refusal of a setting that a command would not use (``refuse_unused``), the sweep
schema's descriptions and docs/settings.md (``tools`` writes both; tests/test_settings.py holds them to it).

The sweep's ``probe:`` and ``attribution:`` keys are settings too, of section sweep, named by their place
(``probe.engines``): one that a sweep passes to ``roundalign probe`` or ``attribute`` names that setting
(``feeds``) and takes its type, choices, bounds and help, with the sweep's own default, narrower choices and what
``null`` means where they differ (``_sweep``); one that only the sweep reads (``probe.mem_mb``) has its own. The
schema's ``probe:`` and ``attribution:`` properties are written from them.

As torchtitan's ``JobConfig`` and TRL's config dataclasses do, the help lives beside the definition. The module
imports neither torch nor transformers: the sweep's checks read it at every Snakemake invocation.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml

from roundalign.engine.choices import ATTN_IMPLS, ENGINE_ATTN_IMPLS, ENGINE_GEMMS, KV_CACHE_DTYPES, NORM_REDUCTIONS
from roundalign.numerics.engines import CPU_ENGINES, DEFAULT_ENGINE, GPU_ENGINES
from roundalign.numerics.engines import names as engine_names, spec as engine_spec
from roundalign.numerics.plan import KERNEL_MODES, VARIANTS

BACKENDS = ("emulated", "vllm")
TASKS = ("arith", "math", "digits")
TRAIN_KERNEL_MODES = ("auto", *KERNEL_MODES)  # auto: resolved to default_kernel_mode when a TrainConfig is built
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
# roundalign attribute
SOURCES = ("sampling", "decode", "positions", "batching", "lm_head", "kv_cache", "gemm", "attention", "rounding")
LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")  # vLLM's, for the sampled tokens' logprobs
VLLM_GEMMS = ("native", "live")  # vLLM-CPU: its own prepacked GEMM, or F.linear on live weights (training's)
TRAINER_ATTNS = ("eager", "sdpa")
SECTIONS = ("model", "alignment", "engine", "sampling", "task", "training", "run", "probe", "attribute", "sweep")


class SettingError(ValueError):
    """A setting's value is unknown, mistyped, out of bounds, inconsistent with another, or unused."""


def _one_of(choices, notes: dict | None = None, quote: bool = True, last: str = " or ") -> str:
    """``"a" (note), "b" or "c"``: every choice of a constant in its order, each with its note where it has one, so
    that a help text listing a constant names a choice added to it too."""
    notes = notes or {}
    stale = set(notes) - set(choices)
    if stale:
        raise ValueError(f"help notes for choices that do not exist: {', '.join(sorted(stale))}")
    items = [(f'"{c}"' if quote else c) + (f" ({notes[c]})" if c in notes else "") for c in choices]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + last + items[-1]


@dataclass(frozen=True)
class Setting:
    """One setting.

    Attributes:
        key: its name in YAML configs, ``--set`` and run records.
        section: where it belongs (``SECTIONS``).
        type: its type (``str``, ``int``, ``float``, ``bool``, ``str | None``, ``tuple[str, ...]``).
        default: its default (``dataclasses.MISSING``: required).
        help: what it does, its units and its choices, in words: the one text every command, the schema and
            docs/settings.md show.
        choices: the valid values, or a function giving them when a value is checked (the engine registry's
            names, so that an engine registered at run time is valid too); None: any value of its type.
        item_choices: for a tuple setting, the valid values of each item.
        none_means: for an optional setting, what None means (named when a value is refused, and in the help of a
            sweep key, where ``null`` inherits another key's value).
        at_least: the smallest valid value (numbers).
        above: a value the setting must exceed (numbers).
        at_most: the largest valid value (numbers).
        below: a value the setting must stay under (numbers).
        min_items: for a tuple setting, the fewest items it may have.
        feeds: for a sweep key, the command setting it passes on (its type, choices, bounds and help are that
            setting's unless the sweep's differ); None: a key only the sweep reads.
    """

    key: str
    section: str
    type: Any
    default: Any = dataclasses.MISSING
    help: str = ""
    choices: tuple | Callable[[], tuple] | None = None
    item_choices: tuple | None = None
    none_means: str | None = None
    at_least: float | None = None
    above: float | None = None
    at_most: float | None = None
    below: float | None = None
    min_items: int | None = None
    feeds: str | None = None

    @property
    def optional(self) -> bool:
        return type(None) in typing.get_args(self.type)

    def valid(self) -> tuple | None:
        return self.choices() if callable(self.choices) else self.choices


SETTINGS: dict[str, Setting] = {}


def _define(key: str, section: str, type_, default=dataclasses.MISSING, **kw) -> Setting:
    if key in SETTINGS:
        raise ValueError(f"setting {key!r} is defined twice")
    if section not in SECTIONS:
        raise ValueError(f"setting {key!r}: unknown section {section!r}; sections: {', '.join(SECTIONS)}")
    SETTINGS[key] = s = Setting(key, section, type_, default, **kw)
    return s


# --------------------------------------------------------------------------------------------------------------------
# The settings. Those of roundalign train first, in TrainConfig's order (its run records keep that order).

_define("model", "model", str,
    help="Local model directory or a hub id (hub ids need the hub or a pre-filled HF cache).")
_define("variant", "alignment", str,
    "full", choices=TRAIN_VARIANTS,
    help=f"Alignment variant ({_one_of(VARIANTS, quote=False, last=', ')}) or a remedy of other work: "
         + _one_of([v for v in TRAIN_VARIANTS if v not in VARIANTS], quote=False, last=", ", notes={
             "tis": "token-level truncated importance sampling",
             "mis": "sequence-level masked IS",
             "fp16": "policy and engine both in FP16",
             "fp32-head": "LM head and logits in FP32 on both sides",
             "full+fp32-head": "both",
             "fp32": "policy and engine in FP32: the floor of the share-of-gap metric"}) + ".")
_define("seed", "run", int, 0, help="Seed of data order, sampling and initialisation of any randomness.")
_define("backend", "engine", str,
    "emulated", choices=BACKENDS,
    help="Who samples: " + _one_of(BACKENDS, {
        "emulated": "the emulated engine, in-process on the CPU (train: through TRL's rollout_func)",
        "vllm": "real vLLM, its CUDA build on a GPU or its CPU build for the vllm-cpu engines"}) + ".")
_define("engine", "engine", str,
    DEFAULT_ENGINE, choices=engine_names,
    help="Engine rounding to align to and, for vllm, the vLLM mode launched: "
         + _one_of(GPU_ENGINES, {e: engine_spec(e).help for e in GPU_ENGINES})
         + " on a GPU; "
         + _one_of(CPU_ENGINES, {e: engine_spec(e).help for e in CPU_ENGINES})
         + " for vLLM's CPU build.")
_define("attn", "engine", str,
    "eager", choices=ATTN_IMPLS,
    help="Attention implementation on both sides: " + _one_of(ATTN_IMPLS, {
        "vllm_cpu": "vLLM-CPU's own kernel: the engine's forward with SDPA's gradient; needs vLLM's CPU build "
                    "and a CPU or the emulated engine",
        "vllm_flash": "the trainer calls vLLM's CUDA FlashAttention as vLLM's backend calls it for a prefill, "
                      "with SDPA's gradient; needs vLLM's CUDA build, a GPU and engine vllm-eager"}) + ".")
_define("engine_gemm", "engine", str,
    "same", choices=ENGINE_GEMMS,
    help="Emulated engine only: " + _one_of(ENGINE_GEMMS, {"same": "the trainer's GEMMs"}) + ".")
_define("engine_attn_decode", "engine", str | None,
    None, choices=ENGINE_ATTN_IMPLS,
    none_means="the same as attn",
    help="Emulated engine only: attention kernel of decode steps (one new token against the KV cache), "
         f"{_one_of(ENGINE_ATTN_IMPLS)}; None = the same as `attn` (prefill always uses `attn`). A value other "
         "than `attn` stands in for inference engines that decode with another kernel than they prefill.")
_define("engine_norm_reduction", "engine", str,
    "opaque", choices=NORM_REDUCTIONS,
    help="Emulated compiled engine only: " + _one_of(NORM_REDUCTIONS, {
        "opaque": "RMSNorm's mean of squares is the trainer's eager reduction",
        "inductor": "Inductor generates that reduction itself, another summation order"}) + ".")
_define("engine_kv_cache_dtype", "engine", str,
    "auto", choices=KV_CACHE_DTYPES,
    help="Emulated engine only: KV-cache storage, vLLM's names: "
         f"{_one_of(KV_CACHE_DTYPES, {'auto': 'model dtype'}, last=', ')}; the fp8 formats store K/V quantized, "
         "with scale 1.0.")
_define("engine_dose_bits", "engine", int,
    7, at_least=1, at_most=7,
    help="Emulated eager engines only (vllm-eager, vllm-cpu-eager): a rounding dose at the aligned regions "
            "(roundalign.numerics.dose): the engine rounds every RMSNorm output, the RoPE'd q/k and the SwiGLU "
            "output to this many mantissa bits (7 = bf16, no dose; 3 = fp8 e4m3's mantissa). The trainer rounds "
            "the regions its variant aligns the same way, with a straight-through gradient.")
_define("splitk_chunk", "engine", int, 64, at_least=1, help="K-chunk of the emulated split-K GEMM, in elements.")
_define("kernels", "alignment", str,
    "auto", choices=TRAIN_KERNEL_MODES,
    help="How aligned regions run in the trainer: "
         + _one_of(TRAIN_KERNEL_MODES, {"auto": "the mode that matches the engine, resolved when the config "
                                                     "is built: compiled for vllm-cpu-compiled unless fp32, else "
                                                     "eager", "eager": "separate torch ops",
                                             "compiled": "torch.compile"}) + ".")
_define("scoring", "alignment", str,
    "trl", choices=SCORINGS,
    help="How the trainer computes each sampled token's log-prob (the loss, the old and reference log-probs and "
         "the mismatch metrics): " + _one_of(SCORINGS, {
             "trl": "TRL's fused LM head, an online log-sum-exp over vocabulary tiles",
             "engine": "the engine sampler's formula (roundalign.numerics.sampler): the head's logits in fp32, "
                       "divided by the temperature, log-softmax over the whole vocabulary, with a gradient; "
                       "bitwise the engine's processed logprobs where the hidden states are"}) + ".")
_define("task", "task", str,
    "arith", choices=TASKS,
    help=_one_of(TASKS, {
        "arith": "synthetic arithmetic, exact-match reward", "math": "dataset + math-verify",
        "digits": f"{'/'.join(DIGITS_OPS)} a digit string: long completions, prompts of varying length"}) + ".")
_define("math_dataset", "task", str, "DigitalLearningGmbH/MATH-lighteval",
                             help="Hub dataset id or local json/jsonl file for task=math.")
_define("math_split", "task", str, "train", help="Dataset split for task=math.")
_define("num_train_prompts", "task", int,
    512, at_least=1, help="Number of distinct prompts in the training set (arith), or a cap (math).")
_define("arith_max_operand", "task", int, 49, at_least=1, help="Largest operand of arith problems.")
_define("prompt_style", "task", str,
    "fixed", choices=PROMPT_STYLES,
    help="arith prompts: " + _one_of(PROMPT_STYLES, {
        "fixed": "zero-padded operands, every prompt the same token length",
        "variable": "plain operands and three phrasings: prompts of different token lengths, left-padded by TRL "
                    "like MATH prompts"}) + ".")
_define("digits_op", "task", str,
    "copy", choices=DIGITS_OPS, help=f"task=digits: {_one_of(DIGITS_OPS)} the prompt's digit string.")
_define("digits_min_len", "task", int, 8, at_least=1, help="task=digits: shortest digit string, in digits (= tokens).")
_define("digits_max_len", "task", int, 32, at_least=1, help="task=digits: longest digit string, in digits.")
_define("digits_len_step", "task", int,
    1, at_least=1,
    help="task=digits: step between string lengths, in digits: lengths are digits_min_len, digits_min_len + "
            "step, ..., <= digits_max_len (fewer distinct prompt lengths = fewer engine decode groups per step, "
            "since the engine never pads).")
_define("steps", "training", int, 20, at_least=1, help="Optimizer steps (GRPO iterations).")
_define("learning_rate", "training", float, 1e-4, above=0, help="Peak learning rate (constant after warm-up).")
_define("warmup_steps", "training", int, 0, help="Linear warm-up steps.")
_define("lr_scheduler", "training", str, "constant_with_warmup",
                             help="Learning-rate schedule after warm-up, a transformers scheduler name.")
_define("weight_decay", "training", float, 0.0, help="AdamW weight decay.")
_define("max_grad_norm", "training", float, 1.0, above=0, help="Gradient clipping threshold (global L2 norm).")
_define("prompts_per_step", "training", int,
    4, at_least=1, help="Distinct prompts per optimizer step (each sampled num_generations times).")
_define("num_generations", "sampling", int, 4, at_least=1, help="Completions per prompt (the GRPO group size).")
_define("per_device_batch_size", "training", int,
    16, at_least=1,
    help="Completions per forward/backward micro-batch, per device. Gradient accumulation makes up the rest: "
             "prompts_per_step x num_generations completions per step = per_device_batch_size x number of "
             "devices x accumulation steps.")
_define("max_completion_length", "sampling", int, 8, at_least=1, help="Completion cap, in tokens.")
_define("max_prompt_length", "sampling", int, 512, at_least=1,
        help="Prompts longer than this are dropped from the dataset, in tokens.")
_define("temperature", "sampling", float, 1.0, above=0, help="Sampling temperature (both sides divide logits by it).")
_define("beta", "training", float, 0.0,
        help="KL coefficient against the reference policy (0 = no reference model, no KL).")
_define("epsilon", "training", float, 0.2, help="PPO clip range (lower and upper).")
_define("loss_type", "training", str,
    "dapo", choices=LOSS_TYPES, help=f"TRL loss aggregation: {_one_of(LOSS_TYPES, quote=False)}.")
_define("is_cap", "alignment", float,
    3.0, above=0, help="Truncation cap C of the importance ratio for tis (and upper mask bound for mis).")
_define("is_correction", "alignment", bool | None,
    None, help="Apply TRL's vLLM importance-sampling correction; None = only for tis/mis.")
_define("gradient_checkpointing", "training", bool,
    False, help="Recompute activations in backward (saves memory, costs time).")
_define("dtype", "model", str,
    "bf16", choices=DTYPES,
    help=f"Policy weight dtype ({_one_of(DTYPES)}); \"bf16\" except for the fp16 and fp32 variants (which force "
         "\"fp16\" / \"fp32\").")
_define("checkpoint_every", "run", int, 5, at_least=1, help="Save a resumable checkpoint every N optimizer steps.")
_define("keep_checkpoints", "run", int, 2, at_least=1, help="Number of most recent checkpoints kept.")
_define("report_to", "run", tuple[str, ...],
    (), help='Logging integrations passed to TRL (e.g. ["tensorboard"], ["wandb"]); none by default.')
_define("collapse_exit_code", "run", int,
    0, help="Process exit code when a run collapses (NaN/inf), so a sweep goes on.")
_define("reward_collapse_window", "run", int,
    10, at_least=1, help="Steps in the rolling reward mean of the reward-collapse detector.")
_define("reward_collapse_drop", "run", float,
    0.5, help="Flag reward collapse when the rolling mean falls below this fraction of its best value so far "
              "(after one full window).")
_define("reward_collapse_patience", "run", int,
    1, at_least=1,
    help="Flag reward collapse only once the rolling mean has stayed below the reward_collapse_drop line for "
            "this many consecutive steps (1 = the first such step flags it).")
_define("grad_norm_collapse_factor", "run", float,
    0.0, help="Flag a gradient-norm collapse when the (pre-clipping) gradient norm exceeds this multiple of the "
              "median of all earlier steps' norms; 0 = off.")
_define("grad_norm_collapse_min_steps", "run", int,
    10, at_least=1, help="Earlier steps needed before the gradient-norm median is trusted.")
_define("vllm_mode", "engine", str,
    "colocate", choices=VLLM_MODES,
    help="vLLM integration: " + _one_of(VLLM_MODES, {"colocate": "in-process", "server": "`trl vllm-serve`"})
         + ".")
_define("vllm_gpu_memory_utilization", "engine", float,
    0.3, help="Fraction of GPU memory vLLM may take (train: in colocate mode).")
_define("vllm_server_base_url", "engine", str | None,
    None, help="URL of the vLLM server in server mode (None: host/port defaults).")
_define("vllm_tensor_parallel_size", "engine", int, 1, at_least=1, help="Tensor parallelism of colocated vLLM.")
_define("vllm_cpu_gemm", "engine", str,
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
_define("heldout_prompts", "task", int,
    0, at_least=0,
    help="Held-out problems on which the policy's reward is measured by the engine before the first step and "
            "after the last (run.json heldout_initial / heldout_final; roundalign.training.heldout); 0 = off. "
            "Task digits or arith; the emulated engine or TRL's colocated vLLM engine.")
_define("heldout_samples", "task", int, 4, at_least=1,
        help="Engine samples per held-out problem (at the run's temperature).")
_define("mismatch_metrics", "run", bool,
    True, help="Log the full mismatch set (costs one extra no-grad forward per step).")

# --------------------------------------------------------------------------------------------------------------------
# roundalign probe and roundalign attribute: the settings they add (the rest they share with train, above).

_define("trainer_attn", "probe", str | None, None, choices=ENGINE_ATTN_IMPLS, none_means="the same as attn",
        help="Backend vllm: the trainer's attention when it rescores the real engine's tokens (None: attn); vllm_cpu "
             "makes the attention kernel equal, leaving only where rounding happens.")
_define("variants", "probe", tuple[str, ...], VARIANTS, item_choices=VARIANTS,
        help=f"Trainer alignment variants to compare, comma-separated ({_one_of(VARIANTS, quote=False)}).")
_define("num_prompts", "probe", int, 8, at_least=1, help="Number of prompts, one completion each.")
_define("max_new_tokens", "sampling", int, 16, at_least=1, help="Completion cap of the engine's samples, in tokens.")
_define("context_tokens", "probe", int, 0, at_least=0,
        help="Random filler tokens put before each prompt, to measure at far positions (RoPE's rounding differences "
             "grow with position).")
_define("device", "probe", str | None, None,
        help="Backend vllm: the torch device on which the trainer rescores (None: cuda for a GPU engine, cpu for "
             "vLLM's CPU build).")
_define("top_p", "sampling", float, 1.0, above=0, at_most=1, help="vLLM's top-p (1.0 = off).")
_define("top_k", "sampling", int, 0, at_least=0, help="vLLM's top-k (0 = off).")
_define("logprobs_mode", "sampling", str, "processed_logprobs", choices=LOGPROBS_MODES,
        help="What vLLM returns for the sampled tokens (processed_logprobs, as TRL asks for, or raw_logprobs).")
_define("micro_batch", "attribute", int, 4, at_least=1,
        help="The trainer's micro-batch for the batching source: sequences scored together, padded (TRL's "
             "per_device_train_batch_size).")
_define("attribute_trainer_attn", "attribute", str, "sdpa", choices=TRAINER_ATTNS,
        help="The trainer's own attention before the attention source is equalized.")
_define("engine_attn", "engine", str, "eager", choices=ENGINE_ATTN_IMPLS,
        help="Backend emulated: the emulated engine's attention (real vLLM runs its own kernel).")
_define("attribute_engine_gemm", "attribute", str | None, None, choices=(*VLLM_GEMMS, *ENGINE_GEMMS),
        none_means="native for backend vllm, same for emulated",
        help="Backend vllm: " + _one_of(VLLM_GEMMS, {"native": "vLLM-CPU's own prepacked GEMM",
                                                      "live": "F.linear on live weights, as training runs it"})
             + f"; backend emulated: {_one_of(ENGINE_GEMMS)}.")
_define("trainer_lm_head_fp32", "attribute", bool, False,
        help="The trainer computes its LM head in fp32 (TRL's cast_lm_head_to_fp32) before the lm_head source is "
             "equalized.")
_define("engine_lm_head_fp32", "attribute", bool, False,
        help="Backend emulated: the emulated engine computes its LM head in fp32 (real vLLM 0.31.0 has no such "
             "option).")
_define("num_resamples", "attribute", int, 1000, at_least=1, help="Bootstrap resamples over prompts.")
_define("sources", "attribute", tuple[str, ...], SOURCES, item_choices=SOURCES,
        help=f"Sources to equalize, comma-separated, in this order: {', '.join(SOURCES)} (those the backend has).")


# --------------------------------------------------------------------------------------------------------------------
# The sweep's probe: and attribution: keys (workflow/schemas/sweep.schema.yaml; roundalign.training.sweep reads them),
# in the schema's order.

_SWEEP_PARTS = ("probe", "attribution")


def _sweep(key: str, feeds: str | None = None, default=dataclasses.MISSING, *, note: str = "", **kw) -> Setting:
    """Sweep key ``key`` (``part.name``). With ``feeds``, the command setting it passes on: that setting's record
    with the sweep's own ``default`` and fields ``kw`` where given, and its help followed by the choices the sweep
    takes where they differ, ``note`` and what ``null`` means (``none_means``); without, a key of the sweep's own
    (``kw`` gives its type and ``note`` its help)."""
    if key.partition(".")[0] not in _SWEEP_PARTS:
        raise ValueError(f"sweep key {key!r}: not in {' or '.join(_SWEEP_PARTS)}")
    if feeds is None:
        return _define(key, "sweep", kw.pop("type"), default, help=note, **kw)
    fed = SETTINGS[feeds]
    type_ = kw.pop("type", fed.type)
    fields = {f.name: getattr(fed, f.name) for f in dataclasses.fields(Setting)
              if f.name not in ("key", "section", "type", "default", "help", "none_means")}
    fields.update(kw, feeds=feeds)
    choices = fields["choices"]() if callable(fields["choices"]) else fields["choices"]
    text = " ".join(filter(None, [
        fed.help,
        f"The sweep takes {_one_of(choices)}." if "choices" in kw and choices and choices != fed.valid() else "",
        note,
        f"null: {kw['none_means']}." if kw.get("none_means") else ""]))
    return _define(key, "sweep", type_, fed.default if default is dataclasses.MISSING else default,
                   **{**fields, "help": text})


_sweep("probe.engines", "engine", (DEFAULT_ENGINE,), type=tuple[str, ...], choices=None, item_choices=engine_names(),
       min_items=1, note="One probe per model and engine.")
_sweep("probe.attn", "attn", choices=("eager", "sdpa"))
_sweep("probe.trainer_attn", "trainer_attn", "same", type=str, choices=("same", *ENGINE_ATTN_IMPLS),
       note="same: probe.attn (the command's None); probe.backend emulated takes only same.")
_sweep("probe.engine_gemm", "engine_gemm")
_sweep("probe.variants", "variants")
_sweep("probe.prompts", "num_prompts")
_sweep("probe.max_new_tokens", "max_new_tokens")
_sweep("probe.context_tokens", "context_tokens")
_sweep("probe.backend", "backend",
       note="A vllm probe of a GPU engine takes one GPU of the model's kind (gpu_model, cpus_per_gpu, mem_mb).")
# 0.45: also roundalign probe's default (cli.PROBE_GPU_MEMORY reads it here), which the probe refuses to change for
# backend emulated
_sweep("probe.gpu_memory_utilization", "vllm_gpu_memory_utilization", 0.45, above=0, below=1,
       note="probe.backend vllm only.")
_sweep("probe.mem_mb", None, 4000, type=int, at_least=100,
       note="Host memory of a probe or attribution job on the CPU (the emulated engine or vLLM's CPU build), in MB.")
_sweep("probe.runtime_min", None, 30, type=int, at_least=1,
       note="Time limit of a probe or attribution job, in minutes (a model's probe_runtime_min overrides it).")
_sweep("attribution.enabled", None, False, type=bool,
       note="Run the attribution jobs and include their outputs (and fig_attribution) in the sweep's all target.")
_sweep("attribution.backend", "backend", None, type=str | None, none_means="probe.backend")
_sweep("attribution.engines", "engine", None, type=tuple[str, ...] | None, choices=None,
       item_choices=engine_names(), min_items=1, none_means="probe.engines",
       note="One attribution job per model and engine (and the rounding the rounding source aligns to).")
_sweep("attribution.prompts", "num_prompts", 16, note="The bootstrap intervals resample them.")
_sweep("attribution.max_new_tokens", "max_new_tokens", None, type=int | None,
       none_means="the model's train max_completion_length")
_sweep("attribution.context_tokens", "context_tokens", None, type=int | None, none_means="probe.context_tokens")
_sweep("attribution.resamples", "num_resamples")
_sweep("attribution.seed", "seed", at_least=0)
_sweep("attribution.extra_args", None, "", type=str,
       note="Further `roundalign attribute` flags, appended as given (e.g. \"--sources sampling,decode,rounding\" or "
            "\"--top-p 0.9\"); they may override the derived settings above.")


def sweep_settings(part: str) -> list[Setting]:
    """The keys of the sweep's ``part:`` (probe or attribution), in the schema's order."""
    if part not in _SWEEP_PARTS:
        raise ValueError(f"no sweep part {part!r}; parts: {', '.join(_SWEEP_PARTS)}")
    return [s for s in SETTINGS.values() if s.section == "sweep" and s.key.partition(".")[0] == part]


# --------------------------------------------------------------------------------------------------------------------
# Reading the tree


def setting(key: str) -> Setting:
    """The record of ``key``, or SettingError naming the close keys."""
    try:
        return SETTINGS[key]
    except KeyError:
        close = difflib.get_close_matches(key, list(SETTINGS), n=3, cutoff=0.6)
        raise SettingError(f"unknown setting {key!r}" + (f"; did you mean {' or '.join(map(repr, close))}?"
                                                         if close else "")) from None


def use(key: str, *, default=dataclasses.MISSING, choices: tuple | None = None, flag: str | None = None):
    """A configuration dataclass's field that is setting ``key``: the tree's default unless ``default`` gives the
    command's own, the tree's choices unless ``choices`` narrows them, and ``flag`` its command-line name where it
    is not the field's name with dashes."""
    s = setting(key)
    d = s.default if default is dataclasses.MISSING else default
    if choices is not None and s.choices is not None and not set(choices) <= set(s.valid()):
        raise ValueError(f"{key}: narrowed choices {choices} are not among the setting's {s.valid()}")
    return dataclasses.field(default=d, metadata={"setting": key, "choices": choices, "flag": flag})


def configclass(cls):
    """``@dataclass(frozen=True)`` that also holds each field declared with ``use`` to its setting's type, so
    that the class and the tree cannot drift apart."""
    cls = dataclass(frozen=True)(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if "setting" in f.metadata and hints[f.name] != SETTINGS[f.metadata["setting"]].type:
            raise TypeError(f"{cls.__name__}.{f.name}: declared {hints[f.name]}, but setting "
                            f"{f.metadata['setting']!r} is {SETTINGS[f.metadata['setting']].type}")
    return cls


def settings_of(cls) -> list[tuple[dataclasses.Field, Setting]]:
    """The fields of a configuration class that are settings, with their records, in the class's order."""
    return [(f, SETTINGS[f.metadata["setting"]]) for f in dataclasses.fields(cls) if "setting" in f.metadata]


def check(cfg) -> None:
    """Every setting field of ``cfg``: a valid choice (or None where optional), its items valid, within its bounds;
    SettingError names the first one that is not, and the valid values."""
    for f, s in settings_of(type(cfg)):
        value, valid = getattr(cfg, f.name), f.metadata.get("choices") or s.valid()
        if value is None and s.optional:
            continue
        if valid is not None and value not in valid:
            raise SettingError(f"{f.name}={value!r} is not valid; choose one of: {', '.join(map(str, valid))}"
                               + (f" (or none: {s.none_means})" if s.none_means else ""))
        if s.item_choices is not None:
            if not value:
                raise SettingError(f"{f.name}: give at least one of: {', '.join(s.item_choices)}")
            for item in value:
                if item not in s.item_choices:
                    raise SettingError(f"{f.name}: {item!r} is not valid; choose from: {', '.join(s.item_choices)}")
        if s.min_items is not None and len(value) < s.min_items:
            raise SettingError(f"{f.name}: give at least {s.min_items} item(s)")
        if s.type in (int, float) and (isinstance(value, bool) or not isinstance(value, (int, float))
                                       or (s.type is int and not isinstance(value, int))):
            raise SettingError(f"{f.name}={value!r} is not a valid {s.type.__name__}")
        if s.at_least is not None and value < s.at_least:
            raise SettingError(f"{f.name}={value} must be >= {s.at_least}")
        if s.above is not None and not value > s.above:
            raise SettingError(f"{f.name}={value} must be > {s.above}")
        if s.at_most is not None and value > s.at_most:
            raise SettingError(f"{f.name}={value} must be <= {s.at_most}")
        if s.below is not None and not value < s.below:
            raise SettingError(f"{f.name}={value} must be < {s.below}")


def refuse_unused(cfg, rules: dict[str, tuple[Callable[[Any], bool], str]]) -> None:
    """No command drops a setting silently: ``rules`` maps a field to (used(cfg), where it applies); a field whose
    value is not its default where ``used`` is false is refused, naming it and where it applies."""
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    for name, (used, where) in rules.items():
        value = getattr(cfg, name)
        if value != defaults[name] and not used(cfg):
            raise SettingError(f"{name}={show_value(value)} is not used with these settings, so it is refused: it "
                               f"applies {where}")


def show_value(value) -> str:
    """A setting's value as YAML spells it: ``null``, ``true``, ``[]``, ``[tensorboard]``, ``0.0001``, ``full``."""
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, str):
        return value
    return yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()


def coerce(key: str, value, type_=None):
    """Convert a YAML, ``--set`` or command-line value to the setting's type, or SettingError naming the key."""
    hint = type_ if type_ is not None else setting(key).type
    args = typing.get_args(hint)
    optional = type(None) in args
    base = next(a for a in args if a is not type(None)) if optional else hint
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null") and optional):
        if optional:
            return None
        raise SettingError(f"{key} may not be null")
    try:
        if typing.get_origin(base) is tuple or base is tuple:
            if isinstance(value, str):
                value = [v.strip() for v in value.split(",") if v.strip()]
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
        raise SettingError(f"{key}={value!r} is not a valid {getattr(base, '__name__', base)}") from None


def add_argument(parser, key: str, *, dest: str | None = None, default=dataclasses.MISSING, flag: str | None = None,
                 valid: tuple | None = None) -> None:
    """One command-line flag for setting ``key``: its help, the given default (else the tree's), its type; ``flag``
    is the name after ``--`` (default: ``dest`` with dashes), ``valid`` the choices this command accepts."""
    s = setting(key)
    dest = dest or key
    default = s.default if default is dataclasses.MISSING else default
    required = default is dataclasses.MISSING
    text = s.help + (f" This command takes {_one_of(valid)}." if valid else "") \
        + ("" if required else f" (default {show_value(default)})")
    opt = "--" + (flag or dest.replace("_", "-"))
    if s.type is bool:
        parser.add_argument(opt, dest=dest, action=argparse.BooleanOptionalAction, default=default,
                            help=text.replace("%", "%%"))
        return
    parser.add_argument(opt, dest=dest, required=required, default=None if required else default,
                        type=lambda v: _cli_value(dest, v, s.type), help=text.replace("%", "%%"))


def add_arguments(parser, cls, *, skip: tuple[str, ...] = ()) -> None:
    """One command-line flag per setting field of ``cls``, named by the field (or its ``flag``), with the field's
    default; values are converted by ``coerce`` and checked when the configuration is built."""
    for f, s in settings_of(cls):
        if f.name not in skip:
            add_argument(parser, s.key, dest=f.name, default=f.default, flag=f.metadata.get("flag"),
                         valid=f.metadata.get("choices"))


def _cli_value(key, value, type_):
    try:
        return coerce(key, value, type_)
    except SettingError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def from_args(cls, args, **extra):
    """A configuration of class ``cls`` from parsed arguments (``add_arguments``), plus ``extra`` fields."""
    return cls(**{f.name: getattr(args, f.name) for f, _ in settings_of(cls) if hasattr(args, f.name)}, **extra)
