"""Where the mismatch comes from: the engine's logprobs of its own samples against the trainer's, at identical
weights, with the sources of the difference equalized one by one (``roundalign attribute``).

    roundalign attribute --model work/models/cpu-qwen3 --engine vllm-cpu-eager --backend vllm --out DIR
    roundalign attribute --model work/models/tiny-qwen3 --engine vllm-compiled --backend emulated \\
        --engine-gemm splitk --kv-cache-dtype fp8_e4m3 --out DIR

The engine samples one completion per prompt and reports each sampled token's logprob, as an RL rollout does.
The trainer then scores the same tokens. Every difference between the two numbers comes from one of these
sources, each equalized by making one side compute what the other does:

==========  ===========================================================  ==========================================
source      not equalized (what an RL stack does by default)             equalized
==========  ===========================================================  ==========================================
sampling    the trainer recomputes as TRL 1.16 does: its fused LM head    the trainer computes what the engine
            (``trl.trainer.utils.add_fused_lm_head``), log-softmax of     returned: vLLM's sampler, in its
            logits / T over the whole vocabulary                          ``logprobs_mode`` (temperature, top-k/top-p
                                                                          mask, fp32 log-softmax; vLLM's own
                                                                          ``apply_top_k_top_p``)
decode      the engine's logprobs of its sampled tokens, from KV-cache    the engine's logprobs of the same tokens in
            decoding                                                     one prefill of prompt + completion
positions   in TRL's padded layout (below), positions count from the      each sequence's first real token at
            first column, so a left-padded prompt's tokens sit at shifted  position 0, as the engine runs it
            RoPE positions (transformers 5.17 without ``position_ids``)    (``position_ids`` from the attention mask,
                                                                          as roundalign's trainer passes them)
batching    the trainer scores micro-batches of ``micro_batch``           one sequence per forward, no padding
            sequences, prompts left-padded and completions right-padded
            to the longest (TRL's layout)
lm_head     the trainer's LM head in its own precision (fp32 with TRL's   the trainer's LM head in the engine's
            ``cast_lm_head_to_fp32``, ``--trainer-lm-head-fp32``)         precision (bf16 for real vLLM; the emulated
                                                                          engine can run fp32, ``--engine-lm-head-fp32``)
kv_cache    the engine stores K/V in fp8                                  the trainer rounds its K/V through the same
                                                                          fp8 (emulated)
gemm        the trainer's ``F.linear``                                    the engine's GEMM: vLLM-CPU's own dispatch
                                                                          (oneDNN/SGL, prepacked) or the emulated
                                                                          split-K
attention   the trainer's attention (``--trainer-attn``, sdpa)            the engine's attention kernel
rounding    stock transformers numerics (variant ``baseline``)            variant ``full``
==========  ===========================================================  ==========================================

The cumulative waterfall equalizes them in that order (SOURCES): first how the two logprobs are computed and
compared (sampling, decode, positions, batching), then the engine-only settings (lm_head, kv_cache), then the kernels (gemm,
attention), and last the roundings this project aligns, so that its last steps show what the alignment and the
engine's attention remove. Each source is also equalized alone, against none. A source the backend or the settings
do not have (a GEMM that already is ``F.linear``, an engine that stores K/V as computed, an fp32 head real vLLM
0.31.0 has no option for, vLLM's prefill logprobs away from T = 1 without top-k/top-p) is reported as absent, with
the reason, and skipped.

Outputs in ``--out``:

- ``attribution.csv``, long form ``step,source,mode,metric,value,ci_low,ci_high``: step 0 is ``none``; ``mode``
  is ``cumulative`` or ``alone``; metrics ``k3`` (mean per-token KL estimator, nats), ``abs_dlogp`` (mean
  |logp_train - logp_engine|, nats), ``exact_frac`` (tokens whose two logprobs are equal bit for bit),
  ``seq_log_ratio`` (mean over sequences of sum(logp_train - logp_engine)), ``is_ratio_mean`` and ``is_ratio_max``
  (the sequence-level importance ratio exp(seq log ratio)), and ``k3_removed`` (the k3 a step removes: the
  previous step's minus its own in cumulative mode, none's minus its own alone). Intervals: 95% percentile
  bootstrap over prompts, the same resamples for every step, so ``k3_removed`` is a paired difference.
- ``attribution.json``: the settings, the engine's settings as the probe records them, which sources were
  present and why the others were not, versions.
- ``waterfall.png``: the cumulative k3 by step and each source's share, with intervals.
"""

