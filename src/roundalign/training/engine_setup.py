"""The engine side of building a trainer: what must happen before TRL builds its vLLM engine, and the checks
and records once it exists. ``train._build_trainer`` calls ``before_trainer`` and ``after_trainer`` (which read the
run's ``TrainConfig``); ``roundalign.integrations.trl`` calls ``prepare_engine`` and ``check_built_engine``, the same
steps with explicit arguments. The emulated engine needs none of them (it is built and bridged in train.py).
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
    """Prepare a real vLLM engine before TRL builds it (``prepare_engine`` for the run's config); returns the
    context to build the trainer in. The LLM's dtype is passed for fp16 and fp32 runs (a bf16 run leaves vLLM's
    default)."""
    if cfg.backend != "vllm":
        return contextlib.nullcontext()
    return prepare_engine(cfg.engine, vllm_mode=cfg.vllm_mode, llm_dtype=vllm_dtype(cfg.dtype)
                          if cfg.dtype in ("fp16", "fp32") else None, vllm_cpu_gemm=cfg.vllm_cpu_gemm,
                          model=cfg.model, log=log)


def prepare_engine(engine: str, *, vllm_mode: str, llm_dtype: str | None, vllm_cpu_gemm: str = "live",
                   model: str = "MODEL", log=print):
    """Prepare the real vLLM engine of mode ``engine`` before TRL builds it; returns the context to build the
    trainer in.

    vLLM-CPU prepacks its GEMM weights and drops the parameters TRL's weight sync writes, so its linears run
    F.linear on the live parameters instead (installed before the LLM exists; tests/vllm_cpu), unless
    ``vllm_cpu_gemm`` is "stock" (vLLM's own dispatch, checked in ``check_built_engine``) or "repack" (vLLM's own
    kernels on weights kept in place, prepacked again after each sync: ``repack_after_sync``); its KV cache is sized
    for tiny models unless ``VLLM_CPU_KVCACHE_SPACE`` is set. The LLM's own options (eager mode, ``llm_dtype``: vLLM's
    name, "bfloat16"...) go in through TRL's constructor call (``trl_bridge.vllm_llm_overrides``) when colocated; a
    server started by hand must be given them, and the log says which (``model``: the path it shows)."""
    from roundalign.training.trl_bridge import vllm_llm_overrides  # noqa: PLC0415 -- optional: vllm (trl imports it)

    if spec(engine).cpu:
        {"live": vllm_cpu.install_live_gemm_dispatch, "stock": vllm_cpu.uninstall_live_gemm_dispatch,
         "repack": vllm_cpu.install_repack_gemm_dispatch}[vllm_cpu_gemm]()
        vllm_cpu.small_kv_cache()
    overrides = {}
    if not spec(engine).compiled:
        overrides["enforce_eager"] = True
    if llm_dtype is not None:
        overrides["dtype"] = llm_dtype
    if not overrides:
        return contextlib.nullcontext()
    if vllm_mode == "server":
        log(f"[train] server mode: start the server with the matching options: trl vllm-serve --model {model} "
            + ("--enforce_eager " if not spec(engine).compiled else "")
            + (f"--dtype {llm_dtype} " if llm_dtype is not None else "") + "--logprobs_mode processed_logprobs")
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
    """``check_built_engine`` for the run's config; (None, None) without vLLM."""
    if cfg.backend != "vllm":
        return None, None
    return check_built_engine(trainer, model, cfg.engine, variant=cfg.alignment, kernels=cfg.kernels,
                              vllm_mode=cfg.vllm_mode, vllm_cpu_gemm=cfg.vllm_cpu_gemm, log=log)


def check_built_engine(trainer, model, engine: str, *, variant: str, kernels: str | None, vllm_mode: str,
                       vllm_cpu_gemm: str = "live", log=print) -> tuple[dict, list | None]:
    """Check the real engine TRL built against the engine mode and alignment ``variant`` of the policy ``model``,
    and record what decides its rounding.

    Returns (``vllm_engine`` record for run.json; the engine's RMSNorm reduction orders, or None). Raises before
    step 1 when the engine would not round as ``engine``'s map says (vllm_guard) or, on CPU, when TRL's weight sync
    would not reach a GEMM. Where the orders are read, the policy's norms are re-aligned to sum their squares in the
    engine's order (apply_alignment with ``kernels``)."""
    record = guard_trainer(trainer, engine, vllm_mode, log=log)
    if spec(engine).cpu:
        kernels_run = engine_kernels(colocated_llm(trainer))  # which GEMM path the engine runs
        record["kernels"] = kernels_run
        record["gemm_dispatch"] = vllm_cpu_gemm
        want = LIVE_GEMM if vllm_cpu_gemm == "live" else STOCK_FALLBACK_GEMM
        if vllm_cpu_gemm == "repack":
            record["repacked_layers"] = repack_after_sync(trainer)
        elif set(kernels_run.get("gemm", {})) != {want}:
            if vllm_cpu_gemm == "stock":
                raise RuntimeError(f"vllm_cpu_gemm='stock': on this CPU vLLM's own dispatch runs "
                                   f"{kernels_run.get('gemm')} (linear layers per kernel), not its "
                                   f"{STOCK_FALLBACK_GEMM} fallback on every layer: a prepacked weight is a copy "
                                   "TRL's weight sync cannot reach. Use vllm_cpu_gemm='live' on this CPU")
            raise RuntimeError(f"vLLM-CPU engine's GEMMs are {kernels_run.get('gemm')}, not {LIVE_GEMM!r} on every "
                               "linear layer: TRL's weight sync would not reach them")
    orders = engine_norm_sum_orders(trainer, engine, variant, vllm_mode, log)
    if orders is not None:
        apply_alignment(model, variant, engine, kernels=kernels, norm_sum_orders=orders)
        record["norm_sum_orders"] = [f"{v}x{n}" for v, n in orders]
    return record, orders


def engine_norm_sum_orders(trainer, engine: str, variant: str, vllm_mode: str, log=print) -> list | None:
    """The colocated compiled CPU engine's RMSNorm reduction orders, read from its Inductor code, for a ``variant``
    that aligns the norm; None where there is nothing to read (another engine or variant, or a server-mode engine in
    another process: then the norms keep their own reductions, and the log says so)."""
    if not spec(engine).reads_norm_orders or variant not in ("norm", "full"):
        return None
    if vllm_mode != "colocate":
        log("[train] server-mode engine: its norms' reduction orders cannot be read from here; the trainer's norms "
            "keep their own (a few tokens may differ, docs/numerics.md)")
        return None
    return read_orders(colocated_llm(trainer))
