"""``roundalign check-engine`` against the real engine of the vLLM release installed in this environment (vLLM's CPU
build: 0.31.0 in .venv-vllm, 0.32.0 in .venv-vllm032; the module is marked ``vllm032`` and runs in both), and the
guard's reading of that release's config classes.

Reference: the engine's own logprobs (its teacher-forced ``prompt_logprobs`` and the logprobs it returned while
decoding), nothing of ours; check-engine's verdict is that the trainer aligned to the mode equals them bit for bit."""

import dataclasses
import json
import subprocess
import sys

import pytest
import vllm

from roundalign import cli
from roundalign.bridge import vllm_guard as G
from roundalign.numerics import engines
from roundalign.probes.check_engine import CheckEngineConfig

pytestmark = pytest.mark.vllm032

RELEASE = engines.release(vllm.__version__)
# in this process (vLLM's engine wants real file descriptors for stdout: the tests read it with capfd, not capsys)
SMALL = ["--prompts", "2", "--max-new-tokens", "8", "--context-tokens", "0"]


def test_the_installed_release_is_verified_and_its_config_classes_have_the_fields_the_guard_reads():
    """Every environment the suite runs in is a release the CPU maps are verified on (a new release's environment fails
    here until it is added, with these tests passing), and the guard knows that release's fusion passes exactly: a
    pass the release adds would be refused by name (``unknown_fusion_passes``), one it removed is not read."""
    from vllm.config.compilation import PassConfig  # noqa: PLC0415 -- optional: vllm

    for e in engines.CPU_ENGINES:
        assert G.version_problem(e, vllm.__version__) is None, G.version_problem(e, vllm.__version__)
    passes = {name for name, f in PassConfig.__dataclass_fields__.items() if f.type in (bool, "bool")}
    assert passes == set(G.pass_fields(RELEASE)), sorted(passes ^ set(G.pass_fields(RELEASE)))


