"""Figure 1: training reward vs optimizer step, one panel per model, hue = variant.

Reads ``runs.csv`` (metric ``reward/mean``) and ``run_status.csv`` (reward-collapse flags); writes
``fig_reward.<fmt>``.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from roundalign.analysis.plots import _save, _steps, _style, _tables

STEM = "fig_reward"
METRIC = "reward/mean"


def plot_reward(runs: pd.DataFrame, run_status: pd.DataFrame | None = None, *, n_boot: int = _steps.N_BOOT,
                seed: int = _steps.SEED):
    """Mean reward per step (mean over seeds, bootstrap 95% CI band over seeds). Runs whose reward collapse
    was flagged (``reward_collapse_step``) get an unlabelled triangle in the variant's colour at that step
    (gid "reward_collapse"; the flag is frequent in short noisy runs, so no text). Returns (fig, axes: one
    per model)."""
    with _style.style():
        fig, axes, _ = _steps.step_figure(runs, [(METRIC, "reward (mean over completions)")], n_boot=n_boot, seed=seed,
                                          title="Training reward", log_y=False)
        marked = 0
        if run_status is not None and len(run_status) and METRIC in set(runs["metric"]):
            rows = _steps.runs_metric(runs, METRIC)
            for ax, model in zip(axes, _steps.models_of(runs)):
                events = run_status[(run_status["model"] == model) & run_status["reward_collapse_step"].notna()]
                marked += _steps.mark_run_events(ax, rows[rows["model"] == model], events, "reward_collapse_step",
                                                 marker="v", gid="reward_collapse", verb="reward collapse",
                                                 label=False)
        variants = _style.variant_order(_steps.runs_metric(runs, METRIC)["variant"])
        _style.variant_legend(fig, variants, [_steps.event_handle("v", "reward collapse flagged")] if marked else [])
    return fig, axes


def make(aggregate_dir: str | Path, out_dir: str | Path, formats=("png", "pdf")) -> list[Path]:
    tables = _tables.tables(aggregate_dir)
    fig, _ = plot_reward(tables["runs"], tables["run_status"])
    return _save.save(fig, out_dir, STEM, _save.check_formats(formats))
