"""Paper-scale probe on a GPU: real vLLM samples in one engine mode, the trainer rescores on the GPU.

    roundalign probe --backend vllm --model work/models/hub/qwen25-math-7b/policy --engine vllm-compiled ...

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

vLLM calls checked against the vllm 0.31.0 wheel: ``LLM.__init__`` (vllm/entrypoints/llm.py: ``model``, ``dtype``,
``seed``, ``gpu_memory_utilization``, ``enforce_eager``, ``tensor_parallel_size``; ``max_model_len`` and
``logprobs_mode`` reach EngineArgs through ``**kwargs``, vllm/engine/arg_utils.py), ``LLM.generate(prompts,
sampling_params=[...], use_tqdm=False)`` with ``{"prompt_token_ids": ids}`` prompts (as TRL passes them),
``SamplingParams(temperature, top_p, top_k, min_p, seed, max_tokens, logprobs)`` (vllm/sampling_params.py;
top_k=0 disables top-k), and ``CompletionOutput.logprobs[i][token_id].logprob`` (vllm/logprobs.py: a list of
dicts or ``FlatLogprobs``, both indexed by position, the sampled token always included).
"""

from __future__ import annotations

import gc
import time
from dataclasses import asdict
from pathlib import Path

import torch

from .engine import Engine
from .engine.generate import Sample
from .envinfo import environment_info
from .io import atomic_write_csv, atomic_write_json, check_writable
from .probe import ProbeConfig, _prompts, compare_variants, model_label

VLLM_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def vllm_sample(cfg: ProbeConfig, prompts: list[list[int]], *, gpu_memory_utilization: float = 0.45,
                log=print) -> tuple[list[Sample], dict]:
    """Sample one completion per prompt with real vLLM in ``cfg.engine`` mode; returns (samples, engine settings).
    Samples carry vLLM's processed logprobs of the sampled tokens (fp32 log-softmax of logits / T)."""
    import vllm

    from .vllm_guard import check_engine_map

    max_len = max(map(len, prompts)) + cfg.max_new_tokens + 8
    llm = vllm.LLM(model=cfg.model, dtype=VLLM_DTYPES[cfg.dtype], seed=cfg.seed, tensor_parallel_size=1,
                   gpu_memory_utilization=gpu_memory_utilization, enforce_eager=cfg.engine == "vllm-eager",
                   max_model_len=max_len, logprobs_mode="processed_logprobs")
    try:
        settings = check_engine_map(llm, cfg.engine, log=log)
        params = [vllm.SamplingParams(temperature=cfg.temperature, top_p=1.0, top_k=0, min_p=0.0,
                                      seed=cfg.seed * 1_000_003 + i, max_tokens=cfg.max_new_tokens, logprobs=0)
                  for i in range(len(prompts))]
        outputs = llm.generate([{"prompt_token_ids": list(ids)} for ids in prompts], sampling_params=params,
                               use_tqdm=False)
    finally:
        shutdown_llm(llm)
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    samples = []
    for ids, out in zip(prompts, outputs, strict=True):
        comp = out.outputs[0]
        tokens = list(comp.token_ids)
        if comp.logprobs is None or len(comp.logprobs) < len(tokens):
            raise RuntimeError("vLLM returned no logprob for some sampled token (SamplingParams(logprobs=0) asks "
                               "for the sampled token's); check the vLLM version (0.31.0 expected)")
        logps = torch.tensor([comp.logprobs[i][t].logprob for i, t in enumerate(tokens)], dtype=torch.float32)
        samples.append(Sample(list(ids), tokens, logps, None))
    return samples, settings


def shutdown_llm(llm) -> None:
    """Free the engine's GPU memory before the trainer loads: vLLM 0.31's V1 engine core may run in a child
    process (vllm/v1/engine/core_client.py, ``EngineCoreClient.shutdown``), reached as
    ``llm.llm_engine.engine_core`` (vllm/v1/engine/llm_engine.py:111)."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


def run_probe_gpu(cfg: ProbeConfig, out_csv: str | Path, *, device: str = "cuda",
                  gpu_memory_utilization: float = 0.45, log=print):
    """The GPU probe (module docstring); returns (table vs vLLM, layer table, table vs emulated engine)."""
    import importlib.util

    import pandas as pd

    from .models import load_model, load_tokenizer, resolve_model_path

    resolve_model_path(cfg.model)
    if cfg.kv_cache_dtype != "auto":
        raise ValueError(f"kv_cache_dtype={cfg.kv_cache_dtype!r}: an emulated-engine option (--backend emulated); "
                         "the vllm backend probes with vLLM's default KV cache (auto)")
    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError("probe --backend vllm needs vLLM (the GPU environment, environment.yml); "
                           "on CPU use --backend emulated")
    if device.startswith("cuda"):
        from .gpuinfo import cuda_report, format_report

        rep = cuda_report()
        log(f"[probe] {format_report(rep)}")
        if rep["problem"]:
            raise RuntimeError(f"probe --backend vllm needs a usable CUDA GPU: {rep['problem']}")
    if not 0 < gpu_memory_utilization < 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1), got {gpu_memory_utilization}")
    out_csv = check_writable(out_csv)
    layers_csv = out_csv.with_name(out_csv.stem + "_layers.csv")
    emulated_csv = out_csv.with_name(out_csv.stem + "_emulated.csv")
    meta_json = out_csv.with_suffix(".json")
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(cfg.model)
    label = model_label(cfg.model)
    prompts = _prompts(tokenizer, cfg)
    real, settings = vllm_sample(cfg, prompts, gpu_memory_utilization=gpu_memory_utilization, log=log)
    n_real = sum(len(s.completion_ids) for s in real)
    log(f"[probe] {label}: vLLM {cfg.engine} sampled {len(real)} completions, {n_real} tokens "
        f"({time.perf_counter() - t0:.1f}s)")
    model = load_model(cfg.model, dtype=cfg.dtype, attn=cfg.attn).to(device)
    engine = Engine(model, engine=cfg.engine, attn=cfg.attn, gemm=cfg.engine_gemm, splitk_chunk=cfg.splitk_chunk)
    emulated = engine.generate(prompts, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                               seed=cfg.seed, eos_token_id=tokenizer.eos_token_id, record_layer_states=True)
    del engine
    log(f"[probe] trainer vs real vLLM ({cfg.engine}):")
    rows, _ = compare_variants(model, real, cfg, label, cfg.engine, log)
    log(f"[probe] trainer vs the emulated engine on {device}:")
    emu_rows, layer_rows = compare_variants(model, emulated, cfg, label, cfg.engine, log)
    table, layer_table, emu_table = pd.DataFrame(rows), pd.DataFrame(layer_rows), pd.DataFrame(emu_rows)
    atomic_write_csv(table, out_csv)
    atomic_write_csv(layer_table, layers_csv)
    atomic_write_csv(emu_table, emulated_csv)
    meta = {"config": {**asdict(cfg), "variants": list(cfg.variants)}, "backend": "vllm", "device": device,
            "gpu_memory_utilization": gpu_memory_utilization, "vllm_engine": settings,
            "num_completion_tokens": n_real,
            "num_completion_tokens_emulated": sum(len(s.completion_ids) for s in emulated),
            "wall_time_s": round(time.perf_counter() - t0, 3),
            "outputs": [str(out_csv), str(layers_csv), str(emulated_csv)], "env": environment_info()}
    atomic_write_json(meta_json, meta)
    log(f"[probe] wrote {out_csv}, {layers_csv}, {emulated_csv}, {meta_json}")
    return table, layer_table, emu_table
