"""Per-run result files of a sweep -> four tidy long tables, and a fifth where the sweep attributes its mismatch
(the bmi pattern: one file per run, one gather).

Reads, under a results root ``R`` (e.g. ``results/smoke``)::

    R/runs/{model}/{variant}/seed{seed}/metrics.jsonl   one JSON object per optimizer step
    R/runs/{model}/{variant}/seed{seed}/run.json        status, collapse, versions, ...
    R/probe/{model}/{engine}.csv                        model,engine,variant,level,metric,value
    R/probe/{model}/{engine}_layers.csv                 model,engine,variant,layer,metric,value
    R/attribution/{model}/{engine}/attribution.csv      step,source,mode,metric,value,ci_low,ci_high

and writes, atomically, into ``out_dir`` (``R/aggregate`` by convention)::

    runs.csv          sweep,model,variant,seed,step,metric,value,status      one row per (run, step, metric)
    run_status.csv    sweep,model,variant,seed,status,last_step,...          one row per run; its heldout_initial and
                      heldout_final columns (with _ci_low/_ci_high) are the policy's held-out reward before step 1
                      and after the last (roundalign.training.heldout), empty where the run did not measure it
    probe.csv         sweep,model,engine,variant,level,metric,value
    probe_layers.csv  sweep,model,engine,variant,layer,metric,value
    attribution.csv   sweep,model,engine,step,source,mode,metric,value,ci_low,ci_high   (only where R/attribution/
                      holds a table: the attribution's rows as ``roundalign attribute`` wrote them, each model and
                      engine's in its own order, models and engines sorted; no table, no file, and a stale one removed)

Conventions:

- ``model``/``variant``/``seed`` (and, for probes, ``model``/``engine``) come from the path, which is what
  the sweep declared; a run.json (variant, seed, model) or probe CSV (engine) that says otherwise only
  produces a warning. run.json's ``model`` is a directory or hub id: it agrees when one of its path
  components is the path's model name. The probe CSV's own ``model`` label is replaced by the path's.
- A JSON ``null`` metric value is kept as an empty ``value`` (NaN): a non-finite loss logged as null is
  evidence of a collapse, not a missing key. Keys that are absent at a step produce no row.
- Collapsed, preempted, failed and running runs are kept; ``status`` marks them.
- An attribution's ``model``/``engine`` come from its path (``roundalign attribute`` writes neither).
- A bad file (missing run.json or metrics.jsonl, a line that is not a JSON object with an integer
  ``step``, a step logged twice, a non-numeric value, an unreadable CSV, missing columns) is named with
  the reason. ``strict=True`` raises one ValueError naming every bad file; otherwise the run or probe
  file is skipped and one warning lists every skipped file.
- Output bytes depend only on the input files: rows are sorted, floats are written with ``repr`` (the
  shortest string that reads back to the same float), NaN as an empty field.

This module knows nothing about figures (``roundalign.analysis.plots`` reads the tables written here).
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from roundalign.io import atomic_write_csv

RUNS_COLUMNS = ("sweep", "model", "variant", "seed", "step", "metric", "value", "status")
RUN_STATUS_COLUMNS = ("sweep", "model", "variant", "seed", "status", "last_step", "collapse_step",
                      "collapse_reason", "reward_collapse_step", "wall_time_s", "git_sha", "torch_version",
                      "transformers_version", "trl_version", "gpu_name", "cpu_kernels", "attn", "policy",
                      *(f"heldout_{when}{part}" for when in ("initial", "final") for part in ("", "_ci_low", "_ci_high")))
PROBE_COLUMNS = ("sweep", "model", "engine", "variant", "level", "metric", "value")
PROBE_LAYERS_COLUMNS = ("sweep", "model", "engine", "variant", "layer", "metric", "value")
ATTRIBUTION_COLUMNS = ("sweep", "model", "engine", "step", "source", "mode", "metric", "value", "ci_low", "ci_high")
OUTPUT_FILES = {"runs": "runs.csv", "run_status": "run_status.csv", "probe": "probe.csv",
                "probe_layers": "probe_layers.csv"}
ATTRIBUTION_FILE = "attribution.csv"  # written only where the sweep has attributions
STATUSES = ("done", "collapsed", "preempted", "failed", "running")

_SEED_DIR = re.compile(r"seed(\d+)")


@dataclass
class Aggregate:
    """The four tables, the attribution table where there is one, and what was skipped.

    Attributes:
        runs, run_status, probe, probe_layers: tables with the columns ``*_COLUMNS`` above, sorted.
        attribution: ``ATTRIBUTION_COLUMNS``, sorted by model and engine (stable: each attribution's rows in its
            own order); None when the results hold no attribution.
        skipped: ``(path, reason)`` of every bad file, sorted by path (its run or probe file left out).
        warnings: messages about files that were read but disagree with their path.
    """

    runs: pd.DataFrame
    run_status: pd.DataFrame
    probe: pd.DataFrame
    probe_layers: pd.DataFrame
    attribution: pd.DataFrame | None = None
    skipped: list[tuple[str, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def num_runs(self) -> int:
        return len(self.run_status)


class _BadFile(Exception):
    def __init__(self, path: Path, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


def _same_model(path_model: str, recorded) -> bool:
    """run.json records the model as a directory or hub id: the sweep's policy directory
    (``.../models/<source>/<model>/policy``), a tiny model's directory, or ``Org/Name``. It agrees with the
    path's model name when that name is one of its path components (case-insensitive)."""
    if recorded is None:
        return True
    want = path_model.lower()
    recorded = str(recorded).rstrip("/").lower()
    return want in recorded.split("/") or want == recorded.replace("/", "--")


