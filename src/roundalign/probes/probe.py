"""Offline mismatch probe at identical weights.

The emulated engine samples completions from a bf16 model; each trainer variant then recomputes the
logprobs of exactly those tokens with one full-sequence forward (as TRL does), and we compare:

- ``<out>.csv``: tidy table ``model,engine,variant,level,metric,value`` (metrics of
  ``roundalign.metrics``, token and sequence level);
- ``<out stem>_layers.csv``: ``model,engine,variant,layer,metric,value`` with the RMS relative error
  of the hidden state (residual stream) after each decoder layer, trainer variant vs engine, over the
  positions whose outputs produced the sampled tokens;
- ``<out stem>.json``: the probe's settings and library versions.

Both sides use the same weights, the same tokens and the same sampler arithmetic (fp32
``log_softmax(logits.float() / T)``), so every difference comes from where the two forwards round and
from the kernels (``--attn``, ``--engine-gemm``).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from pathlib import Path

import pandas as pd
import torch

from roundalign import metrics as M
from roundalign.engine import Engine
from roundalign.engine.choices import ENGINE_ATTN_IMPLS
from roundalign.engine.generate import Sample
from roundalign.envinfo import environment_info
from roundalign.io import atomic_write_csv, atomic_write_json, check_writable
from roundalign.models.load import load_model, load_tokenizer, resolve_model_path
from roundalign.numerics import apply_alignment
from roundalign.numerics.dose import apply_dose, check_dose_bits
from roundalign.settings import check, configclass, refuse_unused, use
from roundalign.tasks.arith import make_arith_problems


@configclass
class ProbeConfig:
    """Settings of one probe run: each field is a setting of the settings tree (``roundalign.settings``), which
    holds its help; ``roundalign probe --help`` and docs/settings.md show it. ``attn`` is the attention of the
    emulated engine and the trainer, an engine kernel."""

    model: str = use("model")
    engine: str = use("engine")
    attn: str = use("attn", choices=ENGINE_ATTN_IMPLS)
    engine_gemm: str = use("engine_gemm")
    variants: tuple[str, ...] = use("variants")
    num_prompts: int = use("num_prompts", flag="prompts")
    max_new_tokens: int = use("max_new_tokens")
    seed: int = use("seed")
    temperature: float = use("temperature")
    context_tokens: int = use("context_tokens")
    splitk_chunk: int = use("splitk_chunk")
    norm_reduction: str = use("engine_norm_reduction")
    kv_cache_dtype: str = use("engine_kv_cache_dtype")
    dtype: str = use("dtype")
    trainer_attn: str | None = use("trainer_attn")
    dose_bits: int = use("engine_dose_bits")

    def __post_init__(self):
        check(self)
        check_dose_bits(self.dose_bits, self.engine)
        refuse_unused(self, {"splitk_chunk": (lambda c: c.engine_gemm == "splitk", "with engine_gemm splitk")})


def model_label(path_or_id: str) -> str:
    """Short model name for tables: the directory's name or the hub id's last part."""
    return Path(path_or_id.rstrip("/")).name


def _prompts(tokenizer, cfg: ProbeConfig) -> list[list[int]]:
    """The probe's prompts: ``cfg.num_prompts`` arith problems (seeded), tokenized, each after
    ``cfg.context_tokens`` random ordinary tokens (far RoPE positions)."""
    problems = make_arith_problems(cfg.num_prompts, seed=cfg.seed)
    g = torch.Generator().manual_seed(cfg.seed)
    special = set(tokenizer.all_special_ids)
    ordinary = torch.tensor([i for i in range(len(tokenizer)) if i not in special])
    out = []
    for p in problems:
        ids = tokenizer(p["prompt"], add_special_tokens=False)["input_ids"]
        if cfg.context_tokens:
            filler = ordinary[torch.randint(len(ordinary), (cfg.context_tokens,), generator=g)].tolist()
            ids = filler + ids
        out.append(ids)
    return out


def trainer_logprobs(model, prompt_ids: list[int], completion_ids: list[int], temperature: float,
                     capture_layers: bool = False):
    """One full-sequence forward of prompt+completion; returns (logprobs (C,), entropy (C,), layer states).

    Logprobs and entropy are fp32 ``log_softmax(logits.float() / T)`` of the sampled tokens, in nats.
    Layer states (if asked) are the hidden states after each decoder layer rounded to the model dtype,
    shape (len(prompt)+C-1, hidden) each."""
    layers = model.model.layers
    captured: list[torch.Tensor] = []
    hooks = []
    if capture_layers:
        dtype = model.model.embed_tokens.weight.dtype
        hooks = [layer.register_forward_hook(lambda _m, _i, out: captured.append(
            (out[0] if isinstance(out, tuple) else out).to(dtype))) for layer in layers]
    try:
        ids = torch.tensor(prompt_ids + completion_ids).unsqueeze(0)
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1]
    finally:
        for h in hooks:
            h.remove()
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp = logp_all.gather(-1, torch.tensor(completion_ids).unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    n_pos = len(prompt_ids) + len(completion_ids) - 1
    states = [c[0, :n_pos] for c in captured]
    return logp, entropy, states


def _pad(rows: list[torch.Tensor], fill: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), fill, dtype=rows[0].dtype)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
        mask[i, :len(r)] = True
    return out, mask


def rms_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """sqrt(mean((a-b)^2)) / sqrt(mean(b^2)), in float64."""
    a, b = a.double(), b.double()
    den = b.pow(2).mean().sqrt()
    return float((a - b).pow(2).mean().sqrt() / den) if den > 0 else math.nan


def compare_variants(model, samples, cfg: ProbeConfig, label: str, engine_label: str, log=print,
                     norm_sum_orders=None):
    """Rescore ``samples`` (engine completions with their logprobs) with every trainer variant of ``cfg``; returns
    (rows, layer_rows) of the probe tables. Layer rows need ``Sample.layer_states`` (the emulated engine's);
    samples from real vLLM have none and give none. The trainer runs on the device of ``model``.
    ``norm_sum_orders``: the real compiled CPU engine's RMSNorm reduction orders, given to the variants that align
    the norm (``apply_alignment``)."""
    engine_logp, mask = _pad([s.logprobs for s in samples])
    device = next(model.parameters()).device
    rows, layer_rows = [], []
    for k, variant in enumerate(cfg.variants, 1):
        t1 = time.perf_counter()
        apply_alignment(model, variant, cfg.engine,
                        norm_sum_orders=norm_sum_orders if variant in ("norm", "full") else None)
        apply_dose(model, cfg.dose_bits, variant)
        logps, ents, per_layer = [], [], [[] for _ in model.model.layers]
        for s in samples:
            with torch.device(device):  # trainer_logprobs builds its id tensors without a device
                lp, ent, states = trainer_logprobs(model, s.prompt_ids, s.completion_ids, cfg.temperature,
                                                   capture_layers=s.layer_states is not None)
            logps.append(lp.cpu())
            ents.append(ent.cpu())
            for i, st in enumerate(states):
                per_layer[i].append((st.cpu(), s.layer_states[i]))
        train_logp, _ = _pad(logps)
        entropy, _ = _pad(ents)
        result = M.mismatch_metrics(train_logp, engine_logp, mask, entropy=entropy)
        for level, values in result.items():
            for metric, value in values.items():
                rows.append({"model": label, "engine": engine_label, "variant": variant, "level": level,
                             "metric": metric, "value": float(value)})
        for i, pairs in enumerate(per_layer):
            if not pairs:
                continue
            err = rms_rel_err(torch.cat([a for a, _ in pairs]), torch.cat([b for _, b in pairs]))
            layer_rows.append({"model": label, "engine": engine_label, "variant": variant, "layer": i,
                               "metric": "hidden_rel_err_rms", "value": err})
        tok = result["token"]
        log(f"[probe] {label} {variant:>8} ({k}/{len(cfg.variants)}): k3={float(tok['mismatch_k3']):.3e} "
            f"|dlogp| mean={float(tok['logp_abs_diff_mean']):.3e} max={float(tok['logp_abs_diff_max']):.3e} "
            f"exact={float(tok['tokens_exact_frac']):.3f} "
            + (f"last-layer rel err={layer_rows[-1]['value']:.2e} " if layer_rows else "")
            + f"({time.perf_counter() - t1:.1f}s)")
    apply_alignment(model, "baseline")
    return rows, layer_rows


def emulated_vs_real_layers(engine: Engine, forced: list[Sample], label: str, engine_name: str, attn: str) -> list:
    """How close the emulation is to the real engine, layer by layer: the emulated engine's residual stream after
    each layer in one prefill of the same tokens, against the real engine's (hooks); RMS relative error and the
    fraction of elements bitwise equal."""
    pairs = None
    for s in forced:
        states: list[torch.Tensor] = []
        ids = torch.tensor(s.prompt_ids + s.completion_ids).unsqueeze(0)
        engine.model.forward(ids, engine.model.new_cache(), states)
        if pairs is None:
            pairs = [[] for _ in states]
        for i, st in enumerate(states):
            pairs[i].append((st[0, :len(ids[0]) - 1].cpu(), s.layer_states[i]))
    rows = []
    for i, p in enumerate(pairs or []):
        a, b = torch.cat([x for x, _ in p]), torch.cat([y for _, y in p])
        for metric, value in (("hidden_rel_err_rms", rms_rel_err(a, b)),
                              ("hidden_exact_frac", float((a == b).float().mean()))):
            rows.append({"model": label, "engine": engine_name, "emulated_attn": attn, "layer": i,
                         "metric": metric, "value": value})
    return rows


def run_probe(cfg: ProbeConfig, out_csv: str | Path, log=print):
    """Run the probe and write its three files; returns (table, layer_table) as DataFrames."""
    if cfg.trainer_attn is not None:
        raise ValueError(f"trainer_attn={cfg.trainer_attn!r} is the vllm backend's (the trainer's attention when it "
                         "rescores the real engine's tokens); the emulated probe's trainer and engine both attend with "
                         "--attn")
    resolve_model_path(cfg.model)  # fail fast on a missing model, before loading anything
    out_csv = check_writable(out_csv)
    layers_csv = out_csv.with_name(out_csv.stem + "_layers.csv")
    meta_json = out_csv.with_suffix(".json")
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(cfg.model)
    model = load_model(cfg.model, dtype=cfg.dtype, attn=cfg.attn)  # vllm_cpu: registered and switched to there
    label = model_label(cfg.model)
    engine = Engine(model, engine=cfg.engine, attn=cfg.attn, gemm=cfg.engine_gemm, splitk_chunk=cfg.splitk_chunk,
                    norm_reduction=cfg.norm_reduction, kv_cache_dtype=cfg.kv_cache_dtype, dose_bits=cfg.dose_bits)
    prompts = _prompts(tokenizer, cfg)
    samples = engine.generate(prompts, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                              seed=cfg.seed, eos_token_id=tokenizer.eos_token_id, record_layer_states=True)
    n_tok = sum(len(s.completion_ids) for s in samples)
    log(f"[probe] {label}: engine {cfg.engine} (attn={cfg.attn}, gemm={cfg.engine_gemm}, norm reduction={cfg.norm_reduction}, "
        f"kv cache={cfg.kv_cache_dtype}, dose bits={cfg.dose_bits}) sampled {len(samples)} "
        f"completions, {n_tok} tokens, prompt length {min(map(len, prompts))}-{max(map(len, prompts))} "
        f"({time.perf_counter() - t0:.1f}s)")
    rows, layer_rows = compare_variants(model, samples, cfg, label, cfg.engine, log)
    table, layer_table = pd.DataFrame(rows), pd.DataFrame(layer_rows)
    atomic_write_csv(table, out_csv)
    atomic_write_csv(layer_table, layers_csv)
    meta = {"config": {**asdict(cfg), "variants": list(cfg.variants)},
            "num_completion_tokens": n_tok, "wall_time_s": round(time.perf_counter() - t0, 3),
            "outputs": [str(out_csv), str(layers_csv)], "env": environment_info()}
    atomic_write_json(meta_json, meta)
    log(f"[probe] wrote {out_csv}, {layers_csv}, {meta_json}")
    return table, layer_table
