"""Benchmark: wall time of Snakemake dry runs (DAG building + config validation), goal <= 5 s for the paper, and of
`make figures` from a fresh clone, goal <= 15 s.

    python -m tools.bench.workflow --out results/bench/workflow.txt
    python -m tools.bench.workflow --figures-only --figures-refs 089ddb3,HEAD --out /tmp/figures.txt

Dry runs: `python -m snakemake -n` for the smoke, paper and paper+ablations configs, plus the SLURM profile dry
run of the paper sweep, three times each; the median wall time (process start included).

`make figures`: for each git ref of --figures-refs, its committed tree (`git archive`: what a fresh clone
holds, no .snakemake/ and no __pycache__/), then its own `make figures` in it
(with this interpreter's environment) --repeats times, with that tree's src/ first on PYTHONPATH so its own code draws.
Reports the median and minimum wall time and the CPU time of make and its children (on a
shared machine the CPU time moves less than the wall time), and checks that every rerun wrote the same bytes
(sha256 of each PNG, PDF, CSV and MD under figures/) and whether they equal the ref's committed figures. The
refs are run in turns (ref 1, ref 2, ref 1, ...) so that load from other jobs falls on all of them alike.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from roundalign.envinfo import cpu_kernels
from roundalign.io import atomic_write_text

ROOT = Path(__file__).resolve().parents[2]
CASES = [
    ("smoke", []),
    ("paper", ["--configfile", "configs/paper.yaml"]),
    ("paper+ablations", ["--configfile", "configs/paper.yaml", "configs/ablations.yaml"]),
    ("paper, SLURM profile", ["--profile", "workflow/profiles/slurm", "--configfile", "configs/paper.yaml"]),
]
FIGURE_SUFFIXES = (".png", ".pdf", ".csv", ".md")


def _env() -> dict:
    return {**os.environ, "SLURM_ACCOUNT": "bench", "SLURM_PARTITION": "bench", "OMP_NUM_THREADS": "1",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}


def dry_runs(repeats: int) -> list[str]:
    env = _env()
    lines = [f"{'config':24} {'jobs':>5} {'median s':>9}"]
    for name, extra in CASES:
        times, jobs = [], "?"
        for _ in range(repeats):
            t0 = time.perf_counter()
            res = subprocess.run([sys.executable, "-m", "snakemake", "-n", *extra], cwd=ROOT, env=env,
                                 capture_output=True, text=True)
            times.append(time.perf_counter() - t0)
            if res.returncode != 0:
                raise SystemExit(f"dry run of {name} failed:\n{res.stderr[-2000:]}")
            jobs = next((ln.split()[-1] for ln in res.stdout.splitlines() if ln.startswith("total")), "?")
        lines.append(f"{name:24} {jobs:>5} {statistics.median(times):9.2f}")
        print(lines[-1], flush=True)
    return lines


def figure_hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((root / "figures").rglob("*")) if p.suffix in FIGURE_SUFFIXES}


def fresh_tree(ref: str, dest: Path) -> str:
    """The committed tree of ``ref`` in ``dest`` (git archive); returns the commit's short sha."""
    sha = subprocess.run(["git", "rev-parse", "--short", ref], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    with tempfile.TemporaryFile() as tar:
        subprocess.run(["git", "archive", "--format=tar", ref], cwd=ROOT, check=True, stdout=tar)
        tar.seek(0)
        with tarfile.open(fileobj=tar) as t:
            t.extractall(dest, filter="data")
    return sha


def make_figures_once(tree: Path) -> tuple[float, float, dict[str, str]]:
    """One `make figures` in ``tree``: (wall s, CPU s of make and its children, sha256 per figure file)."""
    env = {**_env(), "PYTHONPATH": str(tree / "src")}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    # the tree's own `make figures` recipe with this interpreter's environment (STAMP= skips the install check)
    res = subprocess.run(["make", "figures", f"VENV={Path(sys.executable).parent.parent}", "STAMP="], cwd=tree,
                         env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if res.returncode != 0:
        raise SystemExit(f"make figures failed in {tree}:\n{res.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, figure_hashes(tree)


def make_figures(refs: list[str], repeats: int) -> list[str]:
    lines = [f"{'ref':10} {'files':>5} {'median s':>9} {'min s':>7} {'CPU s':>7}  reruns identical  = committed"]
    with tempfile.TemporaryDirectory(prefix="bench_figures_") as tmp:
        trees, committed, runs = {}, {}, {ref: [] for ref in refs}
        for ref in refs:
            tree = Path(tmp) / ref.replace("/", "_")
            trees[ref] = (fresh_tree(ref, tree), tree)
            committed[ref] = figure_hashes(tree)
        for i in range(repeats):
            for ref in refs:
                wall, cpu, hashes = make_figures_once(trees[ref][1])
                runs[ref].append((wall, cpu, hashes))
                print(f"  {ref} run {i + 1}: {wall:.1f} s wall, {cpu:.1f} s CPU", flush=True)
        for ref in refs:
            walls = [w for w, _, _ in runs[ref]]
            cpus = [c for _, c, _ in runs[ref]]
            hashes = [h for _, _, h in runs[ref]]
            same = all(h == hashes[0] for h in hashes)
            differ = sorted(k for k in hashes[0] if committed[ref].get(k) != hashes[0][k])
            lines.append(f"{trees[ref][0]:10} {len(hashes[0]):5} {statistics.median(walls):9.1f} {min(walls):7.1f} "
                         f"{statistics.median(cpus):7.1f}  {'yes' if same else 'NO':>16}  "
                         f"{'yes' if not differ else f'no ({len(differ)} files differ)'}")
            print(lines[-1], flush=True)
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="results/bench/workflow.txt")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--figures-refs", default="HEAD",
                   help="comma-separated git refs whose committed trees `make figures` is timed in (default HEAD)")
    p.add_argument("--figures-only", action="store_true", help="skip the dry runs")
    args = p.parse_args(argv)
    day = time.strftime("%Y-%m-%d")
    cpu = cpu_kernels()["model"]  # the times depend on it: records before 2026-12-06 did not name it
    lines = []
    if not args.figures_only:
        lines += [f"# Snakemake dry-run wall time ({day}; {cpu}; median of {args.repeats}; goal paper <= 5 s)",
                  *dry_runs(args.repeats), ""]
    refs = [r for r in args.figures_refs.split(",") if r]
    load_before = os.getloadavg()[1]
    table = make_figures(refs, args.repeats)
    # other jobs share the machine: their load (5-min average, runnable processes) says how far these times are
    # from an idle machine's
    lines += [f"# make figures from a fresh clone (git archive of each ref; {day}; {args.repeats} runs each, in "
              f"turns; {os.cpu_count()} CPUs ({cpu}), shared: 5-min load average {load_before:.1f} before, "
              f"{os.getloadavg()[1]:.1f} after; goal <= 15 s)", *table]
    atomic_write_text(args.out, "\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