from __future__ import annotations

import importlib
import time
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd
import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from roundalign.bridge import vllm_cpu, vllm_cpu_attention
from roundalign.bridge.vllm_internals import cpu_gemm_utils
from roundalign.engine import Engine
from roundalign.engine.choices import ENGINE_ATTN_IMPLS, ENGINE_GEMMS
from roundalign.engine.compiled import splitk_linear
from roundalign.engine.model import check_choice, fp8_kv_roundtrip
from roundalign.envinfo import environment_info
from roundalign.models.load import load_model, load_tokenizer, resolve_model_path
from roundalign.numerics import apply_alignment
from roundalign.numerics.engines import DEFAULT_CPU_ENGINE, is_cpu, spec
from roundalign.probes import real_engine
from roundalign.probes.probe import ProbeConfig, _prompts
from roundalign.probes.attribution_stats import attribution_rows, per_sequence, resample_metrics, steps_of
from roundalign.settings import (BACKENDS, LOGPROBS_MODES, SOURCES, TRAINER_ATTNS, VLLM_GEMMS,  # noqa: F401
                                 check, configclass, refuse_unused, use)
from roundalign.io import atomic_write_csv, atomic_write_json, check_writable



@configclass
class AttributeConfig:
    """Settings of one attribution: each field is a setting of the settings tree (``roundalign.settings``), which
    holds its help; ``roundalign attribute --help`` and docs/settings.md show it."""

    model: str = use("model")
    engine: str = use("engine", default=DEFAULT_CPU_ENGINE)
    backend: str = use("backend", default="vllm")
    num_prompts: int = use("num_prompts", default=16, flag="prompts")
    max_new_tokens: int = use("max_new_tokens", default=24)
    seed: int = use("seed")
    temperature: float = use("temperature")
    top_p: float = use("top_p")
    top_k: int = use("top_k")
    logprobs_mode: str = use("logprobs_mode")
    micro_batch: int = use("micro_batch")
    context_tokens: int = use("context_tokens")
    trainer_attn: str = use("attribute_trainer_attn")
    engine_attn: str = use("engine_attn")
    engine_attn_decode: str | None = use("engine_attn_decode", choices=ENGINE_ATTN_IMPLS)
    engine_gemm: str | None = use("attribute_engine_gemm")
    splitk_chunk: int = use("splitk_chunk")
    kv_cache_dtype: str = use("engine_kv_cache_dtype")
    trainer_lm_head_fp32: bool = use("trainer_lm_head_fp32")
    engine_lm_head_fp32: bool = use("engine_lm_head_fp32")
    dtype: str = use("dtype")
    num_resamples: int = use("num_resamples", flag="resamples")
    sources: tuple[str, ...] = use("sources")
    # Negative controls (tests): sources whose step is still taken and labelled, but whose equalization is skipped
    undo: tuple[str, ...] = ()

    def __post_init__(self):
        check(self)
        refuse_unused(self, _ATTRIBUTE_USED_ONLY)
        for s in self.undo:
            check_choice("source", s, SOURCES)
        if self.backend == "vllm":
            check_choice("engine GEMM (backend vllm)", self.gemm, VLLM_GEMMS)
            if not is_cpu(self.engine) and self.gemm == "live":
                raise ValueError("--engine-gemm live is the CPU build's F.linear dispatch; a GPU engine runs its own")
        else:
            check_choice("engine GEMM (backend emulated)", self.gemm, ENGINE_GEMMS)

    @property
    def gemm(self) -> str:
        return self.engine_gemm or ("native" if self.backend == "vllm" else "same")

    @property
    def sampling_is_plain(self) -> bool:
        """Temperature 1, no top-k/top-p: the sampler's processed logprobs are the raw log-softmax."""
        return self.temperature == 1.0 and self.top_p == 1.0 and self.top_k == 0


