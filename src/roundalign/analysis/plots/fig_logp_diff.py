"""Figure 4: mean and max |log p_train - log p_engine| over a step's tokens vs optimizer step (nats, log
scale, exact zeros at a labelled floor): one row per statistic, one column per model, hue = variant.

Reads ``runs.csv`` (``mismatch/token/logp_abs_diff_{mean,max}``); writes ``fig_logp_diff.<fmt>``.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from roundalign.analysis.plots import _save, _steps, _style, _tables

STEM = "fig_logp_diff"
METRICS = [("mismatch/token/logp_abs_diff_mean", "mean |Δ log p| (nats)"),
           ("mismatch/token/logp_abs_diff_max", "max |Δ log p| (nats)")]


def plot_logp_diff(runs: pd.DataFrame, *, n_boot: int = _steps.N_BOOT, seed: int = _steps.SEED):
    """Returns (fig, axes: 2-D, statistic x model)."""
    with _style.style():
        fig, axes, _ = _steps.step_figure(
            runs, METRICS, log_y=True, n_boot=n_boot, seed=seed,
            title="Per-token |log-prob difference|, trainer vs engine")
        _style.variant_legend(fig, _style.variant_order(runs[runs["metric"].isin([m for m, _ in METRICS])]["variant"]))
    return fig, axes


def make(aggregate_dir: str | Path, out_dir: str | Path, formats=("png", "pdf")) -> list[Path]:
    tables = _tables.tables(aggregate_dir)
    fig, _ = plot_logp_diff(tables["runs"])
    return _save.save(fig, out_dir, STEM, _save.check_formats(formats))
