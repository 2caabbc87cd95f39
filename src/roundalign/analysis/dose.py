"""Tables of the dose experiment (configs/dose.yaml, docs/prereg-dose.md): the probe per dose, and one outcome row per run.

``dose_probe.csv`` (``R/probe/dose_probe.csv``, written before any training):
    dose,variant,metric,value: per dose (the engine's ``dose_bits``, read from each probe's own JSON; 7 = bf16, no
    dose) and trainer variant, the token-level ``k3``, ``logp_abs_diff_mean`` (mean |delta logp|, nats) and
    ``tokens_exact_frac`` (the fraction of sampled tokens whose logprobs are bitwise equal) of the probe at the warm
    start's weights.

``dose_outcome.csv`` (``R/aggregate/dose_outcome.csv``):
    dose,variant,seed,model,heldout_initial,heldout_final,gain,collapsed,collapse_step,collapse_kind,status: per run,
    its held-out reward before step 1 and after the last (``training/heldout.py``), their difference, and its
    pre-registered collapse event (``stress_runs.csv``'s first event: ``analysis/stress.py``). A run without a final
    evaluation (it stopped on non-finite values) has an empty ``heldout_final`` and ``gain``.

``dose_gain.csv`` (``R/aggregate/dose_gain.csv``):
    dose,variant,num_runs,gain_mean,gain_ci_low,gain_ci_high,diff_vs_baseline,diff_ci_low,diff_ci_high,
    collapses: per (dose, variant) the mean gain over seeds with a 95% seed-bootstrap interval, and the difference
    from baseline's mean gain at the same dose with its interval (each arm's seeds resampled independently,
    ``NUM_RESAMPLES`` draws from ``default_rng(0)``): the primary comparison of the pre-registration (H1).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from roundalign.io import atomic_write_csv

PROBE_METRICS = {"mismatch_k3": "k3", "logp_abs_diff_mean": "logp_abs_diff_mean",
                 "tokens_exact_frac": "tokens_exact_frac"}
DOSE_PROBE_COLUMNS = ["dose", "variant", "metric", "value"]
OUTCOME_COLUMNS = ["dose", "variant", "seed", "model", "heldout_initial", "heldout_final", "gain", "collapsed",
                   "collapse_step", "collapse_kind", "status"]
GAIN_COLUMNS = ["dose", "variant", "num_runs", "gain_mean", "gain_ci_low", "gain_ci_high", "diff_vs_baseline",
                "diff_ci_low", "diff_ci_high", "collapses"]
NUM_RESAMPLES = 10000


def dose_probe_table(probe_csvs: list[str | Path]) -> pd.DataFrame:
    """The token-level probe metrics per dose and variant, from the probes' CSVs and their JSONs' ``dose_bits``."""
    rows = []
    for path in map(Path, probe_csvs):
        meta = json.loads(path.with_suffix(".json").read_text())
        bits = meta["config"].get("dose_bits", 7)
        df = pd.read_csv(path)
        df = df[(df["level"] == "token") & df["metric"].isin(PROBE_METRICS)]
        for r in df.itertuples():
            rows.append({"dose": int(bits), "variant": r.variant, "metric": PROBE_METRICS[r.metric],
                         "value": float(r.value)})
    out = pd.DataFrame(rows, columns=DOSE_PROBE_COLUMNS)
    if out.duplicated(["dose", "variant", "metric"]).any():
        raise ValueError("two probes report the same dose: one probe per dose expected")
    return out.sort_values(["dose", "variant", "metric"], ascending=[False, True, True]).reset_index(drop=True)


def write_dose_probe(probe_csvs: list[str | Path], out_csv: str | Path) -> Path:
    atomic_write_csv(dose_probe_table(probe_csvs), out_csv)
    return Path(out_csv)


def outcome_table(run_status: pd.DataFrame, stress_runs: pd.DataFrame) -> pd.DataFrame:
    """One row per run (module docstring) from the aggregate's ``run_status.csv`` and ``stress_runs.csv``."""
    keys = ["model", "variant", "seed"]
    s = stress_runs[[*keys, "dose", "event", "event_kind", "event_step"]]
    df = run_status.merge(s, on=keys, how="left", validate="one_to_one")
    out = pd.DataFrame({
        "dose": df["dose"].astype(int), "variant": df["variant"], "seed": df["seed"].astype(int), "model": df["model"],
        "heldout_initial": df["heldout_initial"], "heldout_final": df["heldout_final"],
        "gain": df["heldout_final"] - df["heldout_initial"],
        "collapsed": df["event"].fillna(False).astype(bool), "collapse_step": df["event_step"],
        "collapse_kind": df["event_kind"], "status": df["status"]})
    return out.sort_values(["dose", "variant", "seed"], ascending=[False, True, True]).reset_index(drop=True)


def _boot_means(values: np.ndarray, rng, n: int) -> np.ndarray:
    return values[rng.integers(0, len(values), size=(n, len(values)))].mean(axis=1)


def gain_table(outcome: pd.DataFrame, num_resamples: int = NUM_RESAMPLES) -> pd.DataFrame:
    """Mean gain per (dose, variant) and its difference from baseline's, with seed-bootstrap 95% intervals."""
    rows = []
    rng = np.random.default_rng(0)
    for dose, g in outcome.groupby("dose", sort=False):
        base = g.loc[g["variant"] == "baseline", "gain"].dropna().to_numpy()
        base_boot = _boot_means(base, rng, num_resamples) if len(base) else None
        for variant, a in g.groupby("variant", sort=True):
            gains = a["gain"].dropna().to_numpy()
            row = {"dose": dose, "variant": variant, "num_runs": len(a), "collapses": int(a["collapsed"].sum())}
            if len(gains):
                boot = _boot_means(gains, rng, num_resamples)
                row.update(gain_mean=gains.mean(), gain_ci_low=np.percentile(boot, 2.5),
                           gain_ci_high=np.percentile(boot, 97.5))
                if base_boot is not None and variant != "baseline":
                    diff = boot - base_boot
                    row.update(diff_vs_baseline=gains.mean() - base.mean(), diff_ci_low=np.percentile(diff, 2.5),
                               diff_ci_high=np.percentile(diff, 97.5))
            rows.append(row)
    out = pd.DataFrame(rows, columns=GAIN_COLUMNS)
    return out.sort_values(["dose", "variant"], ascending=[False, True]).reset_index(drop=True)


def write_dose_tables(aggregate_dir: str | Path) -> dict[str, Path]:
    """``dose_outcome.csv`` and ``dose_gain.csv`` next to the aggregate's ``run_status.csv`` and ``stress_runs.csv``."""
    d = Path(aggregate_dir)
    outcome = outcome_table(pd.read_csv(d / "run_status.csv"), pd.read_csv(d / "stress_runs.csv"))
    atomic_write_csv(outcome, d / "dose_outcome.csv")
    atomic_write_csv(gain_table(outcome), d / "dose_gain.csv")
    return {"dose_outcome": d / "dose_outcome.csv", "dose_gain": d / "dose_gain.csv"}
