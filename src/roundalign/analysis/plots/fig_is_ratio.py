"""Figure 3: token-level importance ratio pi_train / pi_engine vs optimizer step: one row per statistic
(min, mean, max over the step's tokens), one column per model, hue = variant, dashed line at 1.

Reads ``runs.csv`` (``mismatch/token/is_ratio_{min,mean,max}``); writes ``fig_is_ratio.<fmt>``.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from roundalign.analysis.plots import _save, _steps, _style, _tables

STEM = "fig_is_ratio"
METRICS = [("mismatch/token/is_ratio_min", "min IS ratio per step"),
           ("mismatch/token/is_ratio_mean", "mean IS ratio per step"),
           ("mismatch/token/is_ratio_max", "max IS ratio per step")]


def plot_is_ratio(runs: pd.DataFrame, *, n_boot: int = _steps.N_BOOT, seed: int = _steps.SEED):
    """Returns (fig, axes: 2-D, statistic x model). Linear y: a bitwise-aligned run sits on the line at 1."""
    with _style.style():
        fig, axes, _ = _steps.step_figure(
            runs, METRICS, log_y=False, hline=1.0, n_boot=n_boot, seed=seed,
            title="Token importance ratio π_train / π_engine (unitless)")
        _style.variant_legend(fig, _style.variant_order(runs[runs["metric"].isin([m for m, _ in METRICS])]["variant"]))
    return fig, axes


def make(aggregate_dir: str | Path, out_dir: str | Path, formats=("png", "pdf")) -> list[Path]:
    tables = _tables.tables(aggregate_dir)
    fig, _ = plot_is_ratio(tables["runs"])
    return _save.save(fig, out_dir, STEM, _save.check_formats(formats))
