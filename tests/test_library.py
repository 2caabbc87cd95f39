"""The library install: its declared ranges, the transformers check, and the guards against what silently undoes an
alignment in transformers (hub kernels, a ``.to(dtype)`` after loading).

These tests need only torch and transformers, and run in both environments: the harness's (.venv, transformers 5.17.0)
and the built wheel's (`make library-check`: a fresh venv, no harness extras, transformers 5.10.4). There,
ROUNDALIGN_LIBRARY_ENV=1 adds the checks that the installed wheel is what runs, and without the harness.
"""

import copy
import csv
import importlib
import importlib.util
import os
import tomllib
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from packaging.requirements import Requirement
from packaging.version import Version

from roundalign import apply_alignment, cli
from roundalign.models.tiny import make_tiny, random_qwen
from roundalign.numerics import compat

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
LIBRARY_ENV = os.environ.get("ROUNDALIGN_LIBRARY_ENV") == "1"


def _reqs(lines) -> dict[str, Requirement]:
    return {(r := Requirement(line)).name.lower().replace("_", "-"): r for line in lines}


def test_the_library_declares_ranges_and_the_harness_pins_sit_inside_them():
    lib, harness = _reqs(PROJECT["dependencies"]), _reqs(PROJECT["optional-dependencies"]["harness"])
    for name in ("torch", "transformers"):
        assert not any(s.operator == "==" for s in lib[name].specifier), f"the library pins {name} exactly"
        pin = next(iter(harness[name].specifier)).version
        assert lib[name].specifier.contains(pin), f"{name}: harness pin {pin} outside the library's {lib[name]}"
    # the harness's own packages are not the library's
    assert not {"trl", "snakemake", "seaborn", "statsmodels", "matplotlib", "datasets", "math-verify"} & set(lib)
    # transformers' declared range is the verified releases' span, as numerics/compat.py states it
    assert str(lib["transformers"].specifier) == str(Requirement("t" + compat.TESTED_RANGE).specifier)
    verified = sorted(map(Version, compat.VERIFIED))
    assert lib["transformers"].specifier.contains(verified[0]) and lib["transformers"].specifier.contains(verified[-1])
    assert not lib["transformers"].specifier.contains(Version("5.10.3"))  # the lower bound is the oldest verified


def test_the_installed_transformers_is_a_verified_release():
    # 5.17.0 here, 5.10.4 in make library-check; another release makes this fail before any numerics test misleads
    assert transformers.__version__ in compat.VERIFIED, transformers.__version__
    assert compat.restated_sources() == compat.VERIFIED[transformers.__version__]
    assert compat.verdict(transformers.__version__, compat.restated_sources()) == ("verified", "")


def test_an_unverified_release_with_the_same_forwards_warns_in_one_line_and_a_changed_one_is_refused(monkeypatch):
    sources = compat.restated_sources()
    kind, message = compat.verdict("5.16.1", sources)
    assert kind == "same-source" and "5.16.1" in message and transformers.__version__ in message
    assert "\n" not in message
    changed = {**sources, "Qwen3Attention": "0" * 16}
    kind, message = compat.verdict("5.99.0", changed)
    assert kind == "changed" and "\n" not in message
    assert "changes Qwen3Attention (against" in message and compat.TESTED_RANGE in message and compat.ALLOW_ENV in message
    # the check apply_alignment makes: raises for a changed release, warns once for the override
    monkeypatch.setattr(compat.transformers, "__version__", "5.99.0")
    monkeypatch.setattr(compat, "restated_sources", lambda: changed)
    compat.check_transformers.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="changes Qwen3Attention"):
            apply_alignment(random_qwen("qwen3"), "full")
        compat.check_transformers.cache_clear()
        monkeypatch.setenv(compat.ALLOW_ENV, "1")
        with pytest.warns(UserWarning, match="changes Qwen3Attention"):
            assert compat.check_transformers() == "changed"
    finally:
        compat.check_transformers.cache_clear()