_VLLM = (lambda c: c.backend == "vllm", "with backend vllm (vLLM's sampler)")
_EMULATED = (lambda c: c.backend == "emulated",
             "with backend emulated (the emulated engine; real vLLM runs its own kernels, LM head and KV cache)")
# settings that act only with others: a value other than the default where they do not act is refused
_ATTRIBUTE_USED_ONLY = {
    "top_p": _VLLM, "top_k": _VLLM, "logprobs_mode": _VLLM,
    "engine_attn": _EMULATED, "engine_attn_decode": _EMULATED, "engine_lm_head_fp32": _EMULATED,
    "kv_cache_dtype": _EMULATED,
    "splitk_chunk": (lambda c: c.backend == "emulated" and c.gemm == "splitk",
                     "with backend emulated and engine_gemm splitk"),
}


# ---------------------------------------------------------------------------------------------------------------
# The engine's side


@dataclass
class EngineData:
    """What the engine gives: its samples, their logprobs from decoding, the same tokens' logprobs from one
    prefill (None where the backend cannot give them), and the engine's settings."""

    prompts: list[list[int]]
    completions: list[list[int]]
    decode_logp: list[torch.Tensor]
    prefill_logp: list[torch.Tensor] | None
    settings: dict
    norm_sum_orders: list | None = None


def emulated_engine_side(model, prompts, cfg: AttributeConfig, eos_token_id, log=print) -> EngineData:
    """The emulated engine samples; the same tokens are then scored in one prefill."""
    engine = Engine(model, engine=cfg.engine, attn=cfg.engine_attn, gemm=cfg.gemm, splitk_chunk=cfg.splitk_chunk,
                    kv_cache_dtype=cfg.kv_cache_dtype, lm_head_fp32=cfg.engine_lm_head_fp32,
                    attn_decode=cfg.engine_attn_decode)
    samples = engine.generate(prompts, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                              seed=cfg.seed, eos_token_id=eos_token_id)
    completions = [s.completion_ids for s in samples]
    prefill = engine.score(prompts, completions, temperature=cfg.temperature, decode=False)
    settings = {"backend": "emulated", "engine": cfg.engine, "attn": cfg.engine_attn,
                "attn_decode": cfg.engine_attn_decode or cfg.engine_attn, "gemm": cfg.gemm,
                "kv_cache_dtype": cfg.kv_cache_dtype, "lm_head_fp32": cfg.engine_lm_head_fp32}
    log(f"[attribute] emulated {cfg.engine} engine: {len(samples)} samples, "
        f"{sum(map(len, completions))} completion tokens")
    return EngineData(prompts, completions, [s.logprobs for s in samples], prefill, settings, None)


