"""Table 6: one row per (model, variant): final reward, peak k3 and collapses, over seeds.

Reads ``runs.csv`` and ``run_status.csv``; writes ``summary.csv`` and ``summary.md`` (a Markdown table with
fixed float formatting). The image ``formats`` do not apply to it.

Definitions (per run, then the mean over the seeds that have the metric):

- final reward: mean of ``reward/mean`` over the run's last ceil(10%) logged steps with a finite reward,
  at least 1 step (30 steps -> the last 3; 12 steps -> the last 2; 5 steps -> the last 1);
- peak k3: max of ``mismatch/token/k3`` over the run's finite values (nats / token);
- learning: ``first_reward`` / ``last_reward``, the mean of ``reward/mean`` over a run's first / last
  ``LEARN_WINDOW`` (10) logged steps, then over seeds; ``reward_gain`` = last - first, with a 95% bootstrap interval
  (``gain_lo``, ``gain_hi``): seeds resampled with replacement and, within each, the two windows' steps
  (``N_BOOT`` resamples, ``numpy.random.default_rng(0)``), so a single-seed arm still gets the interval of its
  step noise. An arm learns when ``gain_lo`` > 0;
- learning against the initial policy, where the runs measured it (``heldout_prompts``, training/heldout.py):
  ``heldout_initial`` / ``heldout_final``, the held-out reward before step 1 and after the last, means over seeds;
  ``heldout_final_lo`` / ``_hi`` the mean of the runs' 95% intervals (over held-out problems; one seed: that run's);
  ``heldout_gain`` = final - initial. The arm ends above its initial policy when ``heldout_final_lo`` exceeds
  ``heldout_initial``. The window gain above measures training batches against training batches, which an early
  dip moves; this is the measure the results pages quote;
- num_collapsed / collapse_steps: runs with status ``collapsed`` and their collapse steps;
  num_reward_collapsed: runs whose reward collapse was flagged (they may have trained on).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from roundalign.io import atomic_write_csv, atomic_write_text
from roundalign.analysis.plots import _style, _tables

STEM = "summary"
REWARD = "reward/mean"
K3 = "mismatch/token/k3"
FINAL_FRACTION = 0.1
LEARN_WINDOW = 10
N_BOOT = 2000
FLOATS = ("final_reward", "peak_k3", "first_reward", "last_reward", "reward_gain", "gain_lo", "gain_hi",
          "heldout_initial", "heldout_final", "heldout_final_lo", "heldout_final_hi", "heldout_gain")
COLUMNS = ("model", "variant", "num_seeds", "num_done", "num_collapsed", "collapse_steps", "num_reward_collapsed",
           *FLOATS)


def final_mean(values_by_step: pd.Series, fraction: float = FINAL_FRACTION) -> float:
    """Mean of the last ceil(fraction * n) finite values (at least one) of a step-indexed series."""
    v = values_by_step[np.isfinite(values_by_step)].sort_index()
    if v.empty:
        return math.nan
    k = max(1, math.ceil(fraction * len(v)))
    return float(v.iloc[-k:].mean())


def _per_run(runs: pd.DataFrame, metric: str, fn) -> dict[tuple, float]:
    """``fn`` of each run's step-indexed values of ``metric``, by (model, variant, seed)."""
    rows = runs[runs["metric"] == metric]
    steps, values = rows["step"].to_numpy(), rows["value"].to_numpy()
    # a Series per run from the positions of its rows: a DataFrame.set_index per run cost ~1 ms each
    return {key: fn(pd.Series(values[i], index=steps[i])) for key, i in
            rows.groupby(["model", "variant", "seed"], sort=True).indices.items()}