def test_a_model_loaded_with_hub_kernels_is_refused():
    model = random_qwen("qwen2")
    model._use_kernels = True  # what PreTrainedModel.set_use_kernels(True) leaves; its use_kernels property reads it
    assert model.use_kernels
    with pytest.raises(ValueError, match="use_kernels=True.*RMSNorm and rotary"):
        apply_alignment(model, "full")


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_a_cast_after_loading_is_caught_and_reapplying_restores_the_engines_rope(arch):
    """``model.to(torch.bfloat16)`` casts the RoPE frequency buffer too (transformers computes it in fp32, as vLLM
    does): an fp32-loaded model aligned and then cast to bf16 would run RoPE from bf16 frequencies. Its forward
    refuses, naming the cast and the fix; apply_alignment after the cast gives the bf16-loaded aligned model's logits
    bitwise."""
    ref = random_qwen(arch)  # bf16 weights, fp32 inv_freq
    cast = copy.deepcopy(ref).to(torch.float32)
    apply_alignment(ref, "full", "vllm-cpu-eager")
    apply_alignment(cast, "full", "vllm-cpu-eager", kernels="eager")
    cast.to(torch.bfloat16)
    assert cast.model.rotary_emb.inv_freq.dtype == torch.bfloat16
    ids = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"inv_freq\) are torch.bfloat16.*call apply_alignment again"):
        cast(ids)
    apply_alignment(cast, "full", "vllm-cpu-eager")
    assert cast.model.rotary_emb.inv_freq.dtype == torch.float32
    with torch.no_grad():
        want, got = ref(ids).logits, cast(ids).logits
    assert torch.equal(got, want)
    # the frequencies matter: the bf16 ones give other logits (so the check above can fail)
    low = copy.deepcopy(cast)
    apply_alignment(low, "baseline")
    low.model.rotary_emb.inv_freq = low.model.rotary_emb.inv_freq.bfloat16()
    with torch.no_grad():
        stock = copy.deepcopy(cast)
        apply_alignment(stock, "baseline")
        assert not torch.equal(low(ids).logits, stock(ids).logits)


@pytest.mark.skipif(not LIBRARY_ENV, reason="make library-check: the built wheel in its own environment")
def test_the_wheel_runs_without_the_harness(tmp_path, capsys):
    import roundalign  # noqa: PLC0415 -- lazy: the module object is what this test inspects

    assert "site-packages" in roundalign.__file__ and not roundalign.__file__.startswith(str(ROOT / "src"))
    for name in ("trl", "datasets", "snakemake", "matplotlib", "seaborn", "statsmodels", "accelerate"):
        assert importlib.util.find_spec(name) is None, f"{name} is installed in the library environment"
    assert transformers.__version__ != next(iter(_reqs(PROJECT["optional-dependencies"]["harness"])["transformers"]
                                                  .specifier)).version
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a verified release: not a line of warning
        apply_alignment(random_qwen("qwen3"), "full")
    # the probe's and attribute's modules import with the library alone
    for mod in ("roundalign.probes.probe", "roundalign.probes.attribute", "roundalign.metrics", "roundalign.cli"):
        importlib.import_module(mod)
    # the probe runs end to end: the emulated engine against the aligned trainer, full exact, stock not
    model = make_tiny("qwen3", tmp_path / "tiny", hidden=64, heads=2, layers=2, seed=0)
    assert cli.main(["probe", "--model", str(model), "--out", str(tmp_path / "probe"), "--engine", "vllm-cpu-eager",
                     "--variants", "baseline,full"]) == 0
    value = {(r["variant"], r["metric"]): float(r["value"]) for r in csv.DictReader(open(tmp_path / "probe"))
             if r["level"] == "token"}
    assert value["full", "mismatch_k3"] == 0.0 and value["full", "tokens_exact_frac"] == 1.0
    assert value["baseline", "mismatch_k3"] > 0.0
    # a harness verb is refused in one line naming the extra
    assert cli.main(["train", "--model", str(model), "--out", str(tmp_path / "run")]) == 2
    assert "pip install 'roundalign[harness]'" in capsys.readouterr().err and not (tmp_path / "run").exists()