def vllm_engine_side(prompts, cfg: AttributeConfig, log=print) -> EngineData:
    """Real vLLM (the CPU build here, CUDA vLLM on a GPU) samples with the given sampling settings and returns
    its logprobs in ``logprobs_mode``; then scores the same tokens in one prefill each (``prompt_logprobs``: the
    raw log-softmax, which is the processed one at T = 1 without top-k/top-p, and only there comparable)."""
    record = spec(cfg.engine)
    if record.cpu:
        vllm_cpu.small_kv_cache()
        (vllm_cpu.install_live_gemm_dispatch if cfg.gemm == "live" else vllm_cpu.uninstall_live_gemm_dispatch)()
    try:
        samples, forced, settings = real_engine.sample(
            cfg.model, record, prompts, dtype=cfg.dtype, seed=cfg.seed, temperature=cfg.temperature,
            max_new_tokens=cfg.max_new_tokens, top_p=cfg.top_p, top_k=cfg.top_k, logprobs_mode=cfg.logprobs_mode,
            teacher_force=cfg.sampling_is_plain, log=log)
    finally:
        if record.cpu and cfg.gemm == "live":
            vllm_cpu.uninstall_live_gemm_dispatch()
    engine_read = {k: settings.pop(k) for k in ("kernels", "norm_sum_orders") if k in settings}
    settings = {"backend": "vllm", **settings, "gemm": cfg.gemm, "logprobs_mode": cfg.logprobs_mode, **engine_read}
    prefill = None if forced is None else [s.logprobs for s in forced]
    orders = settings.get("norm_sum_orders")
    log(f"[attribute] vLLM {cfg.engine}: {len(samples)} samples, {sum(len(s.completion_ids) for s in samples)} "
        f"completion tokens ({settings.get('kernels', {}).get('gemm', cfg.gemm)})")
    return EngineData(prompts, [s.completion_ids for s in samples], [s.logprobs for s in samples], prefill,
                      settings, orders)


def present_sources(cfg: AttributeConfig, data: EngineData) -> dict[str, str | None]:
    """Each source: None when it is present here (it can be equalized), else why not."""
    vllm = cfg.backend == "vllm"
    engine_attn = "vllm_cpu" if vllm else cfg.engine_attn
    why = {
        "sampling": None,
        "decode": None if data.prefill_logp is not None else
        "vLLM's prefill logprobs are the raw log-softmax: comparable with the sampled tokens' only at temperature 1 "
        "without top-k/top-p",
        "positions": None,
        "batching": None,
        "lm_head": None if cfg.trainer_lm_head_fp32 != cfg.engine_lm_head_fp32 else
        f"the trainer's LM head already runs in the engine's precision ({'fp32' if cfg.engine_lm_head_fp32 else cfg.dtype})",
        "kv_cache": "backend vllm: the engine's KV cache is not varied here" if vllm else
        None if cfg.kv_cache_dtype != "auto" else "the engine stores K/V as computed (kv_cache_dtype auto)",
        "gemm": ("the engine runs F.linear on live weights (--engine-gemm live), as the trainer does"
                 if cfg.gemm == "live" else None) if vllm else
        None if cfg.gemm == "splitk" else "the emulated engine runs the trainer's GEMMs (--engine-gemm same)",
        "attention": None if engine_attn != cfg.trainer_attn else
        f"the trainer already runs the engine's attention ({engine_attn})",
        "rounding": None,
    }
    if vllm:
        if not is_cpu(cfg.engine):
            if why["attention"] is None:
                why["attention"] = ("the trainer's copy of vLLM's CUDA attention (attn: vllm_flash) is not wired into "
                                    "attribution yet")
            if why["gemm"] is None:
                why["gemm"] = "vLLM's CUDA GEMMs cannot be called from the trainer here"
    return {s: (why[s] if s in cfg.sources else "not asked for (--sources)") for s in SOURCES}


# ---------------------------------------------------------------------------------------------------------------
# The trainer's side


