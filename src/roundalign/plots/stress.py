"""Figures of a mismatch-stress sweep, from its aggregated tables only (``roundalign.stress`` writes them).

    roundalign plot-stress --aggregate results/stress/aggregate --out figures/stress

Writes ``stress_survival``, ``stress_mismatch``, ``stress_reward``, ``stress_dose`` and ``stress_gap`` in each
format, and ``stress_summary.csv``/``.md`` (one row per dose and variant: ``summary_table``). Categories are
sorted (variants in the order of ``roundalign.config.TRAIN_VARIANTS``, doses by ``_doses``), seed bands are
min-max over seeds (no resampling, so nothing random), and file metadata carries no timestamp: reruns give
identical bytes.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from ..config import TRAIN_VARIANTS  # noqa: E402
from ..engine.choices import KV_CACHE_DTYPES  # noqa: E402
from ..io import atomic_write_csv, atomic_write_text  # noqa: E402
from ..stress import _frozen  # noqa: E402
from ._common import check_formats, load_table  # noqa: E402

STEMS = ("stress_survival", "stress_mismatch", "stress_reward", "stress_dose", "stress_gap")

CAPTIONS = {
    "stress_survival": (
        "Kaplan-Meier survival of GRPO runs on the mismatch-stress task (tiny Qwen-architecture models, "
        "digit-string copying, emulated engine with split-K GEMMs, SDPA decode, Inductor's RMSNorm reduction and "
        "the dose's KV-cache storage): fraction of runs without a collapse event (non-finite values, reward "
        "below half its running best for the configured number of consecutive steps, or a grad-norm spike above "
        "the configured multiple of its running median) against the optimizer step, one panel per dose level, "
        "one line per variant, pooled over models and seeds; bands are pointwise 95% Greenwood intervals (log-log scale)."),
    "stress_mismatch": (
        "Mean |log p_train - log p_engine| per sampled token (nats, log scale) against the optimizer step, one "
        "panel per dose level, one line per variant: median over models and seeds, band min-max over them."),
    "stress_reward": (
        "Mean reward per step (digit-copy prefix credit) against the optimizer step, one panel per dose level: "
        "median over models and seeds, band min-max over them."),
    "stress_dose": (
        "Dose-response: each variant at each dose level, placed at its measured mismatch (mean over its runs of "
        "the per-run mean |delta logp| per token, nats, log scale), against the final reward (left: mean reward "
        "of the last 10% of steps, averaged over runs) and the fraction of runs with a collapse event (right); "
        "lines join a variant's dose levels in increasing dose."),
    "stress_gap": (
        "Share of the baseline-to-fp32 mismatch gap closed per variant, (delta_baseline - delta_variant) / "
        "(delta_baseline - delta_fp32) with delta the per-run mean |delta logp| per token averaged over seeds; "
        "bars are the mean over models at each dose, points the individual models."),
}


def _variants(df: pd.DataFrame) -> list[str]:
    present = set(df["variant"])
    return [v for v in TRAIN_VARIANTS if v in present] + sorted(present - set(TRAIN_VARIANTS))


def _colors(variants):
    cmap = plt.get_cmap("tab10")
    return {v: cmap(i % 10) for i, v in enumerate(variants)}


def _doses(df):
    """Dose levels in order: numerically when every level is a number (split-K chunks, outlier scales), else
    in ``KV_CACHE_DTYPES``' order (bf16 storage, then 3, then 2 mantissa bits), else alphabetically."""
    levels = [d for d in df["dose"].dropna().unique()]
    try:
        return sorted(levels, key=float)
    except (TypeError, ValueError):
        order = KV_CACHE_DTYPES
        return sorted(levels, key=lambda d: (order.index(d) if d in order else len(order), str(d)))


def plot_survival(surv: pd.DataFrame):
    doses, variants = _doses(surv), _variants(surv)
    colors = _colors(variants)
    fig, axes = plt.subplots(1, len(doses), figsize=(4 * len(doses), 3.2), sharey=True, squeeze=False)
    for ax, dose in zip(axes[0], doses):
        for v in variants:
            g = surv[(surv["variant"] == v) & (surv["dose"] == dose)].sort_values("time")
            if g.empty:
                continue
            ax.step(g["time"], g["survival"], where="post", color=colors[v], label=v)
            ax.fill_between(g["time"], g["ci_low"], g["ci_high"], step="post", color=colors[v], alpha=0.15)
        ax.set_title(f"dose {dose}")
        ax.set_xlabel("step")
        ax.set_ylim(-0.02, 1.02)
    axes[0][0].set_ylabel("fraction of runs without collapse")
    axes[0][-1].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    return fig, axes


def _per_step(runs_long: pd.DataFrame, metric: str, ylabel: str, log: bool, stress_runs: pd.DataFrame):
    d = runs_long[runs_long["metric"] == metric].merge(
        stress_runs[["model", "variant", "seed", "dose"]], on=["model", "variant", "seed"])
    doses, variants = _doses(d), _variants(d)
    colors = _colors(variants)
    fig, axes = plt.subplots(1, max(1, len(doses)), figsize=(4 * max(1, len(doses)), 3.2), sharey=True,
                             squeeze=False)
    for ax, dose in zip(axes[0], doses):
        for v in variants:
            g = d[(d["variant"] == v) & (d["dose"] == dose)]
            if g.empty:
                continue
            q = g.groupby("step")["value"].agg(["median", "min", "max"]).reset_index()
            ax.plot(q["step"], q["median"], color=colors[v], label=v, lw=1)
            ax.fill_between(q["step"], q["min"], q["max"], color=colors[v], alpha=0.12)
        ax.set_title(f"dose {dose}")
        ax.set_xlabel("step")
        if log:
            ax.set_yscale("log")
    axes[0][0].set_ylabel(ylabel)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    return fig, axes


