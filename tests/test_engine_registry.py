"""The engine registry's seam: a stand-in engine mode added as one ``EngineSpec`` (nothing else changed) is reached by
the rounding plan, the emulated engine, ``apply_alignment``, the kernel-mode default, the dose, the config and the
rounding-map guard (its checks and the vLLM releases it is verified on), and leaves with its block."""

import dataclasses

import pytest
import torch
from conftest import random_qwen
from test_engine import prompts, trainer_logprobs
from test_vllm_guard import fake_llm, settings

from roundalign import apply_alignment
from roundalign.bridge import vllm_guard as G
from roundalign.engine import Engine
from roundalign.numerics import engines
from roundalign.numerics.engines import EngineSpec, GuardCheck
from roundalign.numerics.plan import RoundingPlan, check_engine, default_kernel_mode, engine_plan, plan_for
from roundalign.training.config import ConfigError, TrainConfig

torch.set_num_threads(1)

# A rounding no shipped engine has: RoPE and SwiGLU rounded once (as compiled vLLM), norms and residual adds as HF
# (as none of them). An eager GPU mode, so that the emulated engine runs its plan region by region.
STAND_IN = EngineSpec("stand-in-eager", "a stand-in engine", "cuda", False,
                      dict(rope="fused", swiglu="fused", norm="hf", residual="bf16", qk_norm_rope="split"),
                      "a test's engine", dose=True,
                      guard=(GuardCheck(lambda s: s["tensor_parallel_size"] != 1,
                                        lambda s: f"stand-in: tensor_parallel_size {s['tensor_parallel_size']}"),))


def test_a_registered_engine_is_a_valid_engine_only_inside_its_block():
    with pytest.raises(ValueError, match="unknown engine 'stand-in-eager'; valid engines: vllm-compiled"):
        check_engine("stand-in-eager")
    with engines.register(STAND_IN):
        assert check_engine("stand-in-eager") == "stand-in-eager"
        assert "stand-in-eager" in engines.names(device="cuda") and "stand-in-eager" not in engines.names(device="cpu")
        assert "stand-in-eager" in engines.with_dose()
        with pytest.raises(ValueError, match="registered already"):
            with engines.register(STAND_IN):
                pass
    with pytest.raises(ValueError, match="valid engines: vllm-compiled, vllm-eager, vllm-cpu-compiled, vllm-cpu-eager$"):
        engines.spec("stand-in-eager")


def test_the_plans_of_a_registered_engine_come_from_its_record():
    with engines.register(STAND_IN):
        assert engine_plan("stand-in-eager") == RoundingPlan(rope="fused", swiglu="fused")
        assert plan_for("stand-in-eager", "rope") == RoundingPlan(rope="fused")
        assert plan_for("stand-in-eager", "norm") == RoundingPlan()  # its norms round as HF's
        assert plan_for("stand-in-eager", "baseline") == RoundingPlan()
        assert default_kernel_mode("stand-in-eager") == "eager"


@pytest.mark.slow
def test_the_emulated_engine_and_the_alignment_run_a_registered_engine_bitwise():
    """Sampled by the emulated engine in the stand-in's mode, scored by a trainer aligned to it: every token's
    log-prob is bitwise the engine's, while the baseline trainer and a trainer aligned to another engine
    (vllm-eager, which rounds SwiGLU as HF) are not. Reference: the engine's own sampled log-probs."""
    model = random_qwen("qwen2", tie=False)
    with engines.register(STAND_IN):
        eng = Engine(model, engine="stand-in-eager", attn="eager", gemm="same")
        samples = eng.generate(prompts(lengths=[7, 7, 12, 12, 3]), max_new_tokens=12, seed=3)
        n = sum(len(s.completion_ids) for s in samples)

        def exact(variant, engine):
            apply_alignment(model, variant, engine)
            return sum(int((trainer_logprobs(model, s) == s.logprobs).sum()) for s in samples)

        assert exact("full", "stand-in-eager") == n
        assert exact("baseline", "vllm-compiled") < 0.5 * n
        assert exact("full", "vllm-eager") < 0.5 * n
        apply_alignment(model, "baseline")


