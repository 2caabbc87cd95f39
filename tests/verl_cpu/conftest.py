"""verl tests: verl 0.9.1's own FSDP engine and ``ActorRolloutRefWorker`` on a CPU, with
``roundalign.integrations.verl`` as their ``external_lib``.

They need the third environment, ``.venv-verl`` (``tools/envs/verl_env.sh .venv-verl``): verl declares
``transformers<5.11`` and is installed without its dependencies beside this project's transformers 5.17.0. Without
verl every test module here skips (``pytest.importorskip``, naming that command); under ``CI=true`` collecting this
folder fails instead, so CI cannot pass without having run them.

verl runs here as on a one-GPU node, with the CPU standing in: the ``cpu`` platform of ``cpu_platform.py``
(``VERL_PLATFORM=cpu``; registered before anything else of verl asks for its platform), the FSDP engine looked up
under ``cuda`` (``VERL_ENGINE_DEVICE``: verl registers it for cuda and npu only), and one gloo process group of
world size 1, started once per session (verl's worker reads ``RANK``/``WORLD_SIZE``/``MASTER_*``).
"""

import importlib.util
import os
import socket

import pytest
import torch.distributed as dist

_DIST_ENV = {"VERL_PLATFORM": "cpu", "VERL_ENGINE_DEVICE": "cuda", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
             "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}

HAVE_VERL = importlib.util.find_spec("verl") is not None
NEEDS = ("verl 0.9.1 is not importable in this environment: `tools/envs/verl_env.sh .venv-verl` builds .venv-verl, "
         "and tests/verl_cpu runs there (.venv-verl/bin/python -m pytest tests/verl_cpu)")

if not HAVE_VERL and os.environ.get("CI", "").lower() == "true":
    raise pytest.UsageError(f"CI=true: {NEEDS}")
if HAVE_VERL:
    for _key, _value in _DIST_ENV.items():
        os.environ.setdefault(_key, _value)
    import cpu_platform  # noqa: F401  (registers the platform before verl resolves it)


def pytest_configure(config):
    config.addinivalue_line("markers", "verl: runs verl 0.9.1's engine and worker on CPU (tests/verl_cpu; .venv-verl)")


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    for it in items:
        if str(it.fspath).startswith(here):
            it.add_marker(pytest.mark.verl)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def process_group():
    """One gloo process group of world size 1 for the session (verl's engine and worker need one)."""
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _default_settings(monkeypatch):
    """The integration's defaults (full, vllm-compiled, eager kernels) whatever the calling shell exports."""
    for key in ("ROUNDALIGN_VARIANT", "ROUNDALIGN_ENGINE", "ROUNDALIGN_KERNELS"):
        monkeypatch.delenv(key, raising=False)