def test_check_engine_says_both_maps_hold_on_the_installed_release(tmp_path):
    """Both CPU modes on the default tiny Qwen3 (112 context tokens, so decoding crosses a 128-token KV block): full is
    bitwise on every teacher-forced and every decoded token; every region the map names is needed (the trainer
    aligned everywhere but there misses tokens), as is the engine's attention kernel; the eager engine's residual
    stream equals the trainer's after each layer."""
    res = subprocess.run([sys.executable, "-m", "roundalign", "check-engine", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    record = json.loads((tmp_path / "check_engine.json").read_text())
    assert record["holds"] and engines.release(record["vllm"]["version"]) == RELEASE
    assert [r["engine"] for r in record["engines"]] == list(engines.CPU_ENGINES)
    for r in record["engines"]:
        assert r["holds"] and r["vllm_version_verified"], r
        rows = {row["compared"]: row for row in r["rows"]}
        full, sampled = rows["teacher-forced, full"], rows["sampled (decoded), full"]
        assert full["num_tokens"] == sampled["num_tokens"] > 4 * 8  # 4 prompts, up to 16 tokens each (EOS may end one)
        for row in (full, sampled):
            assert (row["num_exact"], row["k3"]) == (row["num_tokens"], 0.0), (r["engine"], row)
        for what, row in rows.items():
            if what.startswith("full, ") and row["num_tokens"]:  # a part left out: tokens missed, k3 above 0
                assert row["num_exact"] < row["num_tokens"] and row["k3"] > 0, (r["engine"], row)
        assert rows["baseline (every region as HF)"]["exact_frac"] < 0.5
        eager = r["engine"] == "vllm-cpu-eager"
        assert (r["num_layers"], r["first_layer_departing"]) == ((2, None) if eager else (None, None)), r
        # the eager map rounds SwiGLU as Hugging Face does: nothing to leave out there
        assert (rows["full, swiglu as HF"]["num_tokens"] is None) == eager
        assert f"{r['engine']} on vLLM {record['vllm']['version']}: HOLDS" in res.stdout
    assert "vllm-cpu-compiled" in res.stdout.split("vllm-cpu-eager on vLLM")[0]  # the registry's order


def test_on_an_unverified_release_check_engine_runs_the_engine_the_guard_refuses(tmp_path, capfd):
    """A mode whose record is verified on another release only (the eager map, verified on 0.30.0 for the test):
    check-engine runs the engine anyway and finds the map holds; the guard, outside check-engine, refuses that engine
    in the one line that names the command."""
    unverified = dataclasses.replace(engines.spec("vllm-cpu-eager"), name="vllm-cpu-eager-unverified",
                                     vllm_versions=("0.30.0",))
    with engines.register(unverified):
        code = cli.main(["check-engine", "--engine", unverified.name, "--out", str(tmp_path), *SMALL])
        out = capfd.readouterr().out
        assert code == 0, out[-3000:]
        (r,) = json.loads((tmp_path / "check_engine.json").read_text())["engines"]
        assert r["holds"] and not r["vllm_version_verified"]
        assert f"{unverified.name} is verified on 0.30.0, not {RELEASE}" in out
        assert f"the guard still refuses {unverified.name}" in out
        assert G.map_problems(r["engine_settings"], unverified.name) == [
            f"vLLM {r['engine_settings']['vllm_version']} is installed, and the {unverified.name} map is verified on "
            f"vLLM 0.30.0 only: `roundalign check-engine --engine {unverified.name}` measures whether it holds on "
            f"{RELEASE}"]


def test_a_map_that_does_not_hold_exits_1_and_names_the_region(tmp_path, capfd):
    """Negative control: a record that claims the eager engine rounds SwiGLU once (it rounds as Hugging Face does,
    silu then the product). check-engine finds teacher-forced tokens missed, exits 1, and names SwiGLU: the trainer
    aligned with that record everywhere but SwiGLU is bitwise."""
    eager = engines.spec("vllm-cpu-eager")
    wrong = dataclasses.replace(eager, name="vllm-cpu-eager-swiglu-once", plan={**eager.plan, "swiglu": "fused"})
    with engines.register(wrong):
        code = cli.main(["check-engine", "--engine", wrong.name, "--out", str(tmp_path), *SMALL])
    out = capfd.readouterr().out
    assert code == 1, out[-3000:]
    (r,) = json.loads((tmp_path / "check_engine.json").read_text())["engines"]
    rows = {row["compared"]: row for row in r["rows"]}
    full = rows["teacher-forced, full"]
    assert not r["holds"] and full["num_exact"] < full["num_tokens"] and full["k3"] > 0, full
    swiglu = rows["full, swiglu as HF"]
    assert (swiglu["num_exact"], swiglu["k3"]) == (swiglu["num_tokens"], 0.0), swiglu
    assert r["regions_rounded_as_hf"] == ["swiglu"] and r["first_layer_departing"] == 0
    assert f"{wrong.name} on vLLM {r['engine_settings']['vllm_version']}: DOES NOT HOLD" in out
    assert "the release rounds swiglu as Hugging Face does" in out


def test_an_engine_the_guard_refuses_is_reported_as_not_holding_with_the_guards_reasons(tmp_path, capfd):
    """A mode whose guard refuses the real engine's settings (a stand-in check that fails on every engine): check-engine
    builds it, reports the guard's reason as the verdict's, scores nothing, and exits 1."""
    eager = engines.spec("vllm-cpu-eager")
    strict = dataclasses.replace(eager, name="vllm-cpu-eager-strict", guard=(*eager.guard, engines.GuardCheck(
        lambda s: s["tensor_parallel_size"] == 1, lambda s: "stand-in: refuses tensor_parallel_size 1")))
    with engines.register(strict):
        code = cli.main(["check-engine", "--engine", strict.name, "--out", str(tmp_path), *SMALL])
    out = capfd.readouterr().out
    assert code == 1, out[-3000:]
    (r,) = json.loads((tmp_path / "check_engine.json").read_text())["engines"]
    assert not r["holds"] and r["rows"] == [] and "stand-in: refuses tensor_parallel_size 1" in r["guard"]
    assert f"{strict.name} on vLLM {vllm.__version__}: DOES NOT HOLD: the engine does not run the configuration" in out

def test_check_engine_refuses_a_gpu_map_and_names_the_cpu_ones(capsys):
    assert cli.main(["check-engine", "--engine", "vllm-compiled"]) == 2
    err = capsys.readouterr().err
    assert "engine 'vllm-compiled' is a GPU map" in err and "valid engines: vllm-cpu-compiled, vllm-cpu-eager" in err


@pytest.mark.parametrize("kwargs, message", [
    (dict(engines=("vllm-cpu-eager", "vllm-cpu-eager")), r"engines \['vllm-cpu-eager', 'vllm-cpu-eager'\] names one twice"),
    (dict(engines=("vllm-cpu-fast",)), "unknown engine 'vllm-cpu-fast'; valid engines: vllm-compiled"),
    (dict(engines=()), "give at least one engine; valid engines: vllm-cpu-compiled, vllm-cpu-eager"),
    (dict(arch="llama"), "arch 'llama'; valid choices: qwen2, qwen3"),
    (dict(arch="qwen2", model="m"), "arch 'qwen2' is the tiny model's, built only without a model"),
    (dict(num_prompts=0), "num_prompts=0 must be an integer >= 1"),
    (dict(context_tokens=-1), "context_tokens=-1 must be an integer >= 0"),
])
def test_bad_settings_are_refused_naming_the_setting_and_the_valid_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CheckEngineConfig(**kwargs)
