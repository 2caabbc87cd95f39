"""What a GPU job runs on: torch's CUDA build, the NVIDIA driver and the GPUs, with a clear message when the
driver is too old for the build.

The pinned torch 2.13.0 wheel from PyPI is a CUDA 13.0 build (its metadata requires
``cuda-toolkit[...]==13.0.3`` and ``nvidia-*-cu13`` libraries), and the vllm 0.31.0 wheel is built for CUDA 13
too (``nvidia-cutlass-dsl[cu13]``, ``humming-kernels[cu13]``); ``tests/test_cluster_env.py`` checks the torch
part on every resolve. CUDA 13.x runs on NVIDIA drivers >= 580 (CUDA's minor-version compatibility floor for
13.x); with an older driver torch reports no GPU at all.
"""

from __future__ import annotations

import shutil
import subprocess

import torch

# Lowest driver branch that runs each CUDA major version (minor-version compatibility floor).
MIN_DRIVER = {12: 525, 13: 580}


def nvidia_smi() -> tuple[str | None, list[str]]:
    """(driver version, GPU names) from ``nvidia-smi``; (None, []) where it is absent or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, []
    try:
        out = subprocess.run([exe, "--query-gpu=driver_version,name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None, []
    rows = [[c.strip() for c in line.split(",", 1)] for line in out.splitlines() if line.strip()]
    return (rows[0][0] if rows else None), [r[1] for r in rows if len(r) > 1]


def driver_problem(torch_cuda: str | None, driver: str | None) -> str | None:
    """A message when ``driver`` cannot run torch's CUDA build ``torch_cuda`` ("13.0"), else None."""
    if torch_cuda is None:
        return ("this torch is a CPU-only build (torch.version.cuda is None): install the GPU environment "
                "(environment.yml), whose torch 2.13.0 wheel is the CUDA 13.0 build")
    if driver is None:
        return None
    major = int(torch_cuda.split(".")[0])
    need = MIN_DRIVER.get(major)
    try:
        have = int(driver.split(".")[0])
    except ValueError:
        return None
    if need is not None and have < need:
        return (f"NVIDIA driver {driver} is too old for torch's CUDA {torch_cuda} build (CUDA {major}.x needs a "
                f"driver >= {need}). The pinned torch 2.13.0 and vllm 0.31.0 wheels are CUDA 13 builds: run on "
                f"nodes with a driver >= {need} (ask your admins, or pick a partition/constraint that has one)")
    return None


def cuda_report() -> dict:
    """torch's CUDA version, the driver, the GPUs torch sees (and nvidia-smi lists), and any problem."""
    driver, smi_gpus = nvidia_smi()
    available = torch.cuda.is_available()
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if available else []
    problem = driver_problem(torch.version.cuda, driver)
    if problem is None and not available:
        problem = ("torch sees no CUDA GPU" + (f" although nvidia-smi lists {smi_gpus}" if smi_gpus else "")
                   + "; check CUDA_VISIBLE_DEVICES and that the job was given GPUs")
    return {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "driver": driver,
            "gpus": gpus or smi_gpus, "cuda_available": available, "problem": problem}


def format_report(rep: dict) -> str:
    return (f"torch {rep['torch']} (CUDA {rep['torch_cuda']}), NVIDIA driver {rep['driver'] or 'unknown'}, "
            f"GPUs: {', '.join(rep['gpus']) or 'none'}")
