"""The engine side of building a trainer: what must happen before TRL builds its vLLM engine, and the checks
and records once it exists. ``train._build_trainer`` calls ``before_trainer`` and ``after_trainer``; the emulated
engine needs neither (it is built and bridged in train.py).
"""

from __future__ import annotations

import contextlib

from roundalign.bridge import vllm_cpu
from roundalign.bridge.vllm_cpu import LIVE_GEMM, STOCK_FALLBACK_GEMM, engine_kernels, repack_gemms
from roundalign.bridge.vllm_cpu import engine_norm_sum_orders as read_orders
from roundalign.bridge.vllm_guard import guard_trainer
from roundalign.bridge.vllm_internals import colocated_llm, inprocess_model
from roundalign.models.load import vllm_dtype
from roundalign.numerics import apply_alignment
from roundalign.numerics.engines import spec


def before_trainer(cfg, log=print):
    """Prepare a real vLLM engine before TRL builds it; returns the context to build the trainer in.

    vLLM-CPU prepacks its GEMM weights and drops the parameters TRL's weight sync writes, so its linears run
    F.linear on the live parameters instead (installed before the LLM exists; tests/vllm_cpu), unless
    ``vllm_cpu_gemm`` is "stock" (vLLM's own dispatch, checked in ``after_trainer``) or "repack" (vLLM's own
    kernels on weights kept in place, prepacked again after each sync: ``repack_after_sync``); its KV cache is sized for tiny
    models. The LLM's own options (eager mode, dtype) go in through TRL's constructor call
    (``trl_bridge.vllm_llm_overrides``) when colocated; a server started by hand must be given them, and the log
    says which."""
    if cfg.backend != "vllm":
        return contextlib.nullcontext()
    from roundalign.training.trl_bridge import vllm_llm_overrides  # noqa: PLC0415 -- optional: vllm (trl imports it)

    if spec(cfg.engine).cpu:
        {"live": vllm_cpu.install_live_gemm_dispatch, "stock": vllm_cpu.uninstall_live_gemm_dispatch,
         "repack": vllm_cpu.install_repack_gemm_dispatch}[cfg.vllm_cpu_gemm]()
        vllm_cpu.small_kv_cache()
    overrides = {}
    if not spec(cfg.engine).compiled:
        overrides["enforce_eager"] = True
    if cfg.dtype in ("fp16", "fp32"):
        overrides["dtype"] = vllm_dtype(cfg.dtype)
    if not overrides:
        return contextlib.nullcontext()
    if cfg.vllm_mode == "server":
        log(f"[train] server mode: start the server with the matching options: trl vllm-serve --model {cfg.model} "
            + ("--enforce_eager " if not spec(cfg.engine).compiled else "")
            + ("--dtype float16 " if cfg.dtype == "fp16" else "") + "--logprobs_mode processed_logprobs")
        return contextlib.nullcontext()
    return vllm_llm_overrides(**overrides)


def repack_after_sync(trainer) -> int:
    """Make TRL's colocated weight sync (``trainer.vllm_generation.sync_weights``) prepack the new weights into
    vLLM-CPU's own GEMM kernels once it has loaded them (vllm_cpu_gemm=repack); returns the engine's repacked layer
    count (0: the engine was not built with the repack dispatch, and the run stops)."""
    gen = trainer.vllm_generation
    model = inprocess_model(colocated_llm(trainer))
    n = repack_gemms(model) if model is not None else 0
    if n == 0:
        raise RuntimeError("vllm_cpu_gemm='repack': the colocated engine has no layer dispatched by "
                           "bridge.vllm_cpu.install_repack_gemm_dispatch (it must run in this process, built after "
                           "before_trainer)")
    sync = gen.sync_weights

    def sync_and_repack(*args, **kwargs):
        out = sync(*args, **kwargs)
        repack_gemms(model)
        return out

    gen.sync_weights = sync_and_repack
    return n


def after_trainer(trainer, model, cfg, log=print) -> tuple[dict | None, list | None]:
    """Check the real engine TRL built against the run's config and record what decides its rounding.

    Returns (``vllm_engine`` record for run.json, or None without vLLM; the engine's RMSNorm reduction orders,
    or None). Raises before step 1 when the engine would not round as the config says (vllm_guard) or, on CPU,
    when TRL's weight sync would not reach a GEMM. Where the orders are read, the policy's norms are re-aligned
    to sum their squares in the engine's order (apply_alignment)."""
    if cfg.backend != "vllm":
        return None, None
    record = guard_trainer(trainer, cfg.engine, cfg.vllm_mode, log=log)
    if spec(cfg.engine).cpu:
        kernels = engine_kernels(colocated_llm(trainer))  # which GEMM path the engine runs
        record["kernels"] = kernels
        record["gemm_dispatch"] = cfg.vllm_cpu_gemm
        want = LIVE_GEMM if cfg.vllm_cpu_gemm == "live" else STOCK_FALLBACK_GEMM
        if cfg.vllm_cpu_gemm == "repack":
            record["repacked_layers"] = repack_after_sync(trainer)
        elif set(kernels.get("gemm", {})) != {want}:
            if cfg.vllm_cpu_gemm == "stock":
                raise RuntimeError(f"vllm_cpu_gemm='stock': on this CPU vLLM's own dispatch runs {kernels.get('gemm')}"
                                   f" (linear layers per kernel), not its {STOCK_FALLBACK_GEMM} fallback on every "
                                   "layer: a prepacked weight is a copy TRL's weight sync cannot reach. Use "
                                   "vllm_cpu_gemm='live' on this CPU")
            raise RuntimeError(f"vLLM-CPU engine's GEMMs are {kernels.get('gemm')}, not {LIVE_GEMM!r} on every "
                               "linear layer: TRL's weight sync would not reach them")
    orders = engine_norm_sum_orders(trainer, cfg, log)
    if orders is not None:
        apply_alignment(model, cfg.alignment, cfg.engine, kernels=cfg.kernels, norm_sum_orders=orders)
        record["norm_sum_orders"] = [f"{v}x{n}" for v, n in orders]
    return record, orders


def engine_norm_sum_orders(trainer, cfg, log=print) -> list | None:
    """The colocated compiled CPU engine's RMSNorm reduction orders, read from its Inductor code, for a variant that
    aligns the norm; None where there is nothing to read (another engine or variant, or a server-mode engine in
    another process: then the norms keep their own reductions, and the log says so)."""
    if cfg.backend != "vllm" or not spec(cfg.engine).reads_norm_orders or cfg.alignment not in ("norm", "full"):
        return None
    if cfg.vllm_mode != "colocate":
        log("[train] server-mode engine: its norms' reduction orders cannot be read from here; the trainer's norms "
            "keep their own (a few tokens may differ, docs/numerics.md)")
        return None
    return read_orders(colocated_llm(trainer))