class _BadRun(Exception):
    """Every bad file of one run (both run.json and metrics.jsonl may be bad)."""

    def __init__(self, errors: list[_BadFile]):
        super().__init__("; ".join(map(str, errors)))
        self.errors = errors


def _is_number(v) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))


def read_metrics(path: Path) -> list[dict]:
    """Parse a metrics.jsonl; raise _BadFile naming the first bad line (1-based). Blank lines are allowed."""
    records, seen = [], set()
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise _BadFile(path, "missing") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise _BadFile(path, f"unreadable ({exc})") from None
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            # a run killed mid-write leaves a truncated last line; name it as such
            last = n == len(text.splitlines()) and not text.endswith("\n")
            raise _BadFile(path, f"line {n}: {'truncated' if last else 'invalid'} JSON ({exc.msg})") from None
        if not isinstance(rec, dict):
            raise _BadFile(path, f"line {n}: expected a JSON object, got {type(rec).__name__}")
        step = rec.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            raise _BadFile(path, f"line {n}: missing or non-integer 'step' ({step!r})")
        if step in seen:
            raise _BadFile(path, f"line {n}: step {step} logged twice")
        seen.add(step)
        bad = sorted(k for k, v in rec.items() if not _is_number(v))
        if bad:
            raise _BadFile(path, f"line {n}: non-numeric value for {', '.join(bad)}")
        records.append(rec)
    return records