def _engine_sampler_logprobs(logits: torch.Tensor, tokens: torch.Tensor, cfg: AttributeConfig) -> torch.Tensor:
    """What the engine returned for ``tokens`` given these logits: vLLM's sampler (vllm/v1/sample/sampler.py
    ``Sampler.forward``/``sample``, ops/topk_topp_sampler.py ``forward_cpu``; CUDA's ``forward_native`` for processed
    logprobs computes the same formula): fp32 logits, divided by T, top-k/top-p
    masked by vLLM's own ``apply_top_k_top_p``, fp32 log-softmax; ``raw_logprobs``: the log-softmax of the logits.
    The emulated engine's sampler is the temperature-only case (engine/generate.py)."""
    x = logits.float()
    if cfg.logprobs_mode == "raw_logprobs":
        lp = x.log_softmax(dim=-1, dtype=torch.float32)
    else:
        # a true division by an fp32 tensor, as vLLM's apply_temperature (sampler.py:238); CUDA divides by a Python
        # float as x * (1/T), one ulp off on part of the logits unless T is a power of two
        x = x / torch.full((x.shape[0], 1), cfg.temperature, dtype=torch.float32, device=x.device)
        if 0 < cfg.top_k < x.shape[-1] or cfg.top_p < 1.0:
            from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p  # noqa: PLC0415 -- optional: vllm

            n = x.shape[0]
            # top_k at or above the vocabulary is off in vLLM (gpu_input_batch.py:409-414)
            k = torch.full((n,), cfg.top_k, dtype=torch.int64, device=x.device) if 0 < cfg.top_k < x.shape[-1] else None
            p = torch.full((n,), cfg.top_p, dtype=torch.float32, device=x.device) if cfg.top_p < 1.0 else None
            x = apply_top_k_top_p(x, k, p)
        lp = x.log_softmax(dim=-1, dtype=torch.float32)
    return lp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


@contextmanager
def _patched_linears(model, make_forward):
    """Every nn.Linear of ``model`` runs ``make_forward(module)`` instead of its own forward, for the block."""
    mods = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    for m in mods:
        m.forward = make_forward(m)
    try:
        yield
    finally:
        for m in mods:
            del m.forward


def _vllm_cpu_gemm(module):
    """vLLM-CPU's own GEMM for this layer's weight: its ``dispatch_cpu_unquantized_gemm`` (oneDNN, SGL or
    F.linear, as it chooses for the shape) applied to a copy, called as vLLM's linear layers call it."""
    U = cpu_gemm_utils()
    dispatch = getattr(U.dispatch_cpu_unquantized_gemm, "__wrapped__", U.dispatch_cpu_unquantized_gemm)
    shim = torch.nn.Module()
    shim.weight = torch.nn.Parameter(module.weight.detach().clone(), requires_grad=False)
    shim.bias = None if module.bias is None else torch.nn.Parameter(module.bias.detach().clone(), requires_grad=False)
    dispatch(shim, remove_weight=False)
    return lambda x: shim.cpu_linear(x, shim.weight, shim.bias)


def _splitk_gemm(chunk):
    return lambda module: (lambda x: splitk_linear(x, module.weight, module.bias, chunk))


_FP8_ATTN = {}


def _fp8_kv_attention(inner: str, kv_cache_dtype: str) -> str:
    """A transformers attention function that rounds K and V through the engine's fp8 KV cache
    (``engine.model.fp8_kv_roundtrip``) and then runs ``inner``; returns its registered name."""
    name = f"roundalign_fp8kv_{kv_cache_dtype}_{inner}"
    if name not in _FP8_ATTN:
        def base(module):
            if inner != "eager":
                return AttentionInterface._global_mapping[inner]
            mt = module.config.model_type  # eager attention is each model file's own function
            return importlib.import_module(f"transformers.models.{mt}.modeling_{mt}").eager_attention_forward

        def attention(module, query, key, value, *args, **kwargs):
            return base(module)(module, query, fp8_kv_roundtrip(key, kv_cache_dtype),
                                fp8_kv_roundtrip(value, kv_cache_dtype), *args, **kwargs)

        AttentionInterface.register(name, attention)
        # the inner attention's mask format (eager: additive float; sdpa and vllm_cpu: boolean)
        AttentionMaskInterface.register(name, AttentionMaskInterface._global_mapping[inner])
        _FP8_ATTN[name] = attention
    return name


def _attn_name(impl: str) -> str:
    if impl == "vllm_cpu":
        vllm_cpu_attention.register()
    return impl


