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

``dose_tests.csv`` (``R/aggregate/dose_tests.csv``): every pre-registered test of H1-H4 (``hypothesis_tests``), one row
    each; ``verdicts`` reads the hypotheses' outcomes from it.

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
import statsmodels.formula.api as smf
from scipy import stats
from statsmodels.stats.contingency_tables import Table
from statsmodels.stats.multitest import multipletests

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
    atomic_write_csv(hypothesis_tests(outcome), d / "dose_tests.csv")
    return {"dose_outcome": d / "dose_outcome.csv", "dose_gain": d / "dose_gain.csv", "dose_tests": d / "dose_tests.csv"}


# -- the pre-registered tests (docs/prereg-dose.md, "Metrics and tests") ----------------------------------------------

TEST_COLUMNS = ["hypothesis", "test", "dose", "estimate", "ci_low", "ci_high", "statistic", "p_value", "p_holm",
                "significant", "n"]
ALPHA = 0.05


def _dose_index(outcome: pd.DataFrame) -> dict:
    """Dose levels from no dose (7 bits) to the coarsest: 0, 1, 2, ..."""
    return {d: i for i, d in enumerate(sorted(outcome["dose"].unique(), reverse=True))}


def _gains(outcome, variant, dose=None) -> np.ndarray:
    sel = outcome["variant"] == variant
    if dose is not None:
        sel &= outcome["dose"] == dose
    return outcome.loc[sel, "gain"].dropna().to_numpy(dtype=float)


def _boot_diff(a: np.ndarray, b: np.ndarray, rng, n: int = NUM_RESAMPLES) -> tuple[float, float]:
    """95% percentile interval of mean(a) - mean(b), each resampled independently."""
    if len(a) < 2 or len(b) < 2:
        return float("nan"), float("nan")
    d = _boot_means(a, rng, n) - _boot_means(b, rng, n)
    return float(np.percentile(d, 2.5)), float(np.percentile(d, 97.5))