def _windows(values_by_step: pd.Series) -> tuple[np.ndarray, np.ndarray] | None:
    """The first and last ``LEARN_WINDOW`` finite rewards of a run (None when it logged fewer than 2 windows)."""
    v = values_by_step[np.isfinite(values_by_step)].sort_index().to_numpy(dtype=float)
    if len(v) < 2 * LEARN_WINDOW:
        return None
    return v[:LEARN_WINDOW], v[-LEARN_WINDOW:]


def learning(windows: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, float]:
    """first/last window means over runs, their difference, and its 95% bootstrap interval over runs (seeds) and,
    within each resampled run, over the steps of each window."""
    nan = dict.fromkeys(("first_reward", "last_reward", "reward_gain", "gain_lo", "gain_hi"), math.nan)
    if not windows:
        return nan
    first = np.stack([w[0] for w in windows])  # (runs, LEARN_WINDOW)
    last = np.stack([w[1] for w in windows])
    rng = np.random.default_rng(0)
    n, k = first.shape
    runs = rng.integers(0, n, size=(N_BOOT, n))
    pick_f = rng.integers(0, k, size=(N_BOOT, n, k))
    pick_l = rng.integers(0, k, size=(N_BOOT, n, k))
    f = np.take_along_axis(first[runs], pick_f, axis=2).mean(axis=(1, 2))
    l_ = np.take_along_axis(last[runs], pick_l, axis=2).mean(axis=(1, 2))
    lo, hi = np.percentile(l_ - f, [2.5, 97.5])
    return {"first_reward": float(first.mean()), "last_reward": float(last.mean()),
            "reward_gain": float(last.mean() - first.mean()), "gain_lo": float(lo), "gain_hi": float(hi)}


def _peak(values: pd.Series) -> float:
    v = values[np.isfinite(values)]
    return float(v.max()) if len(v) else math.nan


def summarize(runs: pd.DataFrame, run_status: pd.DataFrame) -> pd.DataFrame:
    """The summary table (columns ``COLUMNS``), sorted by model, then variant in canonical order."""
    final = _per_run(runs, REWARD, final_mean)
    peak = _per_run(runs, K3, _peak)
    windows = _per_run(runs, REWARD, _windows)
    status = {(r.model, r.variant, r.seed): r for r in run_status.itertuples(index=False)}
    seeds: dict[tuple, set] = {}
    for key in set(status) | set(zip(runs["model"], runs["variant"], runs["seed"])):
        seeds.setdefault(key[:2], set()).add(key[2])
    out = []
    for model in sorted({k[0] for k in seeds}):
        for variant in _style.variant_order([k[1] for k in seeds if k[0] == model]):
            keys = [(model, variant, s) for s in sorted(seeds[(model, variant)])]
            sts = [status[k] for k in keys if k in status]
            collapsed = [(int(r.collapse_step), r.seed) for r in sts if r.status == "collapsed"
                         and np.isfinite(r.collapse_step)]
            out.append({
                "model": model, "variant": variant, "num_seeds": len(keys),
                "num_done": sum(r.status == "done" for r in sts),
                "num_collapsed": sum(r.status == "collapsed" for r in sts),
                "collapse_steps": "; ".join(f"{step} (seed {seed})"
                                            for step, seed in sorted(collapsed, key=lambda x: x[1])),
                "num_reward_collapsed": sum(bool(np.isfinite(r.reward_collapse_step)) for r in sts),
                "final_reward": _nanmean([final.get(k, math.nan) for k in keys]),
                "peak_k3": _nanmean([peak.get(k, math.nan) for k in keys]),
                **learning([windows[k] for k in keys if windows.get(k) is not None]),
                **_heldout(sts),
            })
    return pd.DataFrame(out, columns=list(COLUMNS))


def _heldout(sts) -> dict[str, float]:
    def value(r, name) -> float:
        v = getattr(r, name, math.nan)
        try:
            return float(v)
        except (TypeError, ValueError):  # an empty field: the run did not measure it
            return math.nan

    def col(name):
        return _nanmean([value(r, name) for r in sts])

    out = {"heldout_initial": col("heldout_initial"), "heldout_final": col("heldout_final"),
           "heldout_final_lo": col("heldout_final_ci_low"), "heldout_final_hi": col("heldout_final_ci_high")}
    out["heldout_gain"] = out["heldout_final"] - out["heldout_initial"]
    return out


