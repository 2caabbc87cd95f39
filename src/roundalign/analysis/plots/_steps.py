"""Metric-vs-step figures: seeded bootstrap mean and band over seeds, the step-figure grid, run-event markers."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from matplotlib.lines import Line2D
from matplotlib.patches import Polygon
from matplotlib.ticker import MaxNLocator, StrMethodFormatter

from roundalign.analysis.plots._grid import grid, wrapped_grid
from roundalign.analysis.plots._logaxis import apply_floor, mark_floor, set_log_y, zero_floor
from roundalign.analysis.plots._style import no_data, palette, suptitle, variant_order

N_BOOT = 1000  # bootstrap resamples of each CI band (seaborn's default), seeded by SEED
SEED = 0
STEP_LABEL = "optimizer step"


def mean_and_ci(df: pd.DataFrame, *, n_boot: int, seed: int, level: float = 95.0) -> pd.DataFrame:
    """Per step: the mean of ``value`` over seeds and a percentile bootstrap CI of that mean.

    Columns step, mean, lo, hi, num_seeds (lo = hi = NaN with a single seed: no band). The same statistic
    as seaborn's ``errorbar=("ci", level)``, but vectorised: seaborn resamples in a Python loop per
    (line, step), about 15 ms each at 1000 resamples, i.e. minutes for a paper sweep. Steps with the same
    number of seeds share one (n_boot, num_seeds) index draw from ``default_rng(seed)``, so every step's
    interval is an ordinary bootstrap interval and reruns are identical.
    """
    columns = ["step", "mean", "lo", "hi", "num_seeds"]
    order = np.argsort(df["step"].to_numpy(), kind="stable")  # stable: a step's values keep the table's order
    steps = df["step"].to_numpy()[order]
    values = df["value"].to_numpy(dtype="float64")[order]
    if not len(steps):
        return pd.DataFrame(columns=columns)
    uniq, start, counts = np.unique(steps, return_index=True, return_counts=True)
    rng = np.random.default_rng(seed)
    sizes = sorted(set(counts.tolist()))
    # each resample as counts of each draw: (n_boot, n); the resampled means are then one matrix product
    weights = {}
    for n in sizes:
        if n > 1:
            draws = rng.integers(0, n, size=(n_boot, n))
            w = np.zeros((n_boot, n))
            np.add.at(w, (np.arange(n_boot)[:, None], draws), 1.0 / n)
            weights[n] = w
    out = []
    for n in sizes:
        which = np.flatnonzero(counts == n)
        vals = values[start[which][:, None] + np.arange(n)]  # (steps, n)
        mean = vals.mean(axis=1)
        if n > 1:
            boots = vals @ weights[n].T  # (steps, n_boot)
            lo, hi = np.percentile(boots, [(100 - level) / 2, 100 - (100 - level) / 2], axis=1)
        else:
            lo = hi = np.full(len(which), np.nan)
        out.append(pd.DataFrame({"step": uniq[which], "mean": mean, "lo": lo, "hi": hi, "num_seeds": n}))
    return pd.concat(out, ignore_index=True).sort_values("step", kind="stable").reset_index(drop=True)


def band(ax, x, lo, hi, *, step: str | None = None, gid: str | None = None, **kwargs) -> list:
    """Shade between ``lo`` and ``hi`` over ``x`` (a confidence band), one polygon per run of finite values;
    ``step="post"`` for a step function. What ``fill_between`` draws, but far cheaper to build (mpl 3.11's
    fill_between took ~9 ms per band, a tenth of `make figures` for ~300 bands). Returns the patches."""
    x, lo, hi = (np.asarray(v, dtype="float64") for v in (x, lo, hi))
    ok = np.isfinite(x) & np.isfinite(lo) & np.isfinite(hi)
    patches = []
    edges = np.flatnonzero(np.diff(np.concatenate([[0], ok.astype(int), [0]])))
    for start, stop in zip(edges[::2], edges[1::2]):
        xs, l, h = x[start:stop], lo[start:stop], hi[start:stop]
        if step == "post":  # each value holds until the next x
            xs = np.repeat(xs, 2)[1:]
            l, h = np.repeat(l, 2)[:-1], np.repeat(h, 2)[:-1]
        if len(xs) < 2:
            continue
        xy = np.column_stack([np.concatenate([xs, xs[::-1]]), np.concatenate([l, h[::-1]])])
        poly = Polygon(xy, closed=True, gid=gid, **kwargs)
        # add_artist + update_datalim rather than add_patch: add_patch walks the outline as Bezier segments to
        # find its extent, 9 ms for a 120-step band; the extent of a polygon is that of its vertices.
        ax.add_artist(poly)
        ax.update_datalim(xy)
        ax._request_autoscale_view()
        patches.append(poly)
    return patches


def metric_lines(ax, df: pd.DataFrame, variants: list[str], *, n_boot: int, seed: int) -> None:
    """Mean over seeds per (variant, step) with a bootstrap 95% CI band (no band for a single seed)."""
    pal = palette(variants)
    for variant in variants:
        d = df[df["variant"] == variant]
        if d.empty:
            continue
        stats = mean_and_ci(d, n_boot=n_boot, seed=seed)
        ax.plot(stats["step"], stats["mean"], color=pal[variant], lw=1.5, label=variant, gid=f"mean:{variant}")
        if stats["num_seeds"].max() > 1:
            band(ax, stats["step"], stats["lo"], stats["hi"], color=pal[variant], alpha=0.2, lw=0,
                            gid=f"ci:{variant}")


def runs_metric(runs: pd.DataFrame, metric: str) -> pd.DataFrame:
    return runs[runs["metric"] == metric]


def models_of(*tables: pd.DataFrame) -> list[str]:
    return sorted(set().union(*(set(t["model"].unique()) for t in tables if len(t))))


# ------------------------------------------------------------------------------- metric vs step grids

def seeds_subtitle(rows: pd.DataFrame) -> str:
    """What the lines and bands of a per-step figure are, given its rows: with one seed per (model, variant) a
    line is that run and there is no interval to draw, which the subtitle says rather than promise bands."""
    if rows.empty:
        return ""
    per_line = rows.groupby(["model", "variant"])["seed"].nunique()
    if per_line.max() <= 1:
        return "one seed per variant: each line is a single run (no interval over seeds)"
    text = "lines: mean over seeds; bands: 95% bootstrap CI over seeds"
    return text + (" (none where a single seed)" if per_line.min() <= 1 else "")


def step_figure(runs: pd.DataFrame, metrics: list[tuple[str, str]], *, title: str, log_y: bool, n_boot: int,
                seed: int, hline: float | None = None, subtitle: str | None = None):
    """Metric(s) vs optimizer step, hue = variant, mean over seeds with a bootstrap 95% CI band.

    One metric: one panel per model (wrapped) and a 1-D array of axes. Several metrics: one row per
    metric, one column per model, a 2-D array (metric x model). Every model of ``runs`` gets a panel; a
    model without the metric gets a "no data" note. ``log_y`` draws exact zeros at a floor (see
    ``zero_floor``). ``hline`` draws a reference line (e.g. an importance ratio of 1).
    Returns (fig, axes, floors) with floors[metric] the zero floor used (None if none).
    """
    names = [m for m, _ in metrics]
    models = models_of(runs)
    present = runs[runs["metric"].isin(names)]
    variants = variant_order(present["variant"].unique())
    subtitle = seeds_subtitle(present) if subtitle is None else subtitle
    floors: dict[str, float | None] = {}
    if not models or present.empty:
        fig, axes = grid(1, 1)
        no_data(axes[0, 0], "no data: " + ", ".join(names) + " not in runs.csv")
        suptitle(fig, title, runs, subtitle)
        return fig, (axes[0] if len(metrics) == 1 else axes), floors
    if len(metrics) == 1:
        fig, flat = wrapped_grid(len(models))
        axes = flat[None, :]
    else:  # one step axis per column: tick labels and the x label on the bottom row only
        fig, axes = grid(len(metrics), len(models), sharex="col")
    for i, (metric, ylabel) in enumerate(metrics):
        rows = present[present["metric"] == metric]
        floors[metric] = zero_floor(rows["value"]) if log_y else None
        for j, model in enumerate(models):
            ax = axes[i, j]
            ax.set_title(model if len(metrics) == 1 or i == 0 else "", fontsize=9)
            d = rows[rows["model"] == model]
            d = apply_floor(d, floors[metric]) if log_y else d[np.isfinite(d["value"])]
            if d.empty:
                no_data(ax, f"no data:\n{metric}")
                ax.set_ylabel(ylabel)
                continue
            metric_lines(ax, d, variants, n_boot=n_boot, seed=seed)
            if log_y:
                set_log_y(ax)  # display only: the mean and CI are of the values, not of their logs
                mark_floor(ax, floors[metric])
            if hline is not None:
                ax.axhline(hline, color="0.3", lw=0.8, ls="--", zorder=0)
            ax.xaxis.set_major_locator(MaxNLocator(nbins=5, integer=True))  # ~5 step labels: enough to read
            # integer steps print the same through a plain format, without ScalarFormatter's offset and
            # precision search at every draw (~0.5 s a figure of 24 panels)
            ax.xaxis.set_major_formatter(StrMethodFormatter("{x:.0f}"))
            ax.set_xlabel(STEP_LABEL if i == len(metrics) - 1 else "")
            ax.set_ylabel(ylabel)
    suptitle(fig, title, runs, subtitle)
    return fig, (axes[0] if len(metrics) == 1 else axes), floors


def mark_run_events(ax, metric_rows: pd.DataFrame, events: pd.DataFrame, step_column: str, *, marker: str,
                    gid: str, verb: str, floor: float | None = None, label: bool = True) -> int:
    """Mark each run's event step (e.g. its collapse) on its own curve: a marker (gid ``gid``) at (step, the
    run's last plotted value at or before the step) in the variant's colour. With ``label``, a list
    "<variant> s<seed> <verb> @ <step>" goes in the panel's top-right corner (outside the layout, so many
    events cannot squeeze the panel). ``metric_rows`` are one model's rows of the plotted metric (before
    any floor). Returns the number of events marked."""
    pal = palette(sorted(set(events["variant"])))
    order = variant_order(events["variant"])
    events = events.assign(_v=[order.index(v) for v in events["variant"]]).sort_values(["_v", "seed"])
    lines = []
    for ev in events.itertuples(index=False):
        step = getattr(ev, step_column)
        if step is None or not np.isfinite(step):
            continue
        mine = metric_rows[(metric_rows["variant"] == ev.variant) & (metric_rows["seed"] == ev.seed)
                           & (metric_rows["step"] <= step) & np.isfinite(metric_rows["value"])]
        if floor is not None:
            mine = mine.assign(value=mine["value"].where(mine["value"] > 0, floor))
        if len(mine):
            y = float(mine.sort_values("step")["value"].iloc[-1])
        else:  # nothing finite logged before the event: put it at the bottom of the panel
            y = ax.get_ylim()[0]
        text = f"{ev.variant} s{ev.seed} {verb} @ {int(step)}"
        ax.plot([step], [y], marker=marker, ms=9, mew=2, ls="none", color=pal[ev.variant], gid=gid, label=text,
                zorder=5)
        lines.append((text, pal[ev.variant]))
    if label and lines:  # headroom above the data for the list, so it never hides a curve
        lo, hi = ax.get_ylim()
        if ax.get_yscale() == "log":
            ax.set_ylim(lo, hi * 10 ** ((math.log10(hi) - math.log10(lo)) * (0.08 + 0.06 * len(lines))))
        else:
            ax.set_ylim(lo, hi + (hi - lo) * (0.08 + 0.06 * len(lines)))
    for i, (text, color) in enumerate(lines if label else []):
        t = ax.annotate(text, (0.98, 0.97), xycoords="axes fraction", xytext=(0, -9 * i), textcoords="offset points",
                        ha="right", va="top", fontsize=6.5, color=color, gid=f"{gid}_label",
                        bbox={"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none", "alpha": 0.7})
        t.set_in_layout(False)
    return len(lines)


def event_handle(marker: str, label: str) -> Line2D:
    return Line2D([], [], marker=marker, ms=7, mew=2, ls="none", color="0.25", label=label)
