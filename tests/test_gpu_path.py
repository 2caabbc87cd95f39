"""GPU-path wiring checked on CPU: ZeRO-3 load order, the sweep's vllm_mode rule, the emulated engine under
a device context."""

import re
from pathlib import Path

import pytest
import yaml
from snakemake.utils import validate

import roundalign.models.load as models
import roundalign.training.train as train
from roundalign.models.tiny import make_tiny
from roundalign.training.config import ConfigError, build_config
from roundalign.training.sweep import Sweep

ROOT = Path(__file__).resolve().parents[1]


def test_grpo_args_exist_before_the_model_is_loaded(tmp_path, monkeypatch):
    # Under `accelerate launch` + DeepSpeed, building GRPOConfig registers HfDeepSpeedConfig; only a model loaded
    # after that is created under zero.Init (zero3_init_flag), so every rank holds a shard, not the whole model.
    model = str(make_tiny("qwen2", tmp_path / "m", hidden=32, layers=1))
    order = []
    real_args = train.build_grpo_args
    monkeypatch.setattr(train, "build_grpo_args", lambda *a, **k: (order.append("args"), real_args(*a, **k))[1])

    def load_model(*a, **k):
        order.append("model")
        raise RuntimeError("stop here")

    monkeypatch.setattr(models, "load_model", load_model)
    cfg = build_config(overrides={"model": model})
    with pytest.raises(RuntimeError, match="stop here"):
        train._build_trainer(cfg, tmp_path / "ck", None, None, (), lambda *_: None)
    assert order == ["args", "model"]


def _paper():
    cfg = yaml.safe_load((ROOT / "configs/paper.yaml").read_text())
    validate(cfg, str(ROOT / "workflow/schemas/sweep.schema.yaml"), set_default=True)
    return cfg


def test_sweep_refuses_vllm_server_mode_naming_the_model():
    cfg = _paper()
    Sweep(cfg)
    cfg["models"]["qwen3-4b-base"]["train"]["vllm_mode"] = "server"
    with pytest.raises(ConfigError, match=r"models\.qwen3-4b-base: vllm_mode 'server' is not supported"):
        Sweep(cfg)


def test_paper_probes_run_on_one_gpu_of_each_models_kind():
    sweep = Sweep(_paper())
    assert sweep.probe_resources("qwen25-math-7b") == {"gpu": 1, "gpu_model": "h100", "cpus_per_gpu": 8,
                                                      "mem_mb": 256000, "runtime": 120}
    smoke = yaml.safe_load((ROOT / "configs/smoke.yaml").read_text())

    validate(smoke, str(ROOT / "workflow/schemas/sweep.schema.yaml"), set_default=True)
    name = next(iter(smoke["models"]))
    assert Sweep(smoke).probe_resources(name)["gpu"] == 0  # tiny models keep the CPU probe
    cfg = _paper()
    cfg["models"]["qwen3-1.7b-base"]["gpus"] = 0
    cfg["models"]["qwen3-1.7b-base"]["train"] = {"backend": "emulated"}
    with pytest.raises(ConfigError, match=r"models\.qwen3-1\.7b-base\.gpus=0: probe\.backend 'vllm'"):
        Sweep(cfg)


def _vllm_cpu():
    cfg = yaml.safe_load((ROOT / "configs/vllm-cpu.yaml").read_text())
    validate(cfg, str(ROOT / "workflow/schemas/sweep.schema.yaml"), set_default=True)
    return cfg


def test_vllm_cpu_sweep_trains_and_probes_on_cpu_with_the_second_environment():
    sweep = Sweep(_vllm_cpu())
    name = "cpu-qwen3-untied"
    assert sweep.train_resources(name)["gpu"] == 0 and sweep.probe_resources(name)["gpu"] == 0
    assert sweep.launcher(name) == ".venv-vllm/bin/python" == sweep.python  # train and probe jobs' interpreter
    # 4 models, each trained with the trainer's attention and, as <model>.vllm_cpu on the same policy, the engine's
    assert sweep.train_overrides(name)["backend"] == "vllm" and len(sweep.runs()) == 4 * 2 * 3 * 2
    assert (sweep.train_settings(name)["attn"], sweep.train_settings(f"{name}.vllm_cpu")["attn"]) == ("sdpa", "vllm_cpu")
    assert sweep.policy_dir(f"{name}.vllm_cpu") == sweep.policy_dir(name)
    assert sweep.probed_models() == sorted(m for m in sweep.models if "." not in m)  # one probe per policy
    # a GPU engine without a GPU, and the CPU build given a GPU, are refused naming the model
    cfg = _vllm_cpu()
    cfg["train"]["engine"] = "vllm-compiled"
    with pytest.raises(ConfigError, match=r"models\.cpu-qwen25-tied\.gpus=0: backend 'vllm' with engine "
                                          r"'vllm-compiled' needs at least one GPU \(on CPU: engine vllm-cpu-"):
        Sweep(cfg)
    cfg = _vllm_cpu()
    cfg["models"]["cpu-qwen3-tied"]["gpus"] = 1
    with pytest.raises(ConfigError, match=r"models\.cpu-qwen3-tied\.gpus=1: engine 'vllm-cpu-compiled' is vLLM's CPU"):
        Sweep(cfg)


def test_cpu_models_can_run_several_data_parallel_processes_under_accelerate_launch():
    cfg = _vllm_cpu()
    cfg["models"]["cpu-qwen3-untied"].update(processes=2, accelerate_config="configs/accelerate/cpu.yaml")
    sweep = Sweep(cfg)
    assert sweep.launcher("cpu-qwen3-untied") == (".venv-vllm/bin/python -m accelerate.commands.launch "
                                                  "--config_file configs/accelerate/cpu.yaml --num_processes 2")
    assert sweep.train_resources("cpu-qwen3-untied")["threads"] == 2  # a core per rank
    assert sweep.train_resources("cpu-qwen3-tied")["threads"] == 1 and sweep.launcher("cpu-qwen3-tied") == sweep.python
    assert yaml.safe_load((ROOT / "configs/accelerate/cpu.yaml").read_text())["distributed_type"] == "MULTI_GPU"  # torchrun
    cfg = _vllm_cpu()
    cfg["models"]["cpu-qwen3-untied"]["processes"] = 2
    with pytest.raises(ConfigError, match=r"models\.cpu-qwen3-untied\.accelerate_config: 2 CPU processes need an "
                                          r"accelerate launch config, e\.g\. configs/accelerate/cpu\.yaml"):
        Sweep(cfg)
    cfg = _paper()
    name = next(m for m, spec in cfg["models"].items() if spec["gpus"] > 0)
    cfg["models"][name]["processes"] = 2
    with pytest.raises(ConfigError, match=rf"models\.{re.escape(name)}\.processes=2: CPU processes are for gpus: 0"):
        Sweep(cfg)
