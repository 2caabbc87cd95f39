"""Figures of a mismatch-stress sweep, from its aggregated tables only (``roundalign.analysis.stress`` writes them).

    roundalign plot-stress --aggregate results/stress/aggregate --out figures/stress

Writes ``stress_survival``, ``stress_mismatch``, ``stress_reward``, ``stress_dose`` and ``stress_gap`` in each
format, and ``stress_summary.csv``/``.md`` (one row per dose and variant: ``summary_table``).

Every mean is drawn with its uncertainty: 95% percentile intervals of a bootstrap over runs (``NUM_RESAMPLES``
resamples from ``default_rng(SEED)``), Wilson intervals for fractions of runs, Greenwood bands for survival,
and the share of gap closed with the seed-bootstrap interval of ``roundalign.analysis.stress.gap_table``, or a "no gap to
close" note where the baseline is not distinguishable from the floor. Nine arms do not fit on one panel without
hiding each other: survival gives each variant its own row (an offset 0..1 axis) in one panel per dose, and the
per-step figures are small multiples, one row per variant and one column per dose.

Figures are built like the paper figures (``_style``, ``_save``: no pyplot, fixed style, seeded, categories sorted:
variants in the order of ``roundalign.training.config.TRAIN_VARIANTS``, doses by ``_doses``, no timestamps): reruns give
identical bytes.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator, StrMethodFormatter

from roundalign.engine.choices import KV_CACHE_DTYPES
from roundalign.io import atomic_write_csv, atomic_write_text
from roundalign.analysis.stress import _Z95, _frozen
from roundalign.analysis.plots import _grid, _logaxis, _save, _steps, _style, _tables

STEMS = ("stress_survival", "stress_mismatch", "stress_reward", "stress_dose", "stress_gap")
TABLES = ("stress_runs", "stress_survival", "stress_gap")  # what the figures read besides runs.csv
NUM_RESAMPLES = 1000  # bootstrap resamples of the intervals over runs drawn here
SEED = 0
WINDOW_STEPS = 10  # per-step figures: each run's mean over consecutive windows of this many steps
MISMATCH = "mismatch/token/logp_abs_diff_mean"
REWARD = "reward/mean"
PANEL_IN = (2.5, 1.05)  # one small-multiple panel, inches

CAPTIONS = {
    "stress_survival": (
        "Kaplan-Meier survival of GRPO runs on the mismatch-stress task (tiny Qwen-architecture models, "
        "digit-string copying, emulated engine with split-K GEMMs, SDPA decode, Inductor's RMSNorm reduction and "
        "the dose's KV-cache storage): fraction of runs without a collapse event (non-finite values, reward "
        "below half its running best for the configured number of consecutive steps, or a grad-norm spike above "
        "the configured multiple of its running median) against the optimizer step, one panel per dose level "
        "and one row per variant, pooled over models and seeds. Each row is its own survival axis, from 0 (solid "
        "line) to 1 (dotted), so that arms at 1 do not hide one another; bands are pointwise 95% Greenwood "
        "intervals (log-log scale), x marks the steps with events, the grey numbers are the runs still at risk "
        "at each tick, and the number at the right is the survival at the end of follow-up. The x-axis runs to "
        "the sweep's longest run (its configured number of steps unless every run stopped early)."),
    "stress_mismatch": (
        "Mean |log p_train - log p_engine| per sampled token (nats, log scale) against the optimizer step, one "
        f"row per variant and one column per dose level: each run's mean over windows of {WINDOW_STEPS} steps, "
        "then the mean over runs (models and seeds) with a 95% bootstrap interval over runs (band); dashed, the "
        "baseline arm of the same dose, for reference."),
    "stress_reward": (
        "Mean reward per step (digit-copy prefix credit) against the optimizer step, one row per variant and one "
        f"column per dose level: each run's mean over windows of {WINDOW_STEPS} steps, then the mean over runs "
        "(models and seeds) with a 95% bootstrap interval over runs (band); dashed, the baseline arm of the same "
        "dose, for reference."),
    "stress_dose": (
        "Dose-response per variant (colour, side by side within each dose level): measured mismatch (left: mean "
        "over runs of the per-run mean |delta logp| per token, nats, log scale), final reward (middle: mean over "
        "runs of each run's mean reward over its last 10% of steps) and the fraction of runs with a collapse "
        "event (right). Points are means over runs (models and seeds) with 95% bootstrap intervals over runs; "
        "fractions carry 95% Wilson intervals. Dose levels are categories; nothing joins them."),
    "stress_gap": (
        "Share of the baseline-to-fp32 mismatch gap closed per variant, (delta_baseline - delta_variant) / "
        "(delta_baseline - delta_fp32) with delta the per-run mean |delta logp| per token averaged over seeds, "
        "one panel per dose level: points with 95% seed-bootstrap intervals (each arm's runs resampled), one "
        "marker per model. 0 (solid line) is no better than baseline, 1 (dotted) as on-policy as fp32. A dose "
        "whose gap baseline - fp32 has a bootstrap interval reaching 0 has no gap to close: it is drawn as a "
        "note with that gap and its interval, not as ratios over a denominator indistinguishable from 0."),
}


def _variants(df: pd.DataFrame) -> list[str]:
    return _style.variant_order(df["variant"].unique())


def _doses(df):
    """Dose levels in order: numerically when every level is a number (split-K chunks, outlier scales), else
    in ``KV_CACHE_DTYPES``' order (bf16 storage, then 3, then 2 mantissa bits), else alphabetically."""
    levels = [d for d in df["dose"].dropna().unique()]
    try:
        return sorted(levels, key=float)
    except (TypeError, ValueError):
        order = KV_CACHE_DTYPES
        return sorted(levels, key=lambda d: (order.index(d) if d in order else len(order), str(d)))