def read_run_json(path: Path) -> dict:
    try:
        rec = json.loads(path.read_text())
    except FileNotFoundError:
        raise _BadFile(path, "missing") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise _BadFile(path, f"unreadable ({exc})") from None
    except json.JSONDecodeError as exc:
        raise _BadFile(path, f"invalid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(rec, dict):
        raise _BadFile(path, f"expected a JSON object, got {type(rec).__name__}")
    if rec.get("status") not in STATUSES:
        raise _BadFile(path, f"status {rec.get('status')!r} is not one of {', '.join(STATUSES)}")
    return rec


def _step_of(event, path: Path, key: str):
    if event is None:
        return None
    if not isinstance(event, dict) or not isinstance(event.get("step"), int):
        raise _BadFile(path, f"{key!r} must be null or an object with an integer 'step', got {event!r}")
    return event["step"]


def _read_run(run_dir: Path, sweep: str, model: str, variant: str, seed: int, warnings: list[str]):
    """One run -> (status row, metric rows). Reads run.json first: a present run.json marks a complete export."""
    run_json = run_dir / "run.json"
    errors, rec, records = [], None, None
    try:
        rec = read_run_json(run_json)
    except _BadFile as exc:
        errors.append(exc)
    try:
        records = read_metrics(run_dir / "metrics.jsonl")
    except _BadFile as exc:
        errors.append(exc)
    if errors:
        raise _BadRun(errors)
    disagree = [f"{k}={rec.get(k)!r}" for k, want in (("variant", variant), ("seed", seed))
                if rec.get(k) is not None and rec.get(k) != want]
    if not _same_model(model, rec.get("model")):
        disagree.append(f"model={rec.get('model')!r}")
    if disagree:
        warnings.append(f"{run_json}: {', '.join(disagree)} disagree(s) with the path; the path wins")
    status = rec["status"]
    collapse = rec.get("collapse")
    versions = rec.get("versions") or {}
    status_row = {
        "sweep": sweep, "model": model, "variant": variant, "seed": seed, "status": status,
        "last_step": rec.get("last_step"), "collapse_step": _step_of(collapse, run_json, "collapse"),
        "collapse_reason": collapse.get("reason") if isinstance(collapse, dict) else None,
        "reward_collapse_step": _step_of(rec.get("reward_collapse"), run_json, "reward_collapse"),
        "wall_time_s": rec.get("wall_time_s"), "git_sha": rec.get("git_sha"),
        "torch_version": versions.get("torch"), "transformers_version": versions.get("transformers"),
        "trl_version": versions.get("trl"), "gpu_name": rec.get("gpu_name"),
        # the CPU kernels the run was computed with (roundalign.envinfo.cpu_kernels), as compact JSON: sweeps that
        # commit only their aggregate (the stress sweep) keep in it what a bitwise rerun must match
        "cpu_kernels": None if rec.get("cpu_kernels") is None
        else json.dumps(rec["cpu_kernels"], sort_keys=True, separators=(",", ":")),
        # the trainer's attention (a sweep may vary it per model entry: the attention axis of the vllm-cpu sweep)
        # and the policy it trained (the model directory's name: entries with ``base:`` share their base's), so
        # that arms differing only in attention can be paired
        "attn": (rec.get("config") or {}).get("attn"),
        "policy": _policy_name((rec.get("config") or {}).get("model") or rec.get("model")),
        # learning against the initial policy: held-out reward before step 1 and after the last (training/heldout.py);
        # empty for a run without the evaluation (or, for heldout_final, one that did not finish)
        **{f"heldout_{when}{part}": (rec.get(f"heldout_{when}") or {}).get(key)
           for when in ("initial", "final") for part, key in (("", "reward"), ("_ci_low", "ci_low"),
                                                              ("_ci_high", "ci_high"))},
    }
    rows = [(sweep, model, variant, seed, r["step"], k, math.nan if v is None else float(v), status)
            for r in records for k, v in r.items() if k != "step"]
    return status_row, rows


def _policy_name(model) -> str | None:
    """``work/models/tiny/<name>/policy`` -> ``<name>``; another path or a hub id as it is."""
    if not isinstance(model, str):
        return None
    p = Path(model)
    return p.parent.name if p.name == "policy" and p.parent.name else model


def _real_engine_probe(meta: Path) -> bool:
    """The probe JSON beside a probe table says it sampled with real vLLM (``probe --backend vllm``)."""
    try:
        return json.loads(meta.read_text()).get("backend") == "vllm"
    except (OSError, ValueError, AttributeError):
        return False


def _read_table(path: Path, need: list[str]) -> pd.DataFrame:
    """A per-job CSV as strings, with its columns checked; a missing, unreadable or ill-shaped file is a _BadFile."""
    try:
        df = pd.read_csv(path, dtype=str, keep_default_na=False)
    except FileNotFoundError:
        raise _BadFile(path, "missing") from None
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, OSError) as exc:
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise _BadFile(path, f"unreadable CSV ({first_line})") from None
    missing = [c for c in need if c not in df.columns]
    if missing:
        raise _BadFile(path, f"wrong columns: missing {', '.join(missing)} (has {', '.join(map(str, df.columns))}; "
                             f"expected {', '.join(need)})")
    return df