@contextmanager
def trainer_state(model, state: frozenset, cfg: AttributeConfig, data: EngineData):
    """Configure the trainer model for a set of equalized sources (rounding, attention, kv_cache, gemm); the
    sampling, batching and lm_head sources act in ``trainer_logprobs``."""
    engine_attn = "vllm_cpu" if cfg.backend == "vllm" else cfg.engine_attn
    attn = engine_attn if "attention" in state else cfg.trainer_attn
    if "kv_cache" in state:
        attn = _fp8_kv_attention(attn if attn in ("eager", "sdpa") else _attn_name(attn), cfg.kv_cache_dtype)
    model.set_attn_implementation(_attn_name(attn))
    variant = "full" if "rounding" in state else "baseline"
    apply_alignment(model, variant, cfg.engine, norm_sum_orders=data.norm_sum_orders if variant == "full" else None)
    with ExitStack() as stack:
        if "gemm" in state:
            make = _vllm_cpu_gemm if cfg.backend == "vllm" else _splitk_gemm(cfg.splitk_chunk)
            stack.enter_context(_patched_linears(model, make))
        try:
            yield model
        finally:
            apply_alignment(model, "baseline")


def _layout(data: EngineData, pad_id: int, micro_batch: int | None):
    """Chunks of (rows, input_ids, attention_mask, prompt width): one unpadded sequence each (micro_batch None),
    or TRL's layout: every prompt left-padded to the longest prompt, every completion right-padded to the longest
    completion, scored ``micro_batch`` rows at a time (grpo_trainer.py ``_get_per_token_logps_and_entropies``)."""
    n = len(data.prompts)
    if micro_batch is None:
        for i in range(n):
            ids = torch.tensor([data.prompts[i] + data.completions[i]])
            yield [i], ids, torch.ones_like(ids), len(data.prompts[i])
        return
    P = max(map(len, data.prompts))
    C = max(map(len, data.completions))
    ids = torch.full((n, P + C), pad_id, dtype=torch.long)
    mask = torch.zeros((n, P + C), dtype=torch.long)
    for i, (p, c) in enumerate(zip(data.prompts, data.completions, strict=True)):
        ids[i, P - len(p):P] = torch.tensor(p)
        ids[i, P:P + len(c)] = torch.tensor(c)
        mask[i, P - len(p):P + len(c)] = 1
    for start in range(0, n, micro_batch):
        rows = list(range(start, min(start + micro_batch, n)))
        yield rows, ids[rows], mask[rows], P


