"""The GPU + cluster pin set (environment.yml) must install: resolve it for Linux x86-64 on the environment's
Python with pip's resolver (dry run), so a pin change that breaks the cluster environment fails here.

On Python 3.11 this set has no solution (vllm 0.31.0 -> mistral_common[image] >= 1.11.6, whose releases need
numpy < 2.4 on Python <= 3.12, against snakemake-executor-plugin-slurm 2.8.0's numpy >= 2.4.5), hence
``python=3.13`` in environment.yml. The registry serves no separate wheel metadata here, so pip downloads
whole wheels (torch, vllm, CUDA libraries): ~80 s on a 2-core machine with a fast mirror.

Skipped, with the reason, only where no such interpreter or no registry is reachable, or the host is not
Linux x86-64. Interpreter: $ROUNDALIGN_CLUSTER_PYTHON, else python3.X on PATH, else pyenv's 3.X.
Index: $ROUNDALIGN_PIP_INDEX_URL, else PyPI (pip runs --isolated: no site config or constraints apply).
"""

import glob
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tomllib
import urllib.request
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
ENV = yaml.safe_load((ROOT / "environment.yml").read_text())
PIP = next(d["pip"] for d in ENV["dependencies"] if isinstance(d, dict))
PY = next(str(d).split("=", 1)[1] for d in ENV["dependencies"] if str(d).startswith("python="))
INDEX = os.environ.get("ROUNDALIGN_PIP_INDEX_URL", "https://pypi.org/simple")


def _name(req: str) -> str:
    return re.split(r"[=<>!~\[; ]", req, maxsplit=1)[0].lower()


def test_environment_python_and_pins_cover_the_gpu_and_cluster_extras():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = project["dependencies"] + extras["harness"] + extras["gpu"] + extras["cluster"]
    have = {_name(r) for r in PIP if not r.startswith("-")}
    assert {_name(r) for r in wanted} <= have, f"environment.yml lacks {({_name(r) for r in wanted} - have)}"
    assert PY == "3.13", "the GPU pin set resolves on Python 3.13 (not 3.11/3.12); see this module's docstring"


def _interpreter() -> str | None:
    """The first candidate that really runs Python PY (pyenv shims on PATH exist for inactive versions)."""
    candidates = [os.environ.get("ROUNDALIGN_CLUSTER_PYTHON"), shutil.which(f"python{PY}"),
                  *sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{PY}.*/bin/python3")), reverse=True)]
    for exe in filter(None, candidates):
        try:
            out = subprocess.run([exe, "-c", "import sys, venv; print('%d.%d' % sys.version_info[:2])"],
                                 capture_output=True, text=True, timeout=30).stdout.strip()
        except OSError:
            continue
        if out == PY:
            return exe
    return None


@pytest.mark.slow
def test_gpu_cluster_pins_resolve_with_pip(tmp_path):
    if sys.platform != "linux" or platform.machine() != "x86_64":
        pytest.skip(f"the resolve targets Linux x86-64 wheels; this host is {sys.platform}/{platform.machine()}")
    python = _interpreter()
    if python is None:
        pytest.skip(f"no Python {PY} interpreter (set ROUNDALIGN_CLUSTER_PYTHON, or put python{PY} on PATH)")
    try:
        urllib.request.urlopen(INDEX.rstrip("/") + "/pip/", timeout=15).close()
    except OSError as exc:
        pytest.skip(f"package index {INDEX} not reachable: {exc}")
    venv = tmp_path / "venv"
    subprocess.run([python, "-m", "venv", str(venv)], check=True, timeout=120)
    reqs = tmp_path / "requirements.txt"
    reqs.write_text("\n".join(r for r in PIP if not r.startswith("-")) + "\n")
    report = tmp_path / "report.json"
    cmd = [str(venv / "bin" / "python"), "-m", "pip", "--isolated", "install", "--dry-run", "--ignore-installed",
           "--quiet", "--index-url", INDEX, "--report", str(report), "-r", str(reqs)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    assert proc.returncode == 0, f"the environment.yml pin set does not resolve on Python {PY}:\n" \
        + (proc.stdout + proc.stderr)[-4000:]
    installs = {i["metadata"]["name"].lower(): i["metadata"] for i in json.loads(report.read_text())["install"]}
    for req in PIP:
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==(\S+)", req)
        if m:
            assert installs[m.group(1).lower()]["version"] == m.group(2)
    # the default torch 2.13.0 wheel is the CUDA 13 build (gpuinfo.py, README): its CUDA runtime pins say so
    torch_reqs = " ".join(installs["torch"].get("requires_dist", []))
    assert re.search(r"cuda-toolkit\[[^\]]*\]==13\.", torch_reqs) and "nvidia-cudnn-cu13" in torch_reqs, torch_reqs