def _numeric(path: Path, df: pd.DataFrame, col: str) -> pd.Series:
    """Column ``col`` as numbers ("" and "nan" are NaN); any other non-number is a _BadFile naming its row."""
    num = pd.to_numeric(df[col].replace("", "nan"), errors="coerce")
    bad = df[col][num.isna() & ~df[col].str.lower().isin(["", "nan"])]
    if len(bad):
        raise _BadFile(path, f"non-numeric {col} {bad.iloc[0]!r} (row {bad.index[0] + 2})")
    return num


def _read_probe_csv(path: Path, kind_columns: tuple[str, ...], sweep: str, model: str, engine: str,
                    warnings: list[str], own_engine: str | None = None) -> pd.DataFrame:
    """One probe table, labelled ``engine``; ``own_engine`` (default ``engine``) is what its engine column should say."""
    df = _read_table(path, [c for c in kind_columns if c != "sweep"])
    value = _numeric(path, df, "value")
    if "layer" in kind_columns:
        layer = pd.to_numeric(df["layer"], errors="coerce")
        if layer.isna().any() or (layer != layer.round()).any():
            raise _BadFile(path, "non-integer 'layer'")
        df["layer"] = layer.astype("int64")
    # only the engine is checked: the probe's model column is a label (the model directory's name, which
    # is "policy" for every model of a sweep), so the path's model name is the identity
    others = sorted(set(df["engine"]) - {own_engine or engine})
    if others:
        warnings.append(f"{path}: engine {', '.join(map(repr, others))} disagree(s) with the path; the path wins")
    df = df.assign(sweep=sweep, model=model, engine=engine, value=value.astype("float64"))
    return df[list(kind_columns)]


_ATTRIBUTION_NUMERIC = ("value", "ci_low", "ci_high")


def _read_attribution_csv(path: Path, sweep: str, model: str, engine: str) -> pd.DataFrame:
    """One ``roundalign attribute`` table, labelled with the sweep and its path's model and engine."""
    df = _read_table(path, [c for c in ATTRIBUTION_COLUMNS if c not in ("sweep", "model", "engine")])
    out = {col: _numeric(path, df, col).astype("float64") for col in _ATTRIBUTION_NUMERIC}
    step = pd.to_numeric(df["step"], errors="coerce")
    if step.isna().any() or (step != step.round()).any():
        raise _BadFile(path, "non-integer 'step'")
    df = df.assign(sweep=sweep, model=model, engine=engine, step=step.astype("int64"), **out)
    return df[list(ATTRIBUTION_COLUMNS)]


def _bad(skipped: list, exc: _BadFile) -> None:
    skipped.append((str(exc.path), exc.reason))


