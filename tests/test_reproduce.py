"""The committed results reproduce from the committed code.

Cells of the committed sweeps are rerun from scratch through Snakemake (model build, warm start, training) in a
copy of the workflow, with their committed configs unchanged, and must give the committed metrics exactly
(wall-clock fields aside): one smoke cell per architecture (``results/smoke/runs``) and one stress cell (whose
per-step metrics are committed in ``results/stress/aggregate/runs.csv``). A change to what the pipeline computes
fails here until the committed results are regenerated (README, "Reproducing the committed results").
"""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from roundalign.train import TIMING_KEYS

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ENV = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
SMOKE = [("tiny-qwen25-tied", "full"), ("tiny-qwen3-untied", "baseline")]  # qwen2 and qwen3, tied and untied
STRESS = ("stress-qwen3-untied-fp8e4m3", "full", 1)  # a dose level: reuses the warm start of its base model


def _metrics(path: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS}
            for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def rerun(tmp_path_factory):
    wf = tmp_path_factory.mktemp("wf")
    for name in ("Snakefile", "environment.yml"):
        shutil.copy(ROOT / name, wf / name)
    for name in ("workflow", "configs"):
        shutil.copytree(ROOT / name, wf / name)
    smoke = [f"results/smoke/runs/{m}/{v}/seed0/metrics.jsonl" for m, v in SMOKE]
    model, variant, seed = STRESS
    stress = [f"results/stress/runs/{model}/{variant}/seed{seed}/metrics.jsonl"]
    # the two sweeps at once, one core each
    procs = [subprocess.Popen([sys.executable, "-m", "snakemake", "--cores", "1", *args, "--", *targets], cwd=wf,
                              env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for args, targets in ((["--configfile", "configs/smoke.yaml"], smoke),
                                   (["--configfile", "configs/stress.yaml"], stress))]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    return wf


@pytest.mark.parametrize("model,variant", SMOKE)
def test_a_smoke_cell_rerun_from_scratch_equals_the_committed_run(rerun, model, variant):
    rel = f"results/smoke/runs/{model}/{variant}/seed0"
    got, want = _metrics(rerun / rel / "metrics.jsonl"), _metrics(ROOT / rel / "metrics.jsonl")
    assert len(got) == len(want) == yaml.safe_load((ROOT / "configs/smoke.yaml").read_text())["train"]["steps"]
    for step, (g, w) in enumerate(zip(got, want), start=1):
        assert g == w, (step, {k: (w.get(k), g.get(k)) for k in set(g) | set(w) if g.get(k) != w.get(k)})
    committed = json.loads((ROOT / rel / "run.json").read_text())
    assert not committed["git_sha"].endswith("+dirty"), "committed results must come from committed code"
    assert committed["config"] == json.loads((rerun / rel / "run.json").read_text())["config"]


def test_a_stress_cell_rerun_from_scratch_equals_the_committed_table(rerun):
    model, variant, seed = STRESS
    table = pd.read_csv(ROOT / "results/stress/aggregate/runs.csv")
    want = table[(table.model == model) & (table.variant == variant) & (table.seed == seed)]
    assert len(want) > 0, "the committed stress table has no rows of this cell"
    got = {(r["step"], k): v for r in _metrics(rerun / f"results/stress/runs/{model}/{variant}/seed{seed}/metrics.jsonl")
           for k, v in r.items()}
    diffs = [(row.step, row.metric, row.value, got.get((row.step, row.metric))) for row in want.itertuples()
             if not (got.get((row.step, row.metric)) == row.value
                     or (math.isnan(row.value) and math.isnan(got.get((row.step, row.metric), 0.0))))]
    assert diffs == [], f"{len(diffs)} of {len(want)} committed values differ, first: {diffs[:3]}"
