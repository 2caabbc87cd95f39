"""Benchmark: wall time of Snakemake dry runs (DAG building + config validation), goal <= 5 s for the paper.

    python scripts/bench_workflow.py --out results/bench/workflow.txt

Runs `python -m snakemake -n` for the smoke, paper and paper+ablations configs, plus the SLURM profile dry
run of the paper sweep, three times each, and reports the median wall time (process start included).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from roundalign.io import atomic_write_text

ROOT = Path(__file__).resolve().parents[1]
CASES = [
    ("smoke", []),
    ("paper", ["--configfile", "configs/paper.yaml"]),
    ("paper+ablations", ["--configfile", "configs/paper.yaml", "configs/ablations.yaml"]),
    ("paper, SLURM profile", ["--profile", "workflow/profiles/slurm", "--configfile", "configs/paper.yaml"]),
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="results/bench/workflow.txt")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    env = {**os.environ, "SLURM_ACCOUNT": "bench", "SLURM_PARTITION": "bench",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    lines = [f"# Snakemake dry-run wall time ({time.strftime('%Y-%m-%d')}; median of {args.repeats}; goal paper <= 5 s)",
             f"{'config':24} {'jobs':>5} {'median s':>9}"]
    for name, extra in CASES:
        times, jobs = [], "?"
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            res = subprocess.run([sys.executable, "-m", "snakemake", "-n", *extra], cwd=ROOT, env=env,
                                 capture_output=True, text=True)
            times.append(time.perf_counter() - t0)
            if res.returncode != 0:
                raise SystemExit(f"dry run of {name} failed:\n{res.stderr[-2000:]}")
            jobs = next((ln.split()[-1] for ln in res.stdout.splitlines() if ln.startswith("total")), "?")
        lines.append(f"{name:24} {jobs:>5} {statistics.median(times):9.2f}")
        print(lines[-1], flush=True)
    atomic_write_text(args.out, "\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