def collect(results_root: str | Path, sweep: str | None = None) -> Aggregate:
    """Read every run and probe file under ``results_root`` (nothing is written). ``sweep`` defaults to the
    root's directory name. Raises FileNotFoundError when the root, or both its runs/ and probe/, are missing."""
    root = Path(results_root)
    if not root.is_dir():
        raise FileNotFoundError(f"results root {root} does not exist (or is not a directory)")
    runs_dir, probe_dir, attribution_dir = root / "runs", root / "probe", root / "attribution"
    if not runs_dir.is_dir() and not probe_dir.is_dir():
        raise FileNotFoundError(f"neither {runs_dir} nor {probe_dir} exists: nothing to aggregate")
    sweep = sweep or root.resolve().name
    skipped: list[tuple[str, str]] = []
    warnings: list[str] = []
    status_rows, metric_rows = [], []
    for run_dir in sorted(runs_dir.glob("*/*/seed*")) if runs_dir.is_dir() else []:
        match = _SEED_DIR.fullmatch(run_dir.name)
        if not run_dir.is_dir() or not match:
            continue  # e.g. a stray log file; only seed<N> directories are runs
        variant_dir = run_dir.parent
        try:
            status_row, rows = _read_run(run_dir, sweep, variant_dir.parent.name, variant_dir.name,
                                         int(match.group(1)), warnings)
        except _BadRun as exc:
            for err in exc.errors:
                _bad(skipped, err)
            continue
        except _BadFile as exc:  # a malformed collapse record in run.json
            _bad(skipped, exc)
            continue
        status_rows.append(status_row)
        metric_rows.extend(rows)

    probes, layers = [], []
    for path in sorted(probe_dir.glob("*/*.csv")) if probe_dir.is_dir() else []:
        if path.stem.endswith("_engine_layers") and _real_engine_probe(path.with_name(
                path.stem[: -len("_engine_layers")] + ".json")):
            # probe --backend vllm, eager: the emulated engine against the real one per layer (no variant: it
            # compares two engines, not an alignment); scripts read it directly, no aggregate table holds it
            continue
        is_layers = path.stem.endswith("_layers")
        engine = path.stem[: -len("_layers")] if is_layers else path.stem
        if is_layers and _real_engine_probe(path.parent / f"{engine}.json"):
            # probe --backend vllm: <engine>_layers.csv is the trainer against the EMULATED engine (the real one's
            # layers are <engine>_teacher_forced_layers.csv), named like its token table <engine>_emulated.csv
            engine += "_emulated"
        # a real-engine probe's other tables (<engine>_emulated, <engine>_teacher_forced[_layers]) carry the
        # engine's own name inside: that agrees with the path
        own = next((engine[: -len(sfx)] for sfx in ("_emulated", "_teacher_forced") if engine.endswith(sfx)
                    and _real_engine_probe(path.parent / f"{engine[: -len(sfx)]}.json")), engine)
        try:
            df = _read_probe_csv(path, PROBE_LAYERS_COLUMNS if is_layers else PROBE_COLUMNS, sweep,
                                 path.parent.name, engine, warnings, own)
        except _BadFile as exc:
            _bad(skipped, exc)
            continue
        (layers if is_layers else probes).append(df)

    attributions = []
    for path in sorted(attribution_dir.glob("*/*/attribution.csv")) if attribution_dir.is_dir() else []:
        try:
            attributions.append(_read_attribution_csv(path, sweep, path.parent.parent.name, path.parent.name))
        except _BadFile as exc:
            _bad(skipped, exc)

    runs = pd.DataFrame(metric_rows, columns=list(RUNS_COLUMNS))
    runs = runs.astype({"seed": "int64", "step": "int64", "value": "float64"})
    run_status = pd.DataFrame(status_rows, columns=list(RUN_STATUS_COLUMNS))
    return Aggregate(
        runs=_sorted(runs, ["model", "variant", "seed", "step", "metric"]),
        run_status=_sorted(run_status, ["model", "variant", "seed"]),
        probe=_sorted(_concat(probes, PROBE_COLUMNS), ["model", "engine", "variant", "level", "metric"]),
        probe_layers=_sorted(_concat(layers, PROBE_LAYERS_COLUMNS), ["model", "engine", "variant", "metric", "layer"]),
        attribution=_sorted(_concat(attributions, ATTRIBUTION_COLUMNS), ["model", "engine"]) if attributions else None,
        skipped=sorted(skipped), warnings=sorted(warnings))


def _concat(frames: list[pd.DataFrame], columns) -> pd.DataFrame:
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=list(columns))


