"""Preflight's CUDA report: torch's CUDA build against the driver, parsed from nvidia-smi."""

import os
import stat

import torch

from roundalign import gpuinfo


def test_driver_floor_for_cuda13_build():
    msg = gpuinfo.driver_problem("13.0", "550.54.15")
    assert "550.54.15 is too old" in msg and ">= 580" in msg
    assert gpuinfo.driver_problem("13.0", "580.65.06") is None
    assert gpuinfo.driver_problem("12.8", "550.54.15") is None
    assert gpuinfo.driver_problem("13.0", None) is None  # unknown driver: torch's own check decides
    assert "CPU-only build" in gpuinfo.driver_problem(None, "580.1")


def test_nvidia_smi_is_parsed_and_report_names_the_problem(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho '535.104.05, NVIDIA H100 80GB HBM3'\necho '535.104.05, NVIDIA H100 80GB HBM3'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert gpuinfo.nvidia_smi() == ("535.104.05", ["NVIDIA H100 80GB HBM3"] * 2)

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    rep = gpuinfo.cuda_report()
    assert "535.104.05 is too old" in rep["problem"]
    assert "CUDA 13.0" in gpuinfo.format_report(rep) and "H100" in gpuinfo.format_report(rep)
