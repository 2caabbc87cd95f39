"""Tables of a mismatch-stress sweep (configs/stress.yaml): one row per run, Kaplan-Meier survival per
(variant, dose), and the share of the bf16 mismatch gap each variant closes.

Reads the same per-run files as ``roundalign.analysis.aggregate`` (``R/runs/{model}/{variant}/seed{N}/run.json`` and
``metrics.jsonl``) and writes, next to its tables::

    stress_runs.csv      sweep,model,base,dose,variant,seed,status,last_step,event,event_kind,event_step,time,
                         reward_collapse_step, grad_norm_collapse_step (each detector's own first step, any order),
                         <per-run means of the mismatch metrics>, verl_violation_frac, reward_first, reward_last
    stress_survival.csv  variant,dose,time,num_at_risk,num_events,survival,ci_low,ci_high
    stress_gap.csv       base,dose,variant,gap_metric,num_runs,delta,delta_baseline,delta_floor,gap,gap_ci_low,
                         gap_ci_high,has_gap,share_closed,share_ci_low,share_ci_high

Definitions:

- A run's event is its ``collapse_event`` (``roundalign.training.train.collapse_event``: the first of a non-finite
  collapse, a reward collapse or a grad-norm collapse, with thresholds fixed in the sweep config before any run).
  ``time`` is the event step, or ``last_step`` for a run without one (right-censored).
- Survival: the Kaplan-Meier product-limit estimator S(t) = prod_{t_i <= t} (1 - d_i / n_i) over the distinct
  event times t_i (d_i events among n_i runs still at risk, censored runs leave the risk set after their time),
  with Greenwood's variance Var S(t) = S(t)^2 sum_{t_i <= t} d_i / (n_i (n_i - d_i)) and a pointwise 95% band
  on the log(-log S) scale (Kalbfleisch & Prentice), which stays inside [0, 1]. The estimate and Greenwood's
  standard error come from statsmodels (``statsmodels.duration.survfunc.SurvfuncRight``; lifelines 0.30.3
  requires pandas < 3, which conflicts with the pinned pandas); ``tests/test_stress.py`` checks the table
  against a hand count.
- Share of gap closed, per (base model, dose, variant): delta = mean over seeds of the run's mean over steps of
  ``gap_metric`` (default: mean |logp_train - logp_engine| per token, nats); gap = delta_baseline - delta_floor with
  the floor the fp32 arm; share = (delta_baseline - delta) / gap. 1 = as on-policy as fp32 on both sides, 0 = no
  better than baseline, < 0 worse. Intervals are 95% percentile intervals of a seed bootstrap: each arm's runs
  are resampled with replacement, independently of the other arms (runs of different arms are separate
  trainings), ``num_resamples`` times from ``default_rng(seed)``, the same draws for every (base, dose), so the
  table is identical run to run. ``has_gap`` is false when the gap's interval reaches 0 (or the gap is not
  positive): the baseline is then not distinguishable from the floor, there is no gap to close, and share_closed
  and its interval are NaN, since a ratio over a denominator indistinguishable from 0 is noise (fp8_e4m3 of the
  committed stress sweep: gap 0.0024 nats, interval -0.0027..0.0086, point shares down to -2.6).
- ``verl_violation_frac``: fraction of the run's steps with ``health/verl_any`` = 1 (verl's rollout-correction
  health checks, ``roundalign.metrics.verl_health_flags``).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pandas as pd

from roundalign.analysis.aggregate import _BadFile, read_metrics, read_run_json
from roundalign.io import atomic_write_csv

# per-run means over steps of these metrics.jsonl keys go into stress_runs.csv (column = key with / -> _)
RUN_MEAN_METRICS = (
    "mismatch/token/logp_abs_diff_mean",
    "mismatch/token/logp_diff_rms",
    "mismatch/token/k3",
    "mismatch/token/k1",
    "mismatch/token/chi2",
    "mismatch/token/token_mult_prob_error",
    "mismatch/seq/logp_abs_diff_mean",
    "mismatch/token/tokens_exact_frac",
)
STRESS_FILES = {"stress_runs": "stress_runs.csv", "stress_survival": "stress_survival.csv",
                "stress_gap": "stress_gap.csv"}
_SEED = re.compile(r"seed(\d+)")
_Z95 = 1.959963984540054


def _col(key: str) -> str:
    return key.replace("/", "_")


def read_stress_runs(results_root: str | Path, dose_key: str, sweep: str | None = None) -> pd.DataFrame:
    """One row per run under ``results_root/runs`` (bad or unfinished files are skipped, as aggregate does)."""
    root = Path(results_root)
    sweep = sweep or root.name
    rows = []
    for run_json in sorted(root.glob("runs/*/*/seed*/run.json")):
        seed_dir, variant_dir, model_dir = run_json.parent, run_json.parent.parent, run_json.parent.parent.parent
        m = _SEED.fullmatch(seed_dir.name)
        if not m:
            continue
        try:
            rec = read_run_json(run_json)
            metrics = read_metrics(seed_dir / "metrics.jsonl")
        except _BadFile:
            continue
        cfg = rec.get("config") or {}
        ev = rec.get("collapse_event")
        last = rec.get("last_step") or (metrics[-1]["step"] if metrics else 0)
        row = {"sweep": sweep, "model": model_dir.name, "base": _base_name(cfg.get("model"), model_dir.name),
               "dose": cfg.get(dose_key), "variant": variant_dir.name, "seed": int(m.group(1)),
               "status": rec.get("status"), "last_step": last, "event": int(ev is not None),
               "event_kind": ev["kind"] if ev else "", "event_step": ev["step"] if ev else math.nan,
               "time": ev["step"] if ev else last,
               "reward_collapse_step": (rec.get("reward_collapse") or {}).get("step", math.nan),
               "grad_norm_collapse_step": (rec.get("grad_norm_collapse") or {}).get("step", math.nan)}
        for key in RUN_MEAN_METRICS:
            vals = [r[key] for r in metrics if r.get(key) is not None]
            row[_col(key)] = float(np.mean(vals)) if vals else math.nan
        flags = [r["health/verl_any"] for r in metrics if r.get("health/verl_any") is not None]
        row["verl_violation_frac"] = float(np.mean(flags)) if flags else math.nan
        rewards = [r["reward/mean"] for r in metrics if r.get("reward/mean") is not None]
        k = max(1, len(rewards) // 10)
        row["reward_first"] = float(np.mean(rewards[:k])) if rewards else math.nan
        row["reward_last"] = float(np.mean(rewards[-k:])) if rewards else math.nan
        rows.append(row)
    cols = ["sweep", "model", "base", "dose", "variant", "seed", "status", "last_step", "event", "event_kind",
            "event_step", "time", "reward_collapse_step", "grad_norm_collapse_step",
            *[_col(k) for k in RUN_MEAN_METRICS], "verl_violation_frac", "reward_first",
            "reward_last"]
    df = pd.DataFrame(rows, columns=cols)
    return df.sort_values(["base", "dose", "variant", "seed", "model"], kind="stable").reset_index(drop=True)


def _base_name(model_path, fallback: str) -> str:
    """The warm-started policy a run trained (``.../models/tiny/<base>/policy`` in the sweep's layout)."""
    parts = str(model_path or "").rstrip("/").split("/")
    return parts[-2] if len(parts) >= 2 and parts[-1] == "policy" else fallback


def kaplan_meier(time, event) -> pd.DataFrame:
    """Kaplan-Meier estimate with Greenwood's variance (statsmodels' ``SurvfuncRight``) and a log(-log) 95% band.

    Args: ``time`` (n,) event or censoring step; ``event`` (n,) 1 = event at ``time``, 0 = censored there.
    Returns one row per distinct event time (plus t = 0): time, num_at_risk, num_events, survival, ci_low,
    ci_high. Censoring at the same time as an event counts the censored run as at risk at that time (the usual
    convention)."""
    from statsmodels.duration.survfunc import SurvfuncRight  # noqa: PLC0415 -- lazy: statsmodels, off analysis.plots

    t = np.asarray(time, dtype=float)
    e = np.asarray(event, dtype=int)
    rows = [{"time": 0.0, "num_at_risk": len(t), "num_events": 0, "survival": 1.0, "ci_low": 1.0, "ci_high": 1.0}]
    if not e.any():
        return pd.DataFrame(rows)
    sf = SurvfuncRight(t, e)
    for ti, n, d, s, se_s in zip(sf.surv_times, sf.n_risk, sf.n_events, sf.surv_prob, sf.surv_prob_se):
        if 0 < s < 1 and np.isfinite(se_s):
            # Greenwood: se(S) = S sqrt(gw); the log(-log S) band: se = sqrt(gw) / |log S|, S^exp(+-z se)
            se = se_s / s / abs(math.log(s))
            lo, hi = s ** math.exp(_Z95 * se), s ** math.exp(-_Z95 * se)
        else:
            lo, hi = (0.0, 0.0) if s == 0 else (s, s)
        rows.append({"time": float(ti), "num_at_risk": int(n), "num_events": int(d), "survival": float(s),
                     "ci_low": float(lo), "ci_high": float(hi)})
    return pd.DataFrame(rows)


def survival_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Kaplan-Meier per (variant, dose), pooling base models and seeds."""
    out = []
    for (variant, dose), g in runs.groupby(["variant", "dose"], sort=True):
        km = kaplan_meier(g["time"], g["event"])
        km.insert(0, "dose", dose)
        km.insert(0, "variant", variant)
        out.append(km)
    cols = ["variant", "dose", "time", "num_at_risk", "num_events", "survival", "ci_low", "ci_high"]
    return pd.concat(out, ignore_index=True)[cols] if out else pd.DataFrame(columns=cols)


GAP_COLUMNS = ["base", "dose", "variant", "gap_metric", "num_runs", "delta", "delta_baseline", "delta_floor", "gap",
               "gap_ci_low", "gap_ci_high", "has_gap", "share_closed", "share_ci_low", "share_ci_high"]
NUM_RESAMPLES = 2000  # seed-bootstrap resamples of the gap and share intervals
BOOT_SEED = 0


def gap_table(runs: pd.DataFrame, gap_metric: str, floor: str = "fp32", *, num_resamples: int = NUM_RESAMPLES,
              seed: int = BOOT_SEED, level: float = 95.0) -> pd.DataFrame:
    """Share of the baseline-to-floor mismatch gap each variant closes, per (base, dose), with seed-bootstrap
    intervals (see the module docstring). ``runs``: one row per run with base, dose, variant and the gap metric's
    column; returns the columns ``GAP_COLUMNS``."""
    col = _col(gap_metric)
    q = [(100 - level) / 2, 100 - (100 - level) / 2]
    rows = []
    for (base, dose), g in runs.groupby(["base", "dose"], sort=True):
        arms = {v: a[col].to_numpy(dtype="float64") for v, a in g.groupby("variant", sort=True)}
        arms = {v: x[np.isfinite(x)] for v, x in arms.items()}
        rng = np.random.default_rng(seed)
        # (num_resamples,) bootstrap means per arm, arms drawn one after the other in sorted order
        boot = {v: (x[rng.integers(0, len(x), size=(num_resamples, len(x)))].mean(axis=1) if len(x)
                    else np.full(num_resamples, np.nan)) for v, x in arms.items()}
        delta = {v: float(x.mean()) if len(x) else math.nan for v, x in arms.items()}
        d_base, d_floor = delta.get("baseline", math.nan), delta.get(floor, math.nan)
        gap = d_base - d_floor
        if "baseline" in boot and floor in boot:
            boot_gap = boot["baseline"] - boot[floor]
            gap_lo, gap_hi = np.percentile(boot_gap, q) if np.isfinite(boot_gap).all() else (math.nan, math.nan)
        else:
            boot_gap, gap_lo, gap_hi = None, math.nan, math.nan
        has_gap = bool(gap > 0 and gap_lo > 0)
        for variant, d in delta.items():
            share = lo = hi = math.nan
            if has_gap:
                share = (d_base - d) / gap
                with np.errstate(divide="ignore", invalid="ignore"):
                    boot_share = np.where(boot_gap > 0, (boot["baseline"] - boot[variant]) / boot_gap, np.nan)
                lo, hi = np.nanpercentile(boot_share, q)
            rows.append({"base": base, "dose": dose, "variant": variant, "gap_metric": gap_metric,
                         "num_runs": len(arms[variant]), "delta": d, "delta_baseline": d_base, "delta_floor": d_floor,
                         "gap": gap, "gap_ci_low": float(gap_lo), "gap_ci_high": float(gap_hi), "has_gap": has_gap,
                         "share_closed": share, "share_ci_low": float(lo), "share_ci_high": float(hi)})
    return pd.DataFrame(rows, columns=GAP_COLUMNS)


def _frozen(df: pd.DataFrame) -> pd.DataFrame:
    """Floats as repr (shortest round trip), NaN empty: reruns give identical bytes."""
    out = df.copy()
    for c in out.columns:
        if out[c].dtype.kind == "f":
            out[c] = ["" if (v is None or math.isnan(v)) else repr(float(v)) for v in out[c]]
    return out


def derived_tables(runs: pd.DataFrame, gap_metric: str, floor: str = "fp32") -> dict[str, pd.DataFrame]:
    """The tables computed from ``stress_runs`` alone: survival and share of gap."""
    return {"stress_survival": survival_table(runs), "stress_gap": gap_table(runs, gap_metric, floor)}


def write_stress_tables(results_root: str | Path, out_dir: str | Path, dose_key: str, floor: str = "fp32",
                        gap_metric: str = "mismatch/token/logp_abs_diff_mean", sweep: str | None = None,
                        log=print) -> dict[str, Path]:
    runs = read_stress_runs(results_root, dose_key, sweep)
    tables = {"stress_runs": runs, **derived_tables(runs, gap_metric, floor)}
    paths = _write(tables, out_dir)
    log(f"[aggregate] stress: {len(runs)} runs, {int(runs['event'].sum()) if len(runs) else 0} with a collapse "
        f"event -> " + ", ".join(str(p) for p in paths.values()))
    return paths


def rewrite_derived_tables(aggregate_dir: str | Path, floor: str = "fp32",
                           gap_metric: str = "mismatch/token/logp_abs_diff_mean", log=print) -> dict[str, Path]:
    """Recompute stress_survival.csv and stress_gap.csv from the committed stress_runs.csv: what
    ``write_stress_tables`` would write, for a sweep whose raw per-run files are not at hand (results/stress/runs
    is not committed). stress_runs.csv stores floats as repr, so the values read back are the ones aggregated.

        python -c "from roundalign.analysis.stress import rewrite_derived_tables as r; r('results/stress/aggregate')"
    """
    aggregate_dir = Path(aggregate_dir)
    runs = pd.read_csv(aggregate_dir / STRESS_FILES["stress_runs"])
    paths = _write(derived_tables(runs, gap_metric, floor), aggregate_dir)
    log(f"[aggregate] stress: {len(runs)} runs from {aggregate_dir / STRESS_FILES['stress_runs']} -> "
        + ", ".join(str(p) for p in paths.values()))
    return paths


def _write(tables: dict[str, pd.DataFrame], out_dir: str | Path) -> dict[str, Path]:
    out_dir = Path(out_dir)
    paths = {}
    for name, df in tables.items():
        paths[name] = out_dir / STRESS_FILES[name]
        atomic_write_csv(_frozen(df), paths[name])
    return paths
