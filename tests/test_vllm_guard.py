"""The rounding-map guard, against stand-ins of a built ``vllm.LLM`` with vllm 0.31's attribute paths and the
values its VllmConfig.__post_init__ resolves (no vLLM needed), and against the real classes where installed."""

import enum
import json
from types import SimpleNamespace

import pytest

from roundalign.bridge import vllm_guard as G


class CompilationMode(enum.IntEnum):  # vllm/config/compilation.py:37-51
    NONE = 0
    STOCK_TORCH_COMPILE = 1
    DYNAMO_TRACE_ONCE = 2
    VLLM_COMPILE = 3


class CUDAGraphMode(enum.Enum):  # vllm/config/compilation.py:53-60
    NONE = 0
    PIECEWISE = 1
    FULL = 2
    FULL_AND_PIECEWISE = (2, 1)


def fake_llm(*, eager=False, tp=1, hopper_flashinfer=False, graph_partition=False, custom_ops=None,
             rms_priority=None):
    """A stand-in for ``vllm.LLM(...)`` after construction, resolved the way vllm 0.31 resolves it on CUDA:
    mode VLLM_COMPILE at -O2 unless enforce_eager (vllm/config/vllm.py:1694-1696, 1775-1779), custom_ops
    'none' under Inductor else 'all' (vllm.py:1787-1794), IR priority ['native'] under Inductor else
    ['vllm_c', 'native'] (vllm/platforms/cuda.py:730-752), the O2 pass table (vllm.py:300-321) with
    fuse_allreduce_rms on for TP>1 on Hopper with flashinfer (vllm.py:182-208)."""
    compiled = not eager
    prio = rms_priority or (["native"] if compiled else ["vllm_c", "native"])
    passes = {f: False for f in G.PASS_FIELDS}
    passes["eliminate_noops"] = True
    passes["fuse_allreduce_rms"] = tp > 1 and hopper_flashinfer
    passes["fuse_rope_kvcache_cat_mla"] = True  # `not splitting_ops_contain_kv_cache_update()`: MLA only
    cc = SimpleNamespace(
        mode=CompilationMode.VLLM_COMPILE if compiled else CompilationMode.NONE, backend="inductor",
        cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE if compiled else CUDAGraphMode.NONE,
        custom_ops=custom_ops if custom_ops is not None else (["none"] if compiled else ["all"]),
        use_inductor_graph_partition=graph_partition, pass_config=SimpleNamespace(**passes))
    cfg = SimpleNamespace(
        compilation_config=cc,
        kernel_config=SimpleNamespace(ir_op_priority=SimpleNamespace(rms_norm=list(prio),
                                                                     fused_add_rms_norm=list(prio),
                                                                     gelu_and_mul_sparse=["triton", "native"])),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
        model_config=SimpleNamespace(enforce_eager=eager, dtype="torch.bfloat16"))
    llm = SimpleNamespace(llm_engine=SimpleNamespace(vllm_config=cfg))
    return SimpleNamespace(llm=llm)  # as TRL's VLLMGeneration holds it


def settings(llm):
    return G.engine_settings(llm, vllm_version="0.31.0")


