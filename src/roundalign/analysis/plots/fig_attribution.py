"""Figure: where the mismatch comes from (``roundalign attribute``): one waterfall per model and engine.

Each panel: the token-level k3 between the trainer's and the engine's logprobs of the engine's samples, at
identical weights, after equalizing the sources one by one in the documented order (filled markers joined by a
line: the cumulative waterfall, step 0 = nothing equalized) and each source alone against nothing (hollow
markers, just right of its own step). Error bars are 95% bootstrap intervals over prompts. Exact zeros (bitwise equal
logprobs on every token) sit on the floor labelled "0 (bitwise)", a decade below the smallest positive k3; an
interval reaching below it is drawn down to it. Under each step: the k3 it removes, in percent
of step 0's (negative where equalizing it added k3; "0": exactly nothing, "~0%": under half a percent either way).
All panels share one y range.

Reads ``attribution.csv`` (the command's long table; the sweep's aggregate concatenates them with ``model`` and
``engine`` columns); writes ``fig_attribution.<fmt>``: one row of panels per model, one column per engine.
``draw_waterfall`` draws one command's table (``roundalign attribute`` writes it as ``waterfall.png``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from roundalign.analysis.plots import _grid, _logaxis, _save, _style, _tables

STEM = "fig_attribution"
TABLE = "attribution"
CUMULATIVE, ALONE = "#0173b2", "#de8f05"
ALONE_DX = 0.12  # the alone markers beside the cumulative ones at the same step (often the same value)
PANEL_IN = (5.0, 2.9)  # width, height of one panel: room for up to nine two-line step labels
YLABEL = "token k3 (nats)"


def k3_floor(df: pd.DataFrame) -> float | None:
    """Where exact zeros are drawn: a decade below the smallest positive k3 of ``df`` (None without a zero k3 or
    interval end). The point values only: an interval whose lower end is a rounding's few ulps (1e-14 against
    1e-4) would stretch the axis over ten empty decades; such an end is drawn down to the floor."""
    k3 = df[df["metric"] == "k3"]
    floor = _logaxis.zero_floor(k3["value"])
    if floor is None and (k3["ci_low"] <= 0).any():
        floor = _logaxis.zero_floor(np.concatenate([k3["value"].to_numpy(dtype="float64"), [0.0]]))
    return floor


def waterfall_panel(ax, df: pd.DataFrame, floor: float | None) -> None:
    """One attribution's waterfall on ``ax`` (``df``: its rows of attribution.csv)."""
    k3 = df[df["metric"] == "k3"]
    cum = k3[k3["mode"] == "cumulative"].sort_values("step", kind="stable")
    alone = k3[k3["mode"] == "alone"].sort_values("step", kind="stable")
    if cum.empty:
        _style.no_data(ax, "no data: no k3 rows")
        return
    x = cum["step"].to_numpy()
    labels = ["none"] + [f"+{s}" for s in cum["source"].iloc[1:]]

    def pts(rows):
        v = rows["value"].to_numpy(dtype="float64")
        lo, hi = rows["ci_low"].to_numpy(dtype="float64"), rows["ci_high"].to_numpy(dtype="float64")
        if floor is not None:  # zeros on the floor, and interval ends below it drawn down to it
            v, lo, hi = (np.where(a > floor, a, floor) for a in (v, lo, hi))
        return v, np.clip(v - lo, 0, None), np.clip(hi - v, 0, None)

    v, dlo, dhi = pts(cum)
    ax.errorbar(x, v, yerr=[dlo, dhi], color=CUMULATIVE, marker="o", ms=5, lw=1.2, capsize=2, zorder=3,
                gid="cumulative")
    if len(alone):
        va, alo, ahi = pts(alone)
        ax.errorbar(alone["step"].to_numpy() + ALONE_DX, va, yerr=[alo, ahi], color=ALONE, marker="o", ms=5, mfc="white",
                    lw=0, elinewidth=1, capsize=2, zorder=4, gid="alone")
    _logaxis.set_log_y(ax)
    _logaxis.mark_floor(ax, floor)
    ax.set_xticks(x)
    ax.set_xlim(x.min() - 0.5, x.max() + 0.5)
    base = float(cum["value"].iloc[0])
    removed = df[(df["metric"] == "k3_removed") & (df["mode"] == "cumulative")].set_index("step")["value"]
    ticks = [labels[0]] + [f"{lab}\n{share(removed.get(s, np.nan), base)}" if base > 0 else lab
                           for s, lab in zip(x[1:], labels[1:])]
    ax.set_xticklabels(ticks, fontsize=7)
    ax.set_ylabel(YLABEL)