def _dose_label(dose) -> str:
    return f"dose {dose}"


# ------------------------------------------------------------------------------------------- statistics

def boot_mean_ci(values, *, num_resamples: int = NUM_RESAMPLES, seed: int = SEED,
                 level: float = 95.0) -> tuple[float, float, float]:
    """(mean, lo, hi): the mean of the finite ``values`` and a percentile bootstrap interval of it; the interval
    is NaN with fewer than two values. Seeded: the same values give the same interval."""
    v = np.asarray(values, dtype="float64")
    v = v[np.isfinite(v)]
    if not len(v):
        return math.nan, math.nan, math.nan
    if len(v) < 2:
        return float(v.mean()), math.nan, math.nan
    boots = v[np.random.default_rng(seed).integers(0, len(v), size=(num_resamples, len(v)))].mean(axis=1)
    lo, hi = np.percentile(boots, [(100 - level) / 2, 100 - (100 - level) / 2])
    mean = float(v.mean())
    # equal values: resampled means can differ from v.mean() in the last bit, just outside the interval
    return mean, min(float(lo), mean), max(float(hi), mean)


def wilson_interval(k: int, n: int, z: float = _Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion k / n (95% by default): unlike the bootstrap it stays
    informative at 0 of 5 and 5 of 5, where every resample repeats the point estimate."""
    if n == 0:
        return math.nan, math.nan
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    # exact ends at 0 of n and n of n (the formula leaves a few ulps there)
    return (0.0 if k == 0 else max(0.0, centre - half)), (1.0 if k == n else min(1.0, centre + half))


def at_risk(times, t: float) -> int:
    """Runs still at risk at step ``t``: event or censoring time >= t (Kaplan-Meier's convention)."""
    return int((np.asarray(times, dtype="float64") >= t).sum())


def horizon(stress_runs: pd.DataFrame, surv: pd.DataFrame | None = None) -> float:
    """The sweep's follow-up: the last step any run reached (the configured steps unless every run stopped
    early); the survival table's last time when no run is listed."""
    if len(stress_runs) and np.isfinite(stress_runs["last_step"]).any():
        return float(np.nanmax(stress_runs["last_step"].to_numpy(dtype="float64")))
    return float(surv["time"].max()) if surv is not None and len(surv) else 1.0


# ---------------------------------------------------------------------------------------------- layout

def _variant_grid(variants, doses, *, log: bool):
    """One row per variant, one column per dose, no shared axes (with 24 panels matplotlib's sibling bookkeeping
    cost more than the drawing; ``plot_per_step`` sets equal limits itself); returns (fig, axes[variant, dose])."""
    nrows, ncols = max(len(variants), 1), max(len(doses), 1)
    fig = Figure(figsize=(PANEL_IN[0] * ncols + 1.6, PANEL_IN[1] * nrows + 1.0))
    # the figure's y label, the variant names and tick labels left; dose titles and a two-line title on top;
    # the x label and the legend below; log tick labels (6×10⁻²) between the columns
    _grid.set_margins(fig, left=0.8, right=0.14, top=0.64, bottom=0.75, wspace=0.68 if log else 0.24, hspace=0.1)
    return fig, fig.subplots(nrows, ncols, squeeze=False)


def _span(arrays, *, log: bool) -> tuple[float, float]:
    """Limits holding every finite value of ``arrays`` with matplotlib's 5% margins (in log space for log)."""
    v = np.concatenate([np.asarray(a, dtype="float64").ravel() for a in arrays] or [np.array([])])
    v = v[np.isfinite(v) & ((v > 0) if log else True)]
    if not len(v):
        return (0.1, 1.0) if log else (0.0, 1.0)
    lo, hi = float(v.min()), float(v.max())
    if log:
        lo, hi = math.log10(lo), math.log10(hi)
    pad = 0.05 * (hi - lo) if hi > lo else 0.5
    lo, hi = lo - pad, hi + pad
    return (10 ** lo, 10 ** hi) if log else (lo, hi)


def _label_grid(axes, variants, doses, ylabel: str) -> None:
    pal = _style.palette(variants)
    for j, dose in enumerate(doses):
        axes[0, j].set_title(_dose_label(dose), fontsize=9)
        axes[-1, j].set_xlabel(_steps.STEP_LABEL)
    for i, v in enumerate(variants):
        axes[i, 0].set_ylabel(v, color=pal[v], fontsize=8.5)
    for ax in axes.ravel():
        ax.tick_params(which="both", labelsize=7)
    fig = axes[0, 0].figure
    fig.supylabel(ylabel, fontsize=9)


# --------------------------------------------------------------------------------------------- figures

SURVIVAL_ROW = 0.78  # height of S = 0..1 within a variant's row of the survival figure (rows 1 apart)


def plot_survival(surv: pd.DataFrame, stress_runs: pd.DataFrame):
    """Kaplan-Meier curves, one panel per dose, one row per variant (offset, so nine arms at S = 1 do not hide
    one another): a row's floor is S = 0 and its top S = 1. Each curve (gid "survival") runs to the end of its
    cell's follow-up, on a shared x-axis to ``horizon``, with its Greenwood band (gid "ci"), x at event steps
    (gid "event"), the number at risk at each x tick (gid "at_risk") and, where a run had an event, the final S
    at the right (gid "final"). Returns (fig, axes: one per dose)."""
    with _style.style():
        doses = _doses(surv) if len(surv) else _doses(stress_runs)
        variants = _variants(surv) if len(surv) else _variants(stress_runs)
        pal = _style.palette(variants)
        end = horizon(stress_runs, surv)
        ticks = [t for t in MaxNLocator(nbins=4, integer=True).tick_values(0, end) if 0 <= t <= end]
        n = max(len(variants), 1)
        fig = Figure(figsize=(3.5 * max(len(doses), 1) + 1.4, 0.5 * n + 1.3))
        # left: the variant names (up to ~0.075 in a character); right: each row's S scale and its label
        _grid.set_margins(fig, left=0.15 + 0.075 * max(map(len, variants), default=4), right=0.36, top=0.64,
                          bottom=0.5, wspace=0.1)
        axes = fig.subplots(1, max(len(doses), 1), squeeze=False, sharex=True, sharey=True)[0]
        if not len(surv):
            _style.no_data(axes[0], "no data: stress_survival.csv is empty")
        for ax, dose in zip(axes, doses):
            ax.set_title(_dose_label(dose), fontsize=9)
            ax.grid(False, axis="y")
            for i, v in enumerate(variants):
                y0 = n - 1 - i  # the first variant on top
                ax.axhline(y0, color="0.85", lw=0.8, zorder=0)
                ax.axhline(y0 + SURVIVAL_ROW, color="0.85", lw=0.6, ls=":", zorder=0)
                g = surv[(surv["variant"] == v) & (surv["dose"] == dose)].sort_values("time", kind="stable")
                cell = stress_runs[(stress_runs["variant"] == v) & (stress_runs["dose"] == dose)]
                if g.empty:
                    ax.text(end / 2, y0 + SURVIVAL_ROW / 2, "no runs", ha="center", va="center", fontsize=7,
                            color="0.4")
                    continue
                last = max(float(g["time"].max()), float(cell["time"].max()) if len(cell) else 0.0)
                t = np.append(g["time"].to_numpy(dtype="float64"), last)
                srv, lo, hi = (np.append(g[c].to_numpy(dtype="float64"), g[c].iloc[-1])
                               for c in ("survival", "ci_low", "ci_high"))
                _steps.band(ax, t, y0 + SURVIVAL_ROW * lo, y0 + SURVIVAL_ROW * hi, step="post", color=pal[v], alpha=0.2,
                            lw=0, gid="ci")
                ax.step(t, y0 + SURVIVAL_ROW * srv, where="post", color=pal[v], lw=1.5, gid="survival")
                ev = g[g["num_events"] > 0]
                if len(ev):
                    ax.plot(ev["time"], y0 + SURVIVAL_ROW * ev["survival"], "x", color=pal[v], ms=5, mew=1.5,
                            gid="event")
                    ax.text(1.01 * end, y0 + SURVIVAL_ROW * srv[-1], f"{srv[-1]:.2f}", ha="left", va="center",
                            fontsize=6.5, color=pal[v], gid="final")
                for tick in ticks if len(cell) else ():
                    ax.text(tick, y0 + 0.04, str(at_risk(cell["time"], tick)), ha="center", va="bottom", fontsize=6,
                            color="0.45", gid="at_risk")
            ax.set_xlabel(_steps.STEP_LABEL)
        ax = axes[0]  # every panel shares both axes: set once (each call updates all the siblings)
        ax.set_xlim(-0.05 * end, 1.05 * end)  # room for the at-risk numbers at 0 and at the horizon
        ax.set_xticks(ticks)
        ax.set_ylim(-0.12, n - 1 + SURVIVAL_ROW + 0.12)
        ax.set_yticks([n - 1 - i + SURVIVAL_ROW / 2 for i in range(len(variants))], variants)
        for label, v in zip(ax.get_yticklabels(), variants):
            label.set_color(pal[v])
        # each row's own survival scale, S = 0 at its solid line and 1 at its dotted one, on the right of the panels
        scale = axes[-1].secondary_yaxis("right")
        scale.set_gid("row_scale")
        rows = [n - 1 - i for i in range(len(variants))]
        scale.set_yticks([y for y0 in rows for y in (y0, y0 + SURVIVAL_ROW)], ["0", "1"] * len(rows), fontsize=6,
                         color="0.4")
        scale.tick_params(axis="y", length=2, color="0.6")
        scale.set_ylabel("S (each row)", fontsize=7, color="0.4")
        _style.suptitle(fig, "Survival without a collapse event (Kaplan-Meier, pooled over models and seeds)",
                        stress_runs if len(stress_runs) else surv,
                        "each row: S from 0 (solid line) to 1 (dotted); bands: 95% Greenwood; x: events; grey: runs at "
                        "risk; right: S at the end")
    return fig, axes


def _windowed(runs_long: pd.DataFrame, metric: str, stress_runs: pd.DataFrame) -> pd.DataFrame:
    """Each run's mean of ``metric`` over windows of WINDOW_STEPS steps: columns dose, variant, step (the
    window's centre), value."""
    d = runs_long[runs_long["metric"] == metric]
    d = d[np.isfinite(d["value"])]
    d = d.merge(stress_runs[["model", "variant", "seed", "dose"]], on=["model", "variant", "seed"])
    window = (d["step"].to_numpy() - 1) // WINDOW_STEPS
    d = d.assign(window=window)
    w = d.groupby(["dose", "variant", "model", "seed", "window"], sort=True, observed=True)["value"].mean()
    w = w.reset_index()
    return w.assign(step=w["window"] * WINDOW_STEPS + (WINDOW_STEPS + 1) / 2)


def plot_per_step(runs_long: pd.DataFrame, stress_runs: pd.DataFrame, metric: str, ylabel: str, *, log: bool,
                  title: str):
    """Small multiples (row = variant other than baseline, column = dose): the windowed mean over runs with a
    bootstrap band, over the baseline arm of the same dose (dashed). Returns (fig, axes[variant, dose])."""
    with _style.style():
        w = _windowed(runs_long, metric, stress_runs)
        doses, variants = _doses(stress_runs), [v for v in _variants(stress_runs) if v != "baseline"]
        pal = _style.palette(variants)
        ref = _style.palette(["baseline"])["baseline"]
        # equal limits set below, inner tick labels hidden; log mismatch spans different decades per dose, so a
        # y range per column, reward one for all
        fig, axes = _variant_grid(variants, doses, log=log)
        floor = _logaxis.zero_floor(w["value"]) if log else None
        if log:
            w = _logaxis.apply_floor(w, floor)
        stats = {}
        for (dose, v), g in w.groupby(["dose", "variant"], sort=True):
            stats[(dose, v)] = _steps.mean_and_ci(g, n_boot=NUM_RESAMPLES, seed=SEED)
        for i, v in enumerate(variants):
            for j, dose in enumerate(doses):
                ax = axes[i, j]
                for arm, color, ls, alpha, gid, z in (("baseline", ref, "--", 0.12, "baseline", 1),
                                                      (v, pal[v], "-", 0.25, "mean", 2)):
                    st = stats.get((dose, arm))
                    if st is None or st.empty:
                        continue
                    ax.plot(st["step"], st["mean"], color=color, ls=ls, lw=1.3, gid=gid, zorder=z + 1)
                    if st["num_seeds"].max() > 1:
                        _steps.band(ax, st["step"], st["lo"], st["hi"], color=color, alpha=alpha, lw=0,
                                    gid=f"ci:{gid}", zorder=z)
                if (dose, v) not in stats:
                    _style.no_data(ax, "no runs")
        end = horizon(stress_runs)
        xticks = [t for t in MaxNLocator(nbins=4, integer=True).tick_values(0, end) if 0 <= t <= end]
        column = {dose: [a for (d, _), st in stats.items() if d == dose for a in (st["mean"], st["lo"], st["hi"])]
                  for dose in doses}
        every = [a for arrays in column.values() for a in arrays]
        plain = StrMethodFormatter("{x:g}")  # ScalarFormatter's offset and precision logic: 0.5 s a figure
        for j, dose in enumerate(doses):
            ylim = _span(column[dose] if log else every, log=log)
            if log and floor is not None and any((st["mean"] <= floor).any() for (d, _), st in stats.items()
                                                 if d == dose):
                ylim = (min(ylim[0], floor / 3), ylim[1])
            for i in range(len(variants)):
                ax = axes[i, j]
                if log:
                    _logaxis.set_log_y(ax)
                    if ylim[0] <= (floor or 0) <= ylim[1]:
                        _logaxis.mark_floor(ax, floor)
                else:
                    ax.yaxis.set_major_formatter(plain)
                ax.set_ylim(*ylim)
                ax.set_xlim(0, end)
                ax.set_xticks(xticks)
                ax.xaxis.set_major_formatter(plain)
                ax.tick_params(labelbottom=i == len(variants) - 1, labelleft=log or j == 0)
        _label_grid(axes, variants, doses, ylabel)
        handles = [Line2D([], [], color=ref, ls="--", lw=1.5, label="baseline arm of the same dose")]
        fig.legend(handles=handles, loc="outside lower center", fontsize=8)
        _style.suptitle(fig, title, stress_runs,
                        f"each run's mean over {WINDOW_STEPS}-step windows; lines: mean over runs; "
                        "bands: 95% bootstrap CI over runs")
    return fig, axes


def _cells(stress_runs: pd.DataFrame):
    """(dose, variant, that cell's runs) for every non-empty cell, doses and variants in their drawing order."""
    for dose in _doses(stress_runs):
        for v in _variants(stress_runs):
            g = stress_runs[(stress_runs["dose"] == dose) & (stress_runs["variant"] == v)]
            if not g.empty:
                yield dose, v, g


def dose_stats(stress_runs: pd.DataFrame) -> pd.DataFrame:
    """Per (dose, variant): num_runs and, with 95% intervals (bootstrap over runs; Wilson for the fraction),
    the mean mismatch, the mean final reward and the fraction of runs with a collapse event."""
    rows = []
    for dose, v, g in _cells(stress_runs):
        m = boot_mean_ci(g["mismatch_token_logp_abs_diff_mean"])
        r = boot_mean_ci(g["reward_last"])
        k, n = int(g["event"].sum()), len(g)
        lo, hi = wilson_interval(k, n)
        rows.append({"dose": dose, "variant": v, "num_runs": n,
                     "mismatch": m[0], "mismatch_lo": m[1], "mismatch_hi": m[2],
                     "reward": r[0], "reward_lo": r[1], "reward_hi": r[2],
                     "events": k / n, "events_lo": lo, "events_hi": hi})
    return pd.DataFrame(rows)


def _dodged(doses, variants):
    """x position of each (dose, variant): doses at 0, 1, ..., variants side by side within 0.8 of each."""
    width = 0.8 / max(len(variants), 1)
    return {(d, v): i - 0.4 + width * (k + 0.5) for i, d in enumerate(doses) for k, v in enumerate(variants)}


def _dose_axis(ax, doses) -> None:
    ax.set_xticks(range(len(doses)), [str(d) for d in doses])
    ax.set_xlim(-0.5, len(doses) - 0.5)
    ax.set_xlabel("dose level")
    ax.grid(False, axis="x")
    for i in range(1, len(doses)):
        ax.axvline(i - 0.5, color="0.85", lw=0.8, zorder=0, gid="dose_sep")


def plot_dose(stress_runs: pd.DataFrame):
    """Dose-response with a categorical dose axis: per (dose, variant) a marker and its 95% interval, one
    errorbar per variant over its doses (gid "dose:<variant>", markers only: nothing joins the doses), for the
    mismatch, the final reward and the fraction of runs with an event. Returns (fig, axes)."""
    with _style.style():
        st = dose_stats(stress_runs)
        doses, variants = _doses(stress_runs), _variants(stress_runs)
        pal = _style.palette(variants)
        x = _dodged(doses, variants)
        fig = Figure(figsize=(11, 3.4))
        _grid.set_margins(fig, left=0.64, right=0.05, top=0.52, bottom=0.5, wspace=0.6)  # + the legend, measured
        axes = fig.subplots(1, 3)
        panels = (("mismatch", "mean |delta logp| per token (nats)"),
                  ("reward", "final reward (last 10% of steps)"),
                  ("events", "fraction of runs with a collapse event"))
        for ax, (col, ylabel) in zip(axes, panels):
            for v, g in st.groupby("variant", sort=False):
                y, lo, hi = (g[c].to_numpy(dtype="float64") for c in (col, f"{col}_lo", f"{col}_hi"))
                err = np.vstack([y - lo, hi - y])  # NaN for a cell of one run: no bar drawn there
                # hollow markers: an interval narrower than the marker still shows through it
                ax.errorbar([x[(d, v)] for d in g["dose"]], y, yerr=err, fmt="o", ms=4.5, mfc="none", mew=1.1,
                            color=pal[v], elinewidth=1.2, capsize=2, gid=f"dose:{v}")
            _dose_axis(ax, doses)
            ax.set_ylabel(ylabel)
        _logaxis.set_log_y(axes[0])
        axes[2].set_ylim(-0.03, 1.03)
        _style.variant_legend(fig, variants, marker="o")
        n = sorted(set(st["num_runs"])) if len(st) else []
        _style.suptitle(fig, "Dose-response: mismatch, final reward and collapse events per variant", stress_runs,
                        f"points: mean over runs ({'/'.join(map(str, n))} per cell); bars: 95% bootstrap CI "
                        "(fractions: Wilson)")
    return fig, axes


def _gap_note(rows: pd.DataFrame) -> str:
    lines = ["no gap to close"]
    for r in rows.drop_duplicates("base").itertuples(index=False):
        lines.append(f"{r.base}: baseline − fp32 = {r.gap:.2g} nats\n95% CI [{r.gap_ci_low:.2g}, {r.gap_ci_high:.2g}]")
    return "\n".join(lines)


def plot_gap(gap: pd.DataFrame, sweep_table: pd.DataFrame | None = None):
    """Share of gap closed, one panel per dose: per (base, variant) a point with its bootstrap interval (gid
    "share:<variant>"); a dose without a resolved gap (``has_gap`` false for every base) gets only a note (gid
    "no_gap"). baseline (0 by definition) and the floor (1) are the reference lines, not points.
    ``sweep_table``: a table with the sweep column, for the title. Returns (fig, axes)."""
    with _style.style():
        g = gap[~gap["variant"].isin(["baseline", "fp32"])]
        doses, variants = _doses(gap), _variants(g)
        bases = sorted(gap["base"].unique())
        markers = ["o", "s", "^", "D", "v", "P"]
        pal = _style.palette(variants)
        fig = Figure(figsize=(max(3.2 * max(len(doses), 1) + 1.2, _grid.MIN_WIDTH_IN), 3.6))
        # bottom: the variant names at 35 degrees (~0.036 in of height a character); top: two-line panel titles
        longest = max(map(len, variants), default=4)
        _grid.set_margins(fig, left=0.74, right=0.05, top=0.82, bottom=0.22 + 0.036 * longest, wspace=0.1)
        axes = fig.subplots(1, max(len(doses), 1), squeeze=False, sharey=True)[0]
        width = 0.6 / max(len(bases), 1)
        if gap.empty:
            _style.no_data(axes[0], "no data: stress_gap.csv is empty")
        for ax, dose in zip(axes, doses):
            h = g[g["dose"] == dose]
            resolved = gap[(gap["dose"] == dose)]
            if not resolved["has_gap"].astype(bool).any():
                ax.text(0.5, 0.5, _gap_note(resolved), transform=ax.transAxes, ha="center", va="center",
                        fontsize=7.5, color="0.25", gid="no_gap",
                        bbox={"boxstyle": "round,pad=0.4", "fc": "0.96", "ec": "0.8"})
            for b, base in enumerate(bases):
                for k, v in enumerate(variants):
                    r = h[(h["base"] == base) & (h["variant"] == v) & h["has_gap"].astype(bool)]
                    if r.empty or not np.isfinite(r["share_closed"].iloc[0]):
                        continue
                    y, lo, hi = (float(r[c].iloc[0]) for c in ("share_closed", "share_ci_low", "share_ci_high"))
                    xpos = k - 0.3 + width * (b + 0.5)
                    # a percentile interval of a ratio need not hold the point estimate: never a negative arm
                    err = [[max(y - lo, 0.0)], [max(hi - y, 0.0)]]
                    ax.errorbar([xpos], [y], yerr=err, fmt=markers[b % len(markers)], ms=4.5, mfc="none", mew=1.1,
                                color=pal[v], elinewidth=1.2, capsize=2.5, gid=f"share:{v}")
            ax.axhline(0, color="0.3", lw=0.8, zorder=0)
            ax.axhline(1, color="0.3", lw=0.8, ls=":", zorder=0)
            for y, text in ((0, "baseline"), (1, "fp32")):
                ax.text(0.99, y, text, transform=ax.get_yaxis_transform(), ha="right", va="bottom", fontsize=6.5,
                        color="0.35")
            ax.set_xticks(range(len(variants)), variants, rotation=35, ha="right", rotation_mode="anchor", fontsize=7.5)
            ax.set_xlim(-0.6, len(variants) - 0.4)
            ax.grid(False, axis="x")
            rd = resolved.drop_duplicates("base")
            title = _dose_label(dose)
            if len(rd) == 1 and rd["has_gap"].astype(bool).iloc[0]:
                r = rd.iloc[0]
                title += f"\ngap {r['gap']:.2g} nats [{r['gap_ci_low']:.2g}, {r['gap_ci_high']:.2g}]"
            ax.set_title(title, fontsize=8.5)
        axes[0].set_ylabel("share of gap closed")
        handles = [Line2D([], [], color="0.3", marker=markers[b % len(markers)], ls="none", label=base)
                   for b, base in enumerate(bases)] if len(bases) > 1 else []
        if handles:
            fig.legend(handles=handles, loc="outside right center", title="model")
        _style.suptitle(fig, "Share of the baseline-to-fp32 mismatch gap closed",
                        sweep_table if sweep_table is not None else gap,
                        "points: estimate; bars: 95% seed-bootstrap CI")
    return fig, axes


SUMMARY_COLUMNS = ["dose", "variant", "runs", "events", "events_reward", "events_grad_norm", "events_nonfinite",
                   "reward_collapses_any", "event_step_median", "logp_abs_diff_mean", "k3_mean",
                   "token_mult_prob_error", "verl_violation_frac", "reward_first", "reward_last", "reward_last_sd",
                   "share_closed", "share_ci_low", "share_ci_high"]


def summary_table(stress_runs: pd.DataFrame, gap: pd.DataFrame) -> pd.DataFrame:
    """One row per (dose, variant), pooled over models and seeds: run and event counts (by kind of each run's
    first event; ``reward_collapses_any`` counts runs with a reward collapse at any step, also after an earlier
    event of another kind), the median event step, means over runs of the per-run mismatch means, of the
    fraction of steps violating verl's health checks and of the first/last 10% reward (with the standard
    deviation over runs of the last), and the mean over models of the share of gap closed (blank where no model
    has a gap to close) with its seed-bootstrap interval when one model has it (with several, each model's is
    in stress_gap.csv)."""
    rows = []
    for dose, v, g in _cells(stress_runs):
        kinds = pd.Series([k if isinstance(k, str) else "" for k in g["event_kind"]], dtype=object)
        sh = gap[(gap["dose"] == dose) & (gap["variant"] == v)]
        sh = sh[sh["has_gap"].astype(bool)] if "has_gap" in sh else sh
        one = len(sh) == 1 and {"share_ci_low", "share_ci_high"} <= set(sh.columns)
        rows.append({
            "dose": dose, "variant": v, "runs": len(g), "events": int(g["event"].sum()),
            "events_reward": int((kinds == "reward").sum()),
            "events_grad_norm": int((kinds == "grad_norm").sum()),
            "events_nonfinite": int((kinds == "nonfinite").sum()),
            "reward_collapses_any": int(g["reward_collapse_step"].notna().sum()),
            "event_step_median": float(g["event_step"].median()) if g["event"].any() else np.nan,
            "logp_abs_diff_mean": g["mismatch_token_logp_abs_diff_mean"].mean(),
            "k3_mean": g["mismatch_token_k3"].mean(),
            "token_mult_prob_error": g["mismatch_token_token_mult_prob_error"].mean(),
            "verl_violation_frac": g["verl_violation_frac"].mean(),
            "reward_first": g["reward_first"].mean(), "reward_last": g["reward_last"].mean(),
            "reward_last_sd": g["reward_last"].std(ddof=1) if len(g) > 1 else np.nan,
            "share_closed": sh["share_closed"].mean() if len(sh) else np.nan,
            "share_ci_low": float(sh["share_ci_low"].iloc[0]) if one else np.nan,
            "share_ci_high": float(sh["share_ci_high"].iloc[0]) if one else np.nan})
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS)


def _summary_markdown(table: pd.DataFrame) -> str:
    def fmt(v):
        if isinstance(v, float):
            return "" if np.isnan(v) else f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(table.columns) + " |", "|" + "---|" * len(table.columns)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in table.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def make(aggregate_dir, out_dir, formats=("png", "pdf"), stems=None, summary=True) -> list[Path]:
    """Every stress figure (or those of ``stems``) and, with ``summary``, the summary table; ``aggregate_dir`` is a
    directory or a ``_tables.Tables``."""
    formats = _save.check_formats(formats)
    stems = list(STEMS) if stems is None else list(stems)
    unknown = [s for s in stems if s not in STEMS]
    if unknown:
        raise ValueError(f"unknown stress figure(s) {', '.join(unknown)}; choose from {', '.join(STEMS)}")
    tables = _tables.tables(aggregate_dir)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stress_runs, surv, gap = tables["stress_runs"], tables["stress_survival"], tables["stress_gap"]
    runs_long = tables["runs"]
    figs = {
        "stress_survival": lambda: plot_survival(surv, stress_runs)[0],
        "stress_mismatch": lambda: plot_per_step(runs_long, stress_runs, MISMATCH, "mean |delta logp| per token (nats)",
                                                 log=True, title="Per-token mismatch during training, per variant")[0],
        "stress_reward": lambda: plot_per_step(runs_long, stress_runs, REWARD, "reward (mean over completions)",
                                               log=False, title="Training reward, per variant")[0],
        "stress_dose": lambda: plot_dose(stress_runs)[0],
        "stress_gap": lambda: plot_gap(gap, stress_runs)[0],
    }
    paths = []
    for stem in stems:
        paths += _save.save(figs[stem](), out_dir, stem, formats)
    if not summary:
        return paths
    table = summary_table(stress_runs, gap)
    atomic_write_csv(_frozen(table), out_dir / "stress_summary.csv")
    atomic_write_text(out_dir / "stress_summary.md", _summary_markdown(table))
    return paths + [out_dir / "stress_summary.csv", out_dir / "stress_summary.md"]