def test_default_engines_match_their_maps_and_settings_are_json():
    comp, eager = settings(fake_llm()), settings(fake_llm(eager=True))
    assert G.map_problems(comp, "vllm-compiled") == []
    assert G.map_problems(eager, "vllm-eager") == []
    assert comp["compilation_mode"] == "VLLM_COMPILE" and comp["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    assert eager["ir_op_priority_rms_norm"] == ["vllm_c", "native"] and eager["custom_rotary_embedding"]
    json.dumps(comp)  # goes into run.json as is
    # crossing them is refused both ways
    assert any("runs compilation mode NONE" in p for p in G.map_problems(eager, "vllm-compiled"))
    assert any("launch it with enforce_eager" in p for p in G.map_problems(comp, "vllm-eager"))


@pytest.mark.parametrize("kwargs, needle", [
    (dict(graph_partition=True), "use_inductor_graph_partition"),
    (dict(tp=2, hopper_flashinfer=True), "all-reduce + RMSNorm fusion (tensor_parallel_size=2)"),
    (dict(custom_ops=["none", "+rotary_embedding"]), "custom op rotary_embedding is enabled"),
    (dict(rms_priority=["vllm_c", "native"]), "RMSNorm IR priority"),
])
def test_compiled_departures_are_named(kwargs, needle):
    problems = G.map_problems(settings(fake_llm(**kwargs)), "vllm-compiled")
    assert len(problems) == 1 and needle in problems[0], problems


def test_tp2_without_the_fusion_is_fine_and_eager_ignores_passes():
    assert G.map_problems(settings(fake_llm(tp=2)), "vllm-compiled") == []
    assert G.map_problems(settings(fake_llm(eager=True, tp=2, hopper_flashinfer=True)), "vllm-eager") == []


def test_check_raises_before_training_with_every_problem(monkeypatch):
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    monkeypatch.setattr(G.metadata, "version", lambda name: "0.32.0")
    with pytest.raises(G.EngineMapError) as exc:
        G.check_engine_map(fake_llm(eager=True), "vllm-compiled", log=lambda *_: None)
    text = str(exc.value)
    assert "0.32.0" in text and "VLLM_BATCH_INVARIANT" in text and "compilation mode NONE" in text
    with pytest.raises(ValueError, match="vllm-compiled"):
        G.map_problems(settings(fake_llm()), "vllm-fast")
    with pytest.raises(TypeError, match="VllmConfig"):
        G.engine_settings(object())


def test_trainer_guard_records_and_stops():
    trainer = SimpleNamespace(vllm_generation=fake_llm())
    record = G.guard_trainer(trainer, "vllm-compiled", "colocate", log=lambda *_: None)
    assert record["checked"] and record["compilation_mode"] == "VLLM_COMPILE"
    with pytest.raises(G.EngineMapError, match="vllm-eager"):
        G.guard_trainer(trainer, "vllm-eager", "colocate", log=lambda *_: None)
    server = G.guard_trainer(SimpleNamespace(vllm_generation=SimpleNamespace()), "vllm-compiled", "server",
                             log=lambda *_: None)
    assert server == {"checked": False, "reason": server["reason"]} and "server" in server["reason"]


def test_custom_op_rule_mirrors_vllm():
    assert G.custom_op_enabled(["none", "+rotary_embedding"], "rotary_embedding")
    assert not G.custom_op_enabled(["all", "-rotary_embedding"], "rotary_embedding")
    with pytest.raises(ValueError):
        G.custom_op_enabled(["+rms_norm"], "rms_norm")


def _cpu(llm, *, compiled=True, ci_env=False):
    """The stand-in as vLLM's CPU platform resolves it (vllm/platforms/cpu.py:336-363): VLLM_COMPILE becomes
    DYNAMO_TRACE_ONCE with the inductor backend ('eager' under VLLM_CPU_CI_ENV), no splitting ops, IR priority
    native in both modes."""
    cfg = llm.llm.llm_engine.vllm_config
    cfg.device_config = SimpleNamespace(device_type="cpu")
    cc = cfg.compilation_config
    cc.splitting_ops = []
    if compiled:
        cc.mode, cc.backend = CompilationMode.DYNAMO_TRACE_ONCE, "eager" if ci_env else "inductor"
    cfg.kernel_config.ir_op_priority.rms_norm = ["native"]
    cfg.kernel_config.ir_op_priority.fused_add_rms_norm = ["native"]
    return llm


def test_cpu_platform_modes_map_to_the_cpu_targets_and_refuse_the_gpu_maps():
    comp, eager = settings(_cpu(fake_llm())), settings(_cpu(fake_llm(eager=True), compiled=False))
    assert G.map_problems(comp, "vllm-cpu-compiled") == [] and G.map_problems(eager, "vllm-cpu-eager") == []
    (msg,) = G.map_problems(comp, "vllm-compiled")
    assert "'cpu' platform" in msg and "use engine 'vllm-cpu-compiled'" in msg
    assert "rounds like eager" not in msg  # wrong words for the CPU compiled mode
    assert "one Inductor graph" in G.map_problems(comp, "vllm-cpu-eager")[0]
    assert "enforce_eager=True" in G.map_problems(eager, "vllm-cpu-compiled")[0]
    ci = settings(_cpu(fake_llm(), ci_env=True))
    assert any("compile backend 'eager'" in p for p in G.map_problems(ci, "vllm-cpu-compiled"))


def test_a_cpu_map_on_a_gpu_engine_is_refused():
    llm = fake_llm()
    llm.llm.llm_engine.vllm_config.device_config = SimpleNamespace(device_type="cuda")
    (msg,) = G.map_problems(settings(llm), "vllm-cpu-compiled")
    assert "'cuda' platform" in msg and "use engine 'vllm-compiled'" in msg



@pytest.mark.parametrize("version", ["0.33.0", "0.33.0+cpu", "0.30.2"])
@pytest.mark.parametrize("engine", ["vllm-cpu-eager", "vllm-cpu-compiled"])
def test_an_unverified_release_is_refused_in_one_line_that_names_check_engine(monkeypatch, engine, version):
    """A CPU engine of a release its map is not verified on: one line, the only problem (the engine runs the mode
    the map describes), naming the releases it is verified on and the command that checks this one."""
    eager = engine.endswith("eager")
    llm = _cpu(fake_llm(eager=eager), compiled=not eager)
    monkeypatch.setattr(G.metadata, "version", lambda name: version)
    (msg,) = G.map_problems(G.engine_settings(llm), engine)
    assert msg == (f"vLLM {version} is installed, and the {engine} map is verified on vLLM 0.31.0, 0.32.0 only: "
                   f"`roundalign check-engine --engine {engine}` measures whether it holds on {version.split('+')[0]}")
    with pytest.raises(G.EngineMapError, match=f"`roundalign check-engine --engine {engine}`"):
        G.check_engine_map(llm, engine, log=lambda *_: None)
    # what check-engine runs the engine under: the version is let through, every other check still stands
    with G.checking_unverified_version():
        assert G.check_engine_map(llm, engine, log=lambda *_: None)["vllm_version"] == version
        other = "vllm-cpu-compiled" if eager else "vllm-cpu-eager"
        assert G.map_problems(G.engine_settings(llm), other) and all(
            "check-engine" not in p for p in G.map_problems(G.engine_settings(llm), other))
    with pytest.raises(G.EngineMapError, match="check-engine"):  # and only inside the block
        G.check_engine_map(llm, engine, log=lambda *_: None)


@pytest.mark.parametrize("version", ["0.31.0", "0.32.0", "0.32.0+cpu"])
def test_the_verified_releases_pass_on_the_cpu_and_only_the_pinned_one_on_a_gpu(monkeypatch, version):
    monkeypatch.setattr(G.metadata, "version", lambda name: version)
    assert G.map_problems(G.engine_settings(_cpu(fake_llm())), "vllm-cpu-compiled") == []
    assert G.map_problems(G.engine_settings(_cpu(fake_llm(eager=True), compiled=False)), "vllm-cpu-eager") == []
    gpu = G.map_problems(G.engine_settings(fake_llm()), "vllm-compiled")
    if version.startswith("0.31.0"):
        assert gpu == []
    else:  # the GPU maps were read in 0.31.0's CUDA sources only
        assert gpu == [f"vLLM {version} is installed, and the vllm-compiled map was derived from vLLM 0.31.0: install "
                       "vllm==0.31.0 (`roundalign check-engine` checks the CPU maps on a release's CPU build)"]
    # no version known (no vLLM distribution installed): nothing to refuse on
    assert G.version_problem("vllm-cpu-eager", None) is None


def test_pass_fields_follow_the_release_and_an_unknown_pass_that_is_on_is_refused():
    # vLLM 0.32.0 removed sequence parallelism and async TP: its PassConfig has neither field
    assert set(G.PASS_FIELDS) - set(G.pass_fields("0.32.0+cpu")) == {"enable_sp", "fuse_gemm_comms"}
    assert G.pass_fields("0.31.0") == G.PASS_FIELDS
    with pytest.raises(KeyError, match="vLLM 0.33.0: PassConfig fields are known for 0.31.0, 0.32.0"):
        G.pass_fields("0.33.0")
    llm = _cpu(fake_llm())
    pc = llm.llm.llm_engine.vllm_config.compilation_config.pass_config
    del pc.enable_sp, pc.fuse_gemm_comms  # as 0.32.0's PassConfig: the fields are absent, not off
    pc.fuse_new_rms_norm = True  # a pass a later release adds, on
    pc.new_pass_max_tokens = 256  # a pass's size setting: not a pass
    s = settings(llm)
    assert "enable_sp" not in s["fusion_passes"] and s["unknown_fusion_passes"] == ["fuse_new_rms_norm"]
    (msg,) = G.map_problems(s, "vllm-cpu-compiled")
    assert msg.startswith("fusion passes this guard does not know are on: fuse_new_rms_norm;"), msg
    # passes are Inductor's: an eager engine runs none of them
    eager = settings(_cpu(fake_llm(eager=True), compiled=False))
    assert G.map_problems({**eager, "unknown_fusion_passes": ["fuse_new_rms_norm"]}, "vllm-cpu-eager") == []