def _nanmean(values) -> float:
    v = [x for x in values if np.isfinite(x)]
    return float(np.mean(v)) if v else math.nan


def _fmt(value: float, spec: str, missing: str) -> str:
    return missing if not np.isfinite(value) else format(value, spec)


def to_csv_frame(table: pd.DataFrame) -> pd.DataFrame:
    """Floats as repr (round-trip exact, rerun-stable); NaN as an empty field."""
    return table.assign(**{c: ["" if not np.isfinite(v) else repr(float(v)) for v in table[c]]
                           for c in FLOATS})


def to_markdown(table: pd.DataFrame) -> str:
    """GitHub Markdown table: reward to 3 decimals, k3 in 3-significant-digit scientific notation."""
    head = ["model", "variant", "seeds", "done", "collapsed", "collapse step (seed)", "reward collapses",
            "final reward", "peak k3 (nats/token)", f"reward, first {LEARN_WINDOW} steps",
            f"last {LEARN_WINDOW} steps", "gain [95% CI]", "held-out: initial -> final [95% CI]"]
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join(["---", "---", "---:", "---:", "---:", "---", "---:", "---:", "---:", "---:", "---:",
                             "---:", "---:"]) + "|"]
    for r in table.itertuples(index=False):
        gain = ("n/a" if not np.isfinite(r.reward_gain)
                else f"{r.reward_gain:+.3f} [{r.gain_lo:+.3f}, {r.gain_hi:+.3f}]")
        cells = [r.model, r.variant, str(r.num_seeds), str(r.num_done), str(r.num_collapsed), r.collapse_steps or "-",
                 str(r.num_reward_collapsed), _fmt(r.final_reward, ".3f", "n/a"), _fmt(r.peak_k3, ".3e", "n/a"),
                 _fmt(r.first_reward, ".3f", "n/a"), _fmt(r.last_reward, ".3f", "n/a"), gain,
                 "n/a" if not np.isfinite(r.heldout_final) else
                 f"{r.heldout_initial:.3f} -> {r.heldout_final:.3f} [{r.heldout_final_lo:.3f}, {r.heldout_final_hi:.3f}]"]
        lines.append("| " + " | ".join(cells) + " |")
    if table.empty:
        lines.append("| no data | | | | | | | | | | | | |")
    note = (f"\nFinal reward: mean of `{REWARD}` over each run's last {FINAL_FRACTION:.0%} of logged steps "
            f"(at least 1), then over seeds. Peak k3: max of `{K3}` per run, then mean over seeds. Gain: mean reward of "
            f"the last {LEARN_WINDOW} logged steps minus the first {LEARN_WINDOW}, over seeds, with a 95% bootstrap "
            f"interval over seeds and, within each seed, over the steps of each window ({N_BOOT} resamples, seed 0); "
            "an arm learns when the interval lies above 0 (training batches: an early dip moves it). Held-out: the "
            "policy's reward on held-out problems sampled by the run's engine before step 1 and after the last "
            "(mean over seeds; the interval is over problems), the measure against the initial policy.\n")
    return "\n".join(lines) + "\n" + note


def make(aggregate_dir: str | Path, out_dir: str | Path, formats=("png", "pdf")) -> list[Path]:
    tables = _tables.tables(aggregate_dir)
    table = summarize(tables["runs"], tables["run_status"])
    csv_path, md_path = Path(out_dir) / f"{STEM}.csv", Path(out_dir) / f"{STEM}.md"
    atomic_write_csv(to_csv_frame(table), csv_path)
    atomic_write_text(md_path, to_markdown(table))
    return [csv_path, md_path]
