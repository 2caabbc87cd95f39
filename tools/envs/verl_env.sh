#!/usr/bin/env bash
# The verl environment: verl 0.9.1 beside this project's CPU stack, for tests/verl_cpu and
# roundalign.integrations.verl (docs/verl.md).
#
#   tools/envs/verl_env.sh .venv-verl        # creates or completes the venv; safe to rerun (each step is a no-op
#                                            # when done); writes VENV/.roundalign-installed last
#   .venv-verl/bin/python -m pytest tests/verl_cpu
#
# Why a third environment, and why verl goes in without its dependencies: verl 0.9.1 declares
# transformers>=5.5.3,<5.11 (this project pins 5.17.0; everything verl's FSDP engine and worker run here ran with
# 5.17.0), and its extras pin torch 2.11, vLLM 0.24, flash-attn and Liger, none of which a CPU machine can use. So
# torch comes first (the pinned CPU build: an unpinned torch would pull a multi-GB CUDA one), verl with --no-deps,
# then exactly the packages the import chain of verl's engine, worker and hydra config needs (pip freeze of a
# working environment, 2026-12; ray because verl/protocol.py imports it at `import verl`, no cluster is started;
# peft, datasets, fastapi, uvicorn and pillow because verl/workers imports them). pip reports verl's other declared
# requirements (pybind11, pylatexenc, tensorboard, torchdata, wandb) and its transformers bound as unmet: expected.
# Python 3.11, as the other two environments (docs/versions.md). About 70 s on 2 cores from the local wheel cache.
set -euo pipefail

VENV=${1:?usage: tools/envs/verl_env.sh VENV_DIR}
PY=${PY:-python3.11}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)

test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
pip_install() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@"; }

pip_install torch==2.13.0
pip_install --no-deps verl==0.9.1
# shellcheck disable=SC2046  # one pin per word
pip_install $(grep -v '^#' <<'PINS'
# verl's engine, worker and config (with this project's pins where both need a package)
transformers==5.17.0
accelerate==1.15.0
peft==0.21.2
datasets==5.2.0
tokenizers==0.23.3
safetensors==0.8.0
numpy==2.4.6
pandas==3.1.1
pyarrow==26.0.1
tensordict==0.10.0
hydra-core==1.3.8
omegaconf==2.3.1
antlr4-python3-runtime==4.9.3
codetiming==1.4.0
packaging==25.0
ray==2.60.0
fastapi==0.165.0
uvicorn==0.55.0
pillow==13.0.0
pytest==9.2.0
# what pip chose for their dependencies
annotated-doc==0.0.7
annotated-types==0.8.0
anyio==4.16.0
attrs==26.1.0
certifi==2026.10.19.post1
charset-normalizer==3.5.3
click==8.5.1
cloudpickle==3.1.3
dill==0.4.1
filelock==4.3.2
fsspec==2026.9.0
h11==0.16.0
hf-xet==1.8.0
httpcore==1.0.9
httpx==0.29.0
huggingface_hub==1.33.0
idna==3.21
importlib_metadata==10.2.0
iniconfig==2.3.1
Jinja2==3.1.6
jsonschema==4.26.0
jsonschema-specifications==2025.9.1
lazy-importer==0.1.0
markdown-it-py==4.3.0
MarkupSafe==3.0.4
mdurl==0.1.2
mpmath==1.3.0
msgpack==1.2.4
multiprocess==0.70.19
networkx==3.6.1
opentelemetry-api==1.45.3
orjson==3.13.0
pluggy==1.7.0
protobuf==7.36.2
psutil==7.2.2
pydantic==2.14.4
pydantic_core==2.50.5
Pygments==2.21.0
python-dateutil==4.0.0
pyvers==0.1.0
PyYAML==6.0.4
referencing==0.37.0
regex==2026.12.2
requests==2.34.2
rich==15.0.0
rpds-py==2026.9.1
shellingham==1.5.4
starlette==1.10.0
sympy==1.14.0
tqdm==4.70.1
typer==0.29.3
typing-inspection==0.4.5
typing_extensions==4.16.0
tzdata==2026.6
urllib3==2.8.0
xxhash==4.1.0
zipp==4.1.2
PINS
)
# this project, editable, without its dependencies: its pins above are the ones verl's stack needs (the SLURM
# plugin, TRL, snakemake and the plotting stack stay in .venv)
pip_install --no-deps -e "$ROOT"
touch "$VENV/.roundalign-installed"