def test_the_guard_runs_a_registered_engines_own_checks_and_the_shared_ones():
    good = settings(fake_llm(eager=True))
    with engines.register(STAND_IN):
        assert G.map_problems(good, "stand-in-eager") == []
        bad = {**good, "tensor_parallel_size": 2, "batch_invariant": True}
        assert G.map_problems(bad, "stand-in-eager") == [
            "stand-in: tensor_parallel_size 2",
            "VLLM_BATCH_INVARIANT is set: batch-invariant kernels replace the default ones the map was derived for"]
        # on a CPU platform: the shared device check names the CPU engine of the same (eager) mode
        cpu = G.map_problems({**good, "device_type": "cpu"}, "stand-in-eager")
        assert len(cpu) == 1 and cpu[0].endswith("use engine 'vllm-cpu-eager'"), cpu
        # the stand-in's own check is not one of vllm-eager's
        assert G.map_problems(bad, "vllm-eager") == [bad_msg for bad_msg in G.map_problems(bad, "vllm-eager")
                                                     if not bad_msg.startswith("stand-in")]


def test_the_config_reads_the_dose_engines_and_the_cpu_kind_from_the_registry():
    with pytest.raises(ConfigError, match="engine_dose_bits=4: the dose is emulated on the eager engines only "
                                          r"\(backend emulated, engine vllm-eager or vllm-cpu-eager\)"):
        TrainConfig(model="m", engine="vllm-compiled", engine_dose_bits=4)
    with pytest.raises(ConfigError, match="vllm_cpu_gemm='stock' applies to vLLM-CPU engines only"):
        TrainConfig(model="m", engine="vllm-eager", backend="vllm", vllm_cpu_gemm="stock")
    assert TrainConfig(model="m", engine="vllm-cpu-eager", backend="vllm", vllm_cpu_gemm="stock").vllm_cpu_gemm == "stock"
    with pytest.raises(ConfigError, match="engine='stand-in-eager' is not valid; choose one of: vllm-compiled"):
        TrainConfig(model="m", engine="stand-in-eager")
    with engines.register(STAND_IN):  # a valid engine, and a dose engine, by its record
        assert TrainConfig(model="m", engine="stand-in-eager", engine_dose_bits=4).engine_dose_bits == 4


def test_each_map_is_verified_on_its_records_releases_only():
    for e in engines.CPU_ENGINES:
        assert engines.spec(e).vllm_versions == ("0.31.0", "0.32.0")
        assert engines.is_verified(e, "0.32.0") and engines.is_verified(e, "0.32.0+cpu")  # the local tag is a build
        assert not engines.is_verified(e, "0.33.0") and not engines.is_verified(e, "0.32.1")
        assert not engines.is_verified(e, None)  # no vLLM installed
    for e in engines.GPU_ENGINES:  # read in 0.31.0's CUDA sources; no CUDA engine of another release has run
        assert engines.spec(e).vllm_versions == ("0.31.0",) and not engines.is_verified(e, "0.32.0")
    assert engines.verified_on("0.32.0") == engines.CPU_ENGINES and engines.verified_on("0.31.0") == engines.ENGINES
    assert engines.verified_on("0.33.0") == ()
    with pytest.raises(ValueError, match="unknown engine 'vllm-fast'"):
        engines.is_verified("vllm-fast", "0.31.0")


@pytest.mark.parametrize("versions", [("0.32",), ("0.31.0+cpu",), (), (31,)])
def test_a_record_spells_its_releases_as_x_y_z(versions):
    with pytest.raises(ValueError, match=r"vllm_versions .* expected one or more releases spelled X\.Y\.Z"):
        EngineSpec("bad", "bad", "cpu", False, {}, "", vllm_versions=versions)


def test_the_guard_reads_the_releases_from_a_registered_engines_record():
    """The stand-in says it is verified on 0.33.0 only: the guard lets 0.33.0 through and refuses the pinned release,
    naming the stand-in's releases (a GPU mode: the install line, and check-engine for the CPU maps)."""
    stand_in = dataclasses.replace(STAND_IN, name="stand-in-033", vllm_versions=("0.33.0",))
    good = settings(fake_llm(eager=True))
    with engines.register(stand_in):
        assert G.map_problems({**good, "vllm_version": "0.33.0"}, "stand-in-033") == []
        (msg,) = G.map_problems({**good, "vllm_version": "0.31.0"}, "stand-in-033")
        assert msg == ("vLLM 0.31.0 is installed, and the stand-in-033 map was derived from vLLM 0.33.0: install "
                       "vllm==0.33.0 (`roundalign check-engine` checks the CPU maps on a release's CPU build)")