@torch.no_grad()
def trainer_logprobs(model, data: EngineData, state: frozenset, cfg: AttributeConfig, pad_id: int):
    """The trainer's logprob of every completion token, per sequence, under the equalized ``state``."""
    from roundalign.training.trl_bridge import trl_recompute_logprobs  # noqa: PLC0415 -- lazy: trl, for TRL's layout only

    out: list[torch.Tensor | None] = [None] * len(data.prompts)
    fp32_head = cfg.engine_lm_head_fp32 if "lm_head" in state else cfg.trainer_lm_head_fp32
    device = next(model.parameters()).device
    for rows, ids, mask, P in _layout(data, pad_id, None if "batching" in state else cfg.micro_batch):
        ids, mask, C = ids.to(device), mask.to(device), ids.shape[1] - P
        extra = {}
        if "positions" in state:  # each sequence's first real token at 0 (unpadded: the default positions)
            extra["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
        if "sampling" not in state:  # what TRL 1.16 recomputes: its fused LM head over the completion positions
            logp = trl_recompute_logprobs(model, ids, mask, C, cfg.temperature, cast_lm_head_to_fp32=fp32_head,
                                          **extra)
        else:
            hidden = model.model(input_ids=ids, attention_mask=mask, **extra).last_hidden_state[:, P - 1:-1]
            w = model.get_output_embeddings().weight
            logits = torch.nn.functional.linear(hidden.float(), w.float()) if fp32_head else model.lm_head(hidden)
            logp = _engine_sampler_logprobs(logits.reshape(-1, logits.shape[-1]), ids[:, P:].reshape(-1),
                                            cfg).view(len(rows), C)
        for j, i in enumerate(rows):
            out[i] = logp[j, :len(data.completions[i])].float().cpu()
    return out


def reference_logprobs(data: EngineData, state: frozenset) -> list[torch.Tensor]:
    """The engine's numbers the trainer is compared with under ``state``."""
    return data.prefill_logp if "decode" in state else data.decode_logp


# ---------------------------------------------------------------------------------------------------------------
# The command


def run_attribute(cfg: AttributeConfig, out_dir: str | Path, log=print, device: str | None = None) -> list[dict]:
    """Measure, write ``attribution.csv`` and ``attribution.json`` into ``out_dir``; returns the rows (the CLI
    draws ``waterfall.png`` from them: analysis sits above probes)."""
    out = Path(out_dir)
    check_writable(out / "attribution.csv")

    device = device or ("cuda" if cfg.backend == "vllm" and not is_cpu(cfg.engine) else "cpu")
    if cfg.backend == "vllm":  # the real engine can run here (vLLM's CPU build, or CUDA vLLM and a GPU)
        device = real_engine.preflight(spec(cfg.engine), device, log=log)
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(cfg.model)
    prompts = _prompts(tokenizer, ProbeConfig(model=cfg.model, num_prompts=cfg.num_prompts, seed=cfg.seed,
                                              context_tokens=cfg.context_tokens))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if cfg.backend == "vllm":
        data = vllm_engine_side(prompts, cfg, log=log)
        model = load_model(cfg.model, dtype=cfg.dtype, attn="eager").to(device)
    else:
        model = load_model(cfg.model, dtype=cfg.dtype, attn="eager")
        data = emulated_engine_side(model, prompts, cfg, tokenizer.eos_token_id, log=log)
    present = present_sources(cfg, data)
    for s, why in present.items():
        if why is not None:
            log(f"[attribute] {s}: absent ({why})")
    steps = steps_of(present)
    scored = {}
    for step, source, mode, state in steps:
        if state in scored:
            continue
        t1 = time.perf_counter()
        done = state - frozenset(cfg.undo)  # a negative control claims a step it does not take
        with trainer_state(model, done, cfg, data):
            train = trainer_logprobs(model, data, done, cfg, pad_id)
        scored[state] = per_sequence(train, reference_logprobs(data, done))
        m = resample_metrics(scored[state], torch.arange(len(train)))
        log(f"[attribute] step {step} {mode:>10} {source:>9}: k3={m['k3']:.3e} |dlogp|={m['abs_dlogp']:.3e} "
            f"exact={m['exact_frac']:.3f} IS mean={m['is_ratio_mean']:.4f} ({time.perf_counter() - t1:.1f}s)")
    rows = attribution_rows(scored, steps, cfg.num_resamples, cfg.seed)
    atomic_write_csv(pd.DataFrame(rows, columns=["step", "source", "mode", "metric", "value", "ci_low", "ci_high"]),
                     out / "attribution.csv")
    atomic_write_json(out / "attribution.json", {
        "config": asdict(cfg), "model_path": str(resolve_model_path(cfg.model)), "engine_settings": data.settings,
        "sources": {s: {"present": why is None, "why_absent": why} for s, why in present.items()},
        "undone": list(cfg.undo),
        "order": list(SOURCES), "num_sequences": len(data.prompts),
        "num_tokens": sum(map(len, data.completions)), "wall_time_s": round(time.perf_counter() - t0, 1),
        **environment_info()})
    log(f"[attribute] wrote {out}/attribution.csv, attribution.json ({time.perf_counter() - t0:.0f}s)")
    return rows