def share(removed: float, base: float) -> str:
    """What a step removes, in percent of step 0's k3: "0" when exactly nothing (the two sides already agreed bit
    for bit there), "~0%" when less than half a percent either way, else the rounded percentage."""
    if removed == 0:
        return "0"
    if not np.isfinite(removed):
        return "?"
    pct = 100 * removed / base
    return "~0%" if abs(pct) < 0.5 else f"{pct:.0f}%"


def y_limits(df: pd.DataFrame, floor: float | None) -> tuple[float, float] | None:
    """One log y range for every panel: from below the floor (without one, a decade below the smallest k3; a lower
    interval end further down runs off the panel) to above the largest interval end."""
    k3 = df[df["metric"] == "k3"]
    values = k3["value"].to_numpy(dtype="float64")
    tops = np.concatenate([values, k3["ci_high"].to_numpy(dtype="float64")])
    values, tops = values[np.isfinite(values) & (values > 0)], tops[np.isfinite(tops) & (tops > 0)]
    if not len(tops):
        return None
    lo = floor / 3 if floor is not None else (values.min() if len(values) else tops.min()) / 10
    return lo, tops.max() * 2


def _handles() -> list[Line2D]:
    return [Line2D([], [], color=CUMULATIVE, marker="o", ms=5, lw=1.2, label="cumulative: sources equalized so far"),
            Line2D([], [], color=ALONE, marker="o", ms=5, mfc="white", lw=0, label="this source alone")]


def draw_waterfall(rows, path: str | Path, title: str = "") -> Path:
    """The waterfall of one ``roundalign attribute`` run (its rows) as one figure at ``path``."""
    df = pd.DataFrame(rows)
    path = Path(path)
    with _style.style():
        fig = Figure(figsize=(7.5, 3.6), layout="constrained")
        ax = fig.subplots()
        waterfall_panel(ax, df, k3_floor(df))
        ax.set_title(title, fontsize=9)
        fig.legend(handles=_handles(), loc="outside lower center", ncols=2, fontsize=7)
    _save.save(fig, path.parent, path.stem, (path.suffix.lstrip("."),))
    return path


def plot_attribution(attribution: pd.DataFrame):
    """One panel per (model, engine) of the sweep's attribution table: models in rows, engines in columns, one y
    scale for all (so panels compare). Returns (fig, axes: models x engines)."""
    df = attribution
    models = sorted(set(df["model"])) if len(df) else []
    engines = sorted(set(df["engine"])) if len(df) else []
    floor = k3_floor(df) if len(df) else None
    with _style.style():
        nrows, ncols = max(len(models), 1), max(len(engines), 1)
        fig = Figure(figsize=(PANEL_IN[0] * ncols + 0.4, PANEL_IN[1] * nrows + 1.0))
        # below each panel its two-line step labels, above it its title; the legend at the bottom
        _grid.set_margins(fig, left=0.64, right=0.05, top=0.64, bottom=0.72, wspace=0.5, hspace=0.66)
        axes = fig.subplots(nrows, ncols, squeeze=False)
        if not models:
            _style.no_data(axes[0, 0], "no data: attribution.csv has no rows")
        for i, model in enumerate(models):
            for j, engine in enumerate(engines):
                ax = axes[i, j]
                rows = df[(df["model"] == model) & (df["engine"] == engine)]
                ax.set_title(f"{model}: {engine}", fontsize=9)
                if rows.empty:
                    _style.no_data(ax, f"no attribution of\n{model} against {engine}")
                    continue
                waterfall_panel(ax, rows, floor)
                if j:
                    ax.set_ylabel("")
        limits = y_limits(df, floor) if len(df) else None
        for ax in axes.ravel():
            if limits is not None and ax.get_yscale() == "log":
                ax.set_ylim(*limits)  # one scale: the panels compare
        fig.legend(handles=_handles(), loc="outside lower center", ncols=2, fontsize=8)
        _style.suptitle(fig, "Where the train-vs-engine mismatch comes from: token k3 as its sources are equalized", df,
                        "error bars: 95% bootstrap CI over prompts; under each step: % of step 0's k3 it removes")
    return fig, axes


def make(aggregate_dir: str | Path, out_dir: str | Path, formats=("png", "pdf")) -> list[Path]:
    tables = _tables.tables(aggregate_dir)
    fig, _ = plot_attribution(tables[TABLE])
    return _save.save(fig, out_dir, STEM, _save.check_formats(formats))