def plot_dose(stress_runs: pd.DataFrame):
    """Dose-response: each (variant, dose) cell at its measured mismatch (mean over its runs of the per-run mean
    |delta logp| per token), against the final reward (left) and the fraction of runs with a collapse event
    (right); lines join a variant's dose levels in dose order."""
    variants, doses = _variants(stress_runs), _doses(stress_runs)
    colors = _colors(variants)
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    for v in variants:
        g = stress_runs[stress_runs["variant"] == v].groupby("dose").agg(
            mismatch=("mismatch_token_logp_abs_diff_mean", "mean"), reward=("reward_last", "mean"),
            events=("event", "mean")).reindex([d for d in doses if d in set(stress_runs["dose"])]).dropna(how="all")
        a.plot(g["mismatch"], g["reward"], "o-", color=colors[v], label=v)
        b.plot(g["mismatch"], g["events"], "o-", color=colors[v], label=v)
    for ax in (a, b):
        ax.set_xscale("log")
        ax.set_xlabel("measured mean |delta logp| per token (nats)")
    a.set_ylabel("final reward (last 10% of steps)")
    b.set_ylabel("fraction of runs with a collapse event")
    b.set_ylim(-0.02, 1.02)
    b.legend(fontsize=7)
    fig.tight_layout()
    return fig, (a, b)


def plot_gap(gap: pd.DataFrame):
    g = gap[~gap["variant"].isin(["baseline"])]
    variants, doses = _variants(g), _doses(g)
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(variants) * max(1, len(doses)) / 2, 3.4))
    width = 0.8 / max(1, len(doses))
    for j, dose in enumerate(doses):
        x = np.arange(len(variants)) + (j - (len(doses) - 1) / 2) * width
        h = g[g["dose"] == dose]
        means = [h[h["variant"] == v]["share_closed"].mean() for v in variants]
        ax.bar(x, means, width, label=f"dose {dose}", alpha=0.7)
        for xi, v in zip(x, variants):
            pts = h[h["variant"] == v]["share_closed"].dropna()
            ax.plot([xi] * len(pts), pts, "k.", ms=3)
    ax.axhline(0, color="k", lw=0.5)
    ax.axhline(1, color="k", lw=0.5, ls=":")
    ax.set_xticks(np.arange(len(variants)), variants, rotation=30, ha="right")
    ax.set_ylabel("share of gap closed")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig, ax


SUMMARY_COLUMNS = ["dose", "variant", "runs", "events", "events_reward", "events_grad_norm", "events_nonfinite",
                   "reward_collapses_any", "event_step_median", "logp_abs_diff_mean", "k3_mean",
                   "token_mult_prob_error", "verl_violation_frac", "reward_first", "reward_last", "reward_last_sd",
                   "share_closed"]


def summary_table(stress_runs: pd.DataFrame, gap: pd.DataFrame) -> pd.DataFrame:
    """One row per (dose, variant), pooled over models and seeds: run and event counts (by kind of each run's
    first event; ``reward_collapses_any`` counts runs with a reward collapse at any step, also after an earlier
    event of another kind), the median event step, means over runs of the per-run mismatch means, of the
    fraction of steps violating verl's health checks and of the first/last 10% reward (with the standard
    deviation over runs of the last), and the mean over models of the share of gap closed."""
    rows = []
    for dose in _doses(stress_runs):
        for v in _variants(stress_runs):
            g = stress_runs[(stress_runs["dose"] == dose) & (stress_runs["variant"] == v)]
            if g.empty:
                continue
            kinds = pd.Series([k if isinstance(k, str) else "" for k in g["event_kind"]], dtype=object)
            share = gap[(gap["dose"] == dose) & (gap["variant"] == v)]["share_closed"]
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
                "share_closed": share.mean() if len(share) else np.nan})
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS)


def _summary_markdown(table: pd.DataFrame) -> str:
    def fmt(v):
        if isinstance(v, float):
            return "" if np.isnan(v) else f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(table.columns) + " |", "|" + "---|" * len(table.columns)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in table.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def make(aggregate_dir, out_dir, formats=("png", "pdf")) -> list[Path]:
    formats = check_formats(formats)
    aggregate_dir, out_dir = Path(aggregate_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stress_runs = pd.read_csv(aggregate_dir / "stress_runs.csv")
    surv = pd.read_csv(aggregate_dir / "stress_survival.csv")
    gap = pd.read_csv(aggregate_dir / "stress_gap.csv")
    runs_long = load_table(aggregate_dir, "runs")
    plt.rcdefaults()
    figs = {
        "stress_survival": plot_survival(surv)[0],
        "stress_mismatch": _per_step(runs_long, "mismatch/token/logp_abs_diff_mean",
                                     "mean |delta logp| per token (nats)", True, stress_runs)[0],
        "stress_reward": _per_step(runs_long, "reward/mean", "reward", False, stress_runs)[0],
        "stress_dose": plot_dose(stress_runs)[0],
        "stress_gap": plot_gap(gap)[0],
    }
    paths = []
    for stem in STEMS:
        for fmt in formats:
            p = out_dir / f"{stem}.{fmt}"
            meta = {"CreationDate": None} if fmt == "pdf" else {"Software": None}
            figs[stem].savefig(p, dpi=120, metadata=meta)
            paths.append(p)
        plt.close(figs[stem])
    table = summary_table(stress_runs, gap)
    atomic_write_csv(_frozen(table), out_dir / "stress_summary.csv")
    atomic_write_text(out_dir / "stress_summary.md", _summary_markdown(table))
    return paths + [out_dir / "stress_summary.csv", out_dir / "stress_summary.md"]