def _sorted(df: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    # a stable sort on every key column makes row order independent of file system listing order
    return df.sort_values(keys, kind="stable").reset_index(drop=True)


def _format_float(v) -> str:
    v = float(v)
    return "" if math.isnan(v) else repr(v)


def _for_csv(df: pd.DataFrame) -> pd.DataFrame:
    """Freeze the text of every float column (repr: shortest round-trip, so reruns give the same bytes)."""
    out = df.copy()
    for col in out.columns:
        if col in ("seed", "step", "layer", "last_step", "collapse_step", "reward_collapse_step"):
            out[col] = [("" if v is None or (isinstance(v, float) and math.isnan(v)) else str(int(v)))
                        for v in out[col]]
        elif col in ("value", "wall_time_s", "ci_low", "ci_high"):
            out[col] = [("" if v is None else _format_float(v)) for v in out[col]]
    return out


def write_aggregate(agg: Aggregate, out_dir: str | Path) -> dict[str, Path]:
    """Write the four tables into ``out_dir`` (each atomically), and attribution.csv where there is an attribution
    table (else an attribution.csv left there by an earlier aggregate is removed: the directory says what the
    results hold). Returns {table name: path}."""
    out_dir = Path(out_dir)
    paths = {}
    for name, file_name in OUTPUT_FILES.items():
        paths[name] = out_dir / file_name
        atomic_write_csv(_for_csv(getattr(agg, name)), paths[name])
    if agg.attribution is not None:
        paths["attribution"] = out_dir / ATTRIBUTION_FILE
        atomic_write_csv(_for_csv(agg.attribution), paths["attribution"])
    else:
        (out_dir / ATTRIBUTION_FILE).unlink(missing_ok=True)
    return paths


def format_skipped(skipped: list[tuple[str, str]]) -> str:
    return "\n".join(f"  {path}: {reason}" for path, reason in skipped)


def aggregate(results_root: str | Path, out_dir: str | Path, strict: bool = False, sweep: str | None = None,
              log=print, warn=None, metrics=None) -> Aggregate:
    """Collect ``results_root`` and write the tables into ``out_dir``; print a one-line summary.

    With ``strict`` any bad file raises ValueError naming every bad file (nothing is written); otherwise
    bad files are skipped and one warning (via ``warn``, default: stderr) lists them all. ``metrics`` (keys of
    metrics.jsonl) keeps only those in ``runs.csv``; a key no run logged raises ValueError naming it and the
    keys that exist, before anything is written.
    """
    warn = warn or (lambda msg: print(msg, file=sys.stderr))
    agg = collect(results_root, sweep=sweep)
    if metrics:
        present = set(agg.runs["metric"].unique())
        missing = [m for m in metrics if m not in present]
        if missing:
            raise ValueError(f"--metrics: no run under {results_root} logged {', '.join(missing)}; logged keys: "
                             f"{', '.join(sorted(present))}")
        agg.runs = agg.runs[agg.runs["metric"].isin(list(metrics))].reset_index(drop=True)
    if agg.skipped and strict:
        raise ValueError(f"{len(agg.skipped)} bad file(s) under {results_root} (--strict):\n"
                         + format_skipped(agg.skipped))
    if agg.skipped:
        warn(f"warning: skipped {len(agg.skipped)} bad file(s) under {results_root}:\n" + format_skipped(agg.skipped))
    if agg.warnings:
        warn(f"warning: {len(agg.warnings)} file(s) disagree with their path:\n"
             + "\n".join(f"  {w}" for w in agg.warnings))
    paths = write_aggregate(agg, out_dir)
    num_probe_files = (agg.probe.groupby(["model", "engine"]).ngroups if len(agg.probe) else 0)
    num_attributions = 0 if agg.attribution is None else agg.attribution.groupby(["model", "engine"]).ngroups
    log(f"[aggregate] {agg.num_runs} runs, {num_probe_files} probes, {num_attributions} attributions, "
        f"{len(agg.skipped)} skipped, {len(agg.runs)} run rows, {len(agg.probe)} probe rows, "
        f"{len(agg.probe_layers)} layer rows -> "
        + ", ".join(str(p) for p in paths.values()))
    return agg