def hypothesis_tests(outcome: pd.DataFrame) -> pd.DataFrame:
    """Every pre-registered test of H1-H4 (and the remedies' comparison), one row each (``TEST_COLUMNS``).

    - H1 ``welch``: per dose below 7 bits, full minus baseline mean gain, Welch's two-sided t-test (scipy), Holm's
      adjustment over those doses; ``interaction``: OLS gain ~ is_full * dose_index over both arms (statsmodels), the
      product's coefficient, one-sided p for > 0;
    - H2 ``baseline_slope``: OLS of baseline's gain on the dose index, one-sided p for < 0; ``full_top_minus_none``:
      full's mean gain at the coarsest dose minus at 7 bits, its bootstrap interval (supported when it reaches 0 or
      lies above);
    - H3 ``rope_minus_baseline`` and ``full_minus_rope`` at the coarsest dose, bootstrap intervals;
    - H4 ``trend``: Cochran-Armitage trend of the collapse counts over the dose index, per variant (statsmodels'
      linear-by-linear association test, whose variance differs from Cochran-Armitage's by N/(N-1)), one-sided for
      a rise;
    - ``remedy``: tis and mis against baseline per dose, as H1's Welch test (reported, not a hypothesis).
    ``significant`` applies α = 0.05 to ``p_holm`` where there is one, else to ``p_value``; for the interval-only rows
    it is the interval's verdict as the pre-registration words it."""
    rng = np.random.default_rng(0)
    idx = _dose_index(outcome)
    doses = sorted(idx, key=idx.get)
    top, none = doses[-1], doses[0]
    rows = []

    def welch(hyp, test, variant, dose):
        a, b = _gains(outcome, variant, dose), _gains(outcome, "baseline", dose)
        t, p = stats.ttest_ind(a, b, equal_var=False) if len(a) > 1 and len(b) > 1 else (np.nan, np.nan)
        lo, hi = _boot_diff(a, b, rng)
        return {"hypothesis": hyp, "test": test, "dose": dose, "estimate": a.mean() - b.mean() if len(a) and len(b)
                else np.nan, "ci_low": lo, "ci_high": hi, "statistic": t, "p_value": p, "n": len(a) + len(b)}

    h1 = [welch("H1", "welch_full_vs_baseline", "full", d) for d in doses[1:]]
    if h1:
        p = np.array([r["p_value"] for r in h1])
        ok = ~np.isnan(p)
        adj = np.full_like(p, np.nan)
        if ok.any():
            adj[ok] = multipletests(p[ok], method="holm")[1]
        for r, q in zip(h1, adj):
            r["p_holm"] = q
            r["significant"] = bool(q < ALPHA and r["estimate"] > 0)
    rows += h1
    two = outcome[outcome["variant"].isin(["baseline", "full"])].dropna(subset=["gain"]).copy()
    two["is_full"] = (two["variant"] == "full").astype(float)
    two["dose_index"] = two["dose"].map(idx).astype(float)
    def ols(hyp, test, formula, term, data, upper):
        """One OLS coefficient as a row, with its one-sided p (``upper``: for > 0, else for < 0)."""
        fit = smf.ols(formula, data=data).fit()
        coef, t = fit.params[term], fit.tvalues[term]
        p1 = float((stats.t.sf if upper else stats.t.cdf)(t, fit.df_resid))
        lo, hi = fit.conf_int().loc[term]
        return {"hypothesis": hyp, "test": test, "dose": np.nan, "estimate": coef, "ci_low": lo, "ci_high": hi,
                "statistic": t, "p_value": p1, "significant": bool(p1 < ALPHA), "n": len(data)}

    if two["is_full"].nunique() == 2 and two["dose_index"].nunique() > 1:
        rows.append(ols("H1", "interaction_grows_with_dose", "gain ~ is_full * dose_index", "is_full:dose_index",
                        two, upper=True))
    base = two[two["is_full"] == 0]
    if base["dose_index"].nunique() > 1:
        rows.append(ols("H2", "baseline_slope_falls", "gain ~ dose_index", "dose_index", base, upper=False))
    a, b = _gains(outcome, "full", top), _gains(outcome, "full", none)
    lo, hi = _boot_diff(a, b, rng)
    rows.append({"hypothesis": "H2", "test": "full_top_minus_none", "dose": top,
                 "estimate": a.mean() - b.mean() if len(a) and len(b) else np.nan, "ci_low": lo, "ci_high": hi,
                 "significant": bool(hi >= 0), "n": len(a) + len(b)})
    for test, (x, y), verdict in (("rope_minus_baseline", ("rope", "baseline"), lambda lo, hi: lo > 0),
                                  ("full_minus_rope", ("full", "rope"), lambda lo, hi: hi >= 0)):
        a, b = _gains(outcome, x, top), _gains(outcome, y, top)
        lo, hi = _boot_diff(a, b, rng)
        rows.append({"hypothesis": "H3", "test": test, "dose": top,
                     "estimate": a.mean() - b.mean() if len(a) and len(b) else np.nan, "ci_low": lo, "ci_high": hi,
                     "significant": bool(verdict(lo, hi)), "n": len(a) + len(b)})
    for variant in C_VARIANTS_H4:
        g = outcome[outcome["variant"] == variant]
        if g.empty:
            continue
        counts = np.array([[int((~g.loc[g["dose"] == d, "collapsed"]).sum()), int(g.loc[g["dose"] == d, "collapsed"].sum())]
                           for d in doses])
        if counts[:, 1].sum() == 0:
            z, p1 = np.nan, 1.0  # no event at any dose: no rise
        else:
            r = Table(counts).test_ordinal_association(row_scores=np.arange(len(doses), dtype=float),
                                                       col_scores=np.array([0.0, 1.0]))
            z, p1 = float(r.zscore), float(stats.norm.sf(r.zscore))
        rows.append({"hypothesis": "H4", "test": f"collapse_trend_{variant}", "dose": np.nan,
                     "estimate": float(counts[:, 1].sum()), "statistic": z, "p_value": p1,
                     "significant": bool(p1 < ALPHA), "n": int(counts.sum())})
    remedies = [welch("remedy", f"welch_{v}_vs_baseline", v, d) for v in ("tis", "mis")
                if v in set(outcome["variant"]) for d in doses]
    rows += [{**r, "significant": bool(r["p_value"] < ALPHA)} for r in remedies]  # NaN p: not significant
    return pd.DataFrame(rows, columns=TEST_COLUMNS)


C_VARIANTS_H4 = ("baseline", "full")


def verdicts(tests: pd.DataFrame) -> dict[str, bool]:
    """Each hypothesis supported or not, by the pre-registered rule, from ``hypothesis_tests``' table."""
    def any_sig(test):
        return bool(tests.loc[tests["test"] == test, "significant"].astype(bool).any())

    return {"H1": any_sig("welch_full_vs_baseline") and any_sig("interaction_grows_with_dose"),
            "H2": any_sig("baseline_slope_falls") and any_sig("full_top_minus_none"),
            "H3": any_sig("rope_minus_baseline") and any_sig("full_minus_rope"),
            "H4": any_sig("collapse_trend_baseline") and not any_sig("collapse_trend_full")}
