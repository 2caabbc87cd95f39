"""Figure 2: token-level k3 mismatch (train vs inference engine) vs optimizer step, log scale, one panel
per model, hue = variant; the collapse step of every collapsed run is marked with an x.

Reads ``runs.csv`` (``mismatch/token/k3``) and ``run_status.csv`` (collapse steps); writes ``fig_k3.<fmt>``.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from roundalign.analysis.plots import _save, _steps, _style, _tables

STEM = "fig_k3"
METRIC = "mismatch/token/k3"


def plot_k3(runs: pd.DataFrame, run_status: pd.DataFrame | None = None, *, n_boot: int = _steps.N_BOOT,
            seed: int = _steps.SEED):
    """k3 per step (mean over seeds, bootstrap 95% CI). Exact zeros are drawn at a floor labelled
    "0 (bitwise)". Each run with a ``collapse_step`` gets an 'x' (gid "collapse") at that step on its own
    last logged value. Returns (fig, axes: one per model)."""
    with _style.style():
        fig, axes, floors = _steps.step_figure(
            runs, [(METRIC, "k3 KL estimate (nats / token)")], log_y=True, n_boot=n_boot, seed=seed,
            title="Train-vs-inference mismatch: token-level k3")
        marked = 0
        if run_status is not None and len(run_status) and METRIC in set(runs["metric"]):
            rows = _steps.runs_metric(runs, METRIC)
            for ax, model in zip(axes, _steps.models_of(runs)):
                events = run_status[(run_status["model"] == model) & run_status["collapse_step"].notna()]
                marked += _steps.mark_run_events(ax, rows[rows["model"] == model], events, "collapse_step", marker="x",
                                                 gid="collapse", verb="collapsed", floor=floors.get(METRIC))
        _style.variant_legend(fig, _style.variant_order(_steps.runs_metric(runs, METRIC)["variant"]),
                              [_steps.event_handle("x", "collapse step")] if marked else [])
    return fig, axes


def make(aggregate_dir: str | Path, out_dir: str | Path, formats=("png", "pdf")) -> list[Path]:
    tables = _tables.tables(aggregate_dir)
    fig, _ = plot_k3(tables["runs"], tables["run_status"])
    return _save.save(fig, out_dir, STEM, _save.check_formats(formats))
