"""The dose experiment's own figure (the stress figures draw the rest: reward per step, survival, mismatch per dose):
learning against the initial policy, per variant, against the dose.

``dose_gain``: left, the held-out gain (final minus initial held-out reward, ``dose_outcome.csv``) per variant and dose,
each run a dot and the mean with its 95% seed-bootstrap interval (``dose_gain.csv``); right, the held-out reward
itself, the initial policy's per dose (a black bar: what the coarser engine costs by itself) and each variant's
final, with the same intervals.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from roundalign.analysis.plots import _grid, _save, _style, _tables

STEMS = ("dose_gain",)
TABLES = ("dose_outcome", "dose_gain")
NUM_RESAMPLES = 2000

CAPTION = (
    "Learning against the initial policy under a rounding dose at the aligned regions (the engine rounds every "
    "RMSNorm output, the RoPE'd q/k and the SwiGLU output to the dose's mantissa bits; 7 = bf16, no dose). Left: "
    "held-out gain (reward of the final policy minus that of the warm start, both sampled by the run's own engine on "
    "the same held-out problems and draws) per variant and dose; dots are runs, markers the mean over seeds with a "
    "95% bootstrap interval. Right: the held-out reward itself; black bars the initial policy's (the same for every "
    "variant at one dose), markers each variant's final policy.")


def _boot(values: np.ndarray, rng) -> tuple[float, float]:
    if len(values) < 2:
        return float("nan"), float("nan")
    means = values[rng.integers(0, len(values), size=(NUM_RESAMPLES, len(values)))].mean(axis=1)
    return tuple(np.percentile(means, [2.5, 97.5]))


def plot_gain(outcome: pd.DataFrame):
    """(fig, axes) of the dose_gain figure from ``dose_outcome.csv``'s rows."""
    rng = np.random.default_rng(0)
    doses = sorted(outcome["dose"].unique(), reverse=True)  # no dose first, then coarser
    variants = _style.variant_order(outcome["variant"].unique())
    pal = _style.palette(variants)
    width = 0.8 / max(len(variants), 1)
    x = {(d, v): i - 0.4 + width * (k + 0.5) for i, d in enumerate(doses) for k, v in enumerate(variants)}
    with _style.style():
        fig = Figure(figsize=(10, 3.6))
        _grid.set_margins(fig, left=0.58, right=0.05, top=0.3, bottom=0.5, wspace=0.62)
        axes = fig.subplots(1, 2)
        for ax, col in zip(axes, ("gain", "heldout_final")):
            for v in variants:
                xs, ys, los, his = [], [], [], []
                for d in doses:
                    vals = outcome.loc[(outcome["dose"] == d) & (outcome["variant"] == v), col].dropna().to_numpy()
                    if not len(vals):
                        continue
                    ax.scatter(np.full(len(vals), x[(d, v)]) + np.linspace(-0.03, 0.03, len(vals)), vals, s=6,
                               color=pal[v], alpha=0.45, lw=0, gid=f"runs:{col}:{v}")
                    lo, hi = _boot(vals, rng)
                    xs.append(x[(d, v)])
                    ys.append(vals.mean())
                    los.append(lo)
                    his.append(hi)
                ys, los, his = map(np.asarray, (ys, los, his))
                ax.errorbar(xs, ys, yerr=np.vstack([ys - los, his - ys]), fmt="o", ms=5, mfc="white", mew=1.3,
                            color=pal[v], elinewidth=1.3, capsize=2.5, gid=f"mean:{col}:{v}", label=v)
            ax.set_xticks(range(len(doses)), [f"{d} bits" + (" (bf16)" if d == 7 else "") for d in doses])
            ax.set_xlim(-0.5, len(doses) - 0.5)
            ax.set_xlabel("dose: mantissa bits the engine keeps at the regions")
            ax.grid(False, axis="x")
        init = outcome.groupby("dose")["heldout_initial"].mean()
        for i, d in enumerate(doses):
            axes[1].hlines(init[d], i - 0.42, i + 0.42, color="black", lw=2.2, gid=f"initial:{d}")
        axes[0].axhline(0, color="0.4", lw=0.9, ls=":")
        axes[0].set_ylabel("held-out gain (final - initial)")
        axes[1].set_ylabel("held-out reward (bar: initial policy)")
        axes[0].legend(loc="best", fontsize=7, frameon=False)
        n = sorted(outcome.groupby(["dose", "variant"]).size().unique())
        fig.suptitle("Learning against the initial policy, per variant and dose "
                     f"({'/'.join(map(str, n))} seeds per cell; 95% bootstrap intervals)", fontsize=9)
    return fig, axes


def make(aggregate_dir, out_dir, formats=("png", "pdf")) -> list[Path]:
    formats = _save.check_formats(formats)
    tables = _tables.tables(aggregate_dir)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return _save.save(plot_gain(tables["dose_outcome"])[0], out_dir, "dose_gain", formats)
