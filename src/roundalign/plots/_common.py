"""Shared plumbing of the figure modules: reading the aggregate, a fixed style, panel grids, the variant
palette, log axes that keep exact zeros visible, "no data" notes and byte-stable saving.

Figures are built on ``matplotlib.figure.Figure`` directly (never pyplot), so no GUI backend is touched,
no global figure list grows, and PNGs are rendered by Agg. Every rcParam is reset to matplotlib's defaults
inside ``style()`` (the user's matplotlibrc cannot change the bytes), and metadata that would carry a
timestamp or a hash seed is removed at save time.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import matplotlib as mpl
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from ..io import atomic_path

FORMATS = ("png", "pdf", "svg")
DPI = 150
PANEL_SIZE_IN = (3.4, 2.6)  # width, height of one panel, inches
MIN_WIDTH_IN = 6.5  # room for a two-line title and the legend beside a single panel
N_BOOT = 1000  # bootstrap resamples of each CI band (seaborn's default), seeded by SEED
SEED = 0
STEP_LABEL = "optimizer step"
ZERO_LABEL = "0 (bitwise)"

# Per-format metadata that drops the creation date (PDF, SVG) and the software string (PNG), so that
# reruns produce identical bytes.
_METADATA = {"png": {"Software": None}, "pdf": {"CreationDate": None}, "svg": {"Date": None}}

_TABLES = {
    "runs": {"sweep": "str", "model": "str", "variant": "str", "seed": "int64", "step": "int64", "metric": "str",
             "value": "float64", "status": "str"},
    "run_status": {"sweep": "str", "model": "str", "variant": "str", "seed": "int64", "status": "str",
                   "last_step": "float64", "collapse_step": "float64", "collapse_reason": "str",
                   "reward_collapse_step": "float64", "wall_time_s": "float64"},
    "probe": {"sweep": "str", "model": "str", "engine": "str", "variant": "str", "level": "str", "metric": "str",
              "value": "float64"},
    "probe_layers": {"sweep": "str", "model": "str", "engine": "str", "variant": "str", "layer": "int64",
                     "metric": "str", "value": "float64"},
}


def load_table(aggregate_dir: str | Path, name: str) -> pd.DataFrame:
    """Read ``<aggregate_dir>/<name>.csv`` with fixed dtypes; FileNotFoundError names what is missing."""
    aggregate_dir = Path(aggregate_dir)
    if not aggregate_dir.is_dir():
        raise FileNotFoundError(f"aggregate directory {aggregate_dir} does not exist "
                                f"(run `roundalign aggregate --results R --out {aggregate_dir}` first)")
    path = aggregate_dir / f"{name}.csv"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (written by `roundalign aggregate`)")
    dtypes = _TABLES[name]
    try:
        return pd.read_csv(path, dtype=dtypes, keep_default_na=False, na_values={c: [""] for c, t in
                                                                              dtypes.items() if t != "str"})
    except (ValueError, pd.errors.ParserError) as exc:
        raise ValueError(f"{path}: not an aggregate table ({exc})") from None


@contextlib.contextmanager
def style():
    """Matplotlib defaults + seaborn's whitegrid/paper look, whatever the user's matplotlibrc says."""
    import seaborn as sns

    with mpl.rc_context():
        mpl.rcdefaults()  # the backend is not reset (matplotlib's style blacklist)
        mpl.rcParams.update(sns.axes_style("whitegrid"))
        mpl.rcParams.update(sns.plotting_context("paper"))
        mpl.rcParams.update({"svg.hashsalt": "roundalign", "figure.dpi": DPI, "savefig.dpi": DPI,
                             "legend.frameon": False})
        yield


def save(fig: Figure, out_dir: str | Path, stem: str, formats) -> list[Path]:
    """Write ``<out_dir>/<stem>.<fmt>`` for each format (atomically) and return the paths."""
    paths = []
    with style():
        # Lay out once and freeze: constrained layout is not idempotent (a second pass can move the axes by
        # a fraction of a point), so without this the bytes of a format would depend on which formats were
        # saved before it. Every format now shares the one layout.
        fig.draw_without_rendering()
        fig.set_layout_engine("none")
    for fmt in formats:
        path = Path(out_dir) / f"{stem}.{fmt}"
        with style(), atomic_path(path) as tmp:
            fig.savefig(tmp, format=fmt, metadata=_METADATA[fmt])
        paths.append(path)
    return paths


def check_formats(formats) -> tuple[str, ...]:
    formats = tuple(formats)
    bad = [f for f in formats if f not in FORMATS]
    if bad or not formats:
        raise ValueError(f"formats {', '.join(bad) or '(none)'} not supported; choose from {', '.join(FORMATS)}")
    return formats


# ----------------------------------------------------------------------------------------------- layout

def grid(nrows: int, ncols: int, *, sharex=False, sharey=False) -> tuple[Figure, np.ndarray]:
    width = max(PANEL_SIZE_IN[0] * ncols + 1.3, MIN_WIDTH_IN)
    fig = Figure(figsize=(width, PANEL_SIZE_IN[1] * nrows + 0.7), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False, sharex=sharex, sharey=sharey)
    return fig, axes


def wrapped_grid(n: int) -> tuple[Figure, np.ndarray]:
    """One panel per item, wrapped into columns (1-3 -> one row; 4 -> 2x2; more -> 3 or 4 columns).
    Returns the figure and the n used axes (the spare cells are removed)."""
    n = max(n, 1)
    ncols = n if n <= 3 else min(4, math.ceil(math.sqrt(n)))
    nrows = math.ceil(n / ncols)
    fig, axes = grid(nrows, ncols)
    flat = axes.ravel()
    for ax in flat[n:]:
        ax.remove()
    return fig, flat[:n]


def variant_order(variants) -> list[str]:
    """The trainer variants in their canonical order (baseline first, full alignment, then IS corrections),
    unknown names after them, sorted."""
    from ..config import TRAIN_VARIANTS

    present = set(variants)
    return [v for v in TRAIN_VARIANTS if v in present] + sorted(present - set(TRAIN_VARIANTS))


def palette(variants) -> dict[str, tuple]:
    """A fixed colour per variant (by its canonical position, so `full` has one colour in every figure)."""
    import seaborn as sns
    from ..config import TRAIN_VARIANTS

    colors = sns.color_palette("colorblind", 10)
    known = list(TRAIN_VARIANTS)
    extra = sorted(set(variants) - set(known))
    return {v: colors[(known.index(v) if v in known else len(known) + extra.index(v)) % len(colors)]
            for v in variants}


def variant_legend(fig: Figure, variants, extra_handles=()) -> None:
    """One legend for the whole figure, outside the panels on the right."""
    pal = palette(variants)
    handles = [Line2D([], [], color=pal[v], lw=2, label=v) for v in variants] + list(extra_handles)
    if handles:
        fig.legend(handles=handles, loc="outside right center", title="variant")


def no_data(ax, message: str) -> None:
    """Replace a panel's contents by a centred note (the figure still renders)."""
    ax.text(0.5, 0.5, message, transform=ax.transAxes, ha="center", va="center", fontsize=8, color="0.35",
            gid="no_data")
    ax.set_xticks([])
    ax.set_yticks([])


def suptitle(fig: Figure, title: str, table: pd.DataFrame, subtitle: str = "") -> None:
    """Title on the first line; the sweep name and ``subtitle`` (what lines and bands are) on the second."""
    sweeps = sorted(set(table["sweep"])) if "sweep" in table and len(table) else []
    second = "; ".join(x for x in ((f"sweep {sweeps[0]}" if len(sweeps) == 1 else ""), subtitle) if x)
    fig.suptitle(title + (f"\n{second}" if second else ""), fontsize=9.5)


# ----------------------------------------------------------------------------------------- log axes

def zero_floor(values) -> float | None:
    """Where to draw exact zeros on a log axis: a decade below the smallest positive finite value (None
    when there is no zero to draw). Exact zeros are the point of the project (bitwise-aligned runs), so
    they are drawn at this floor and labelled rather than silently dropped by the log scale."""
    v = np.asarray(values, dtype="float64")
    v = v[np.isfinite(v)]
    if not (v <= 0).any():
        return None
    pos = v[v > 0]
    smallest = pos.min() if len(pos) else 1.0
    return 10.0 ** (math.floor(math.log10(smallest)) - 1)


def apply_floor(df: pd.DataFrame, floor: float | None) -> pd.DataFrame:
    """Non-finite values dropped; values <= 0 moved to ``floor`` (dropped if there is none)."""
    df = df[np.isfinite(df["value"])]
    if floor is None:
        return df[df["value"] > 0]
    return df.assign(value=df["value"].where(df["value"] > 0, floor))


def mark_floor(ax, floor: float | None) -> None:
    if floor is None:
        return
    ax.axhline(floor, color="0.5", lw=0.8, ls=":", zorder=0, gid="zero_floor")
    ax.text(0.01, floor, ZERO_LABEL, transform=ax.get_yaxis_transform(), ha="left", va="bottom",
            fontsize=7, color="0.35")
    lo, hi = ax.get_ylim()
    ax.set_ylim(min(lo, floor / 3), hi)


# ------------------------------------------------------------------------------------------ lines

def mean_and_ci(df: pd.DataFrame, *, n_boot: int, seed: int, level: float = 95.0) -> pd.DataFrame:
    """Per step: the mean of ``value`` over seeds and a percentile bootstrap CI of that mean.

    Columns step, mean, lo, hi, num_seeds (lo = hi = NaN with a single seed: no band). The same statistic
    as seaborn's ``errorbar=("ci", level)``, but vectorised: seaborn resamples in a Python loop per
    (line, step), about 15 ms each at 1000 resamples, i.e. minutes for a paper sweep. Steps with the same
    number of seeds share one (n_boot, num_seeds) index draw from ``default_rng(seed)``, so every step's
    interval is an ordinary bootstrap interval and reruns are identical.
    """
    out = []
    rng = np.random.default_rng(seed)
    by_step = {step: g["value"].to_numpy(dtype="float64") for step, g in df.groupby("step", sort=True)}
    sizes = sorted({len(v) for v in by_step.values()})
    draws = {n: rng.integers(0, n, size=(n_boot, n)) for n in sizes if n > 1}
    for n in sizes:
        steps = [s for s, v in by_step.items() if len(v) == n]
        vals = np.stack([by_step[s] for s in steps])  # (steps, n)
        mean = vals.mean(axis=1)
        if n > 1:
            boots = vals[:, draws[n]].mean(axis=2)  # (steps, n_boot)
            lo, hi = np.percentile(boots, [(100 - level) / 2, 100 - (100 - level) / 2], axis=1)
        else:
            lo = hi = np.full(len(steps), np.nan)
        out.append(pd.DataFrame({"step": steps, "mean": mean, "lo": lo, "hi": hi, "num_seeds": n}))
    if not out:
        return pd.DataFrame(columns=["step", "mean", "lo", "hi", "num_seeds"])
    return pd.concat(out, ignore_index=True).sort_values("step", kind="stable").reset_index(drop=True)


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
            ax.fill_between(stats["step"], stats["lo"], stats["hi"], color=pal[variant], alpha=0.2, lw=0,
                            gid=f"ci:{variant}")


def runs_metric(runs: pd.DataFrame, metric: str) -> pd.DataFrame:
    return runs[runs["metric"] == metric]


def models_of(*tables: pd.DataFrame) -> list[str]:
    return sorted(set().union(*(set(t["model"]) for t in tables if len(t))))


# ------------------------------------------------------------------------------- metric vs step grids

def step_figure(runs: pd.DataFrame, metrics: list[tuple[str, str]], *, title: str, log_y: bool, n_boot: int,
                seed: int, hline: float | None = None,
                subtitle: str = "lines: mean over seeds; bands: 95% bootstrap CI over seeds"):
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
    variants = variant_order(present["variant"])
    floors: dict[str, float | None] = {}
    if not models or present.empty:
        fig, axes = grid(1, 1)
        no_data(axes[0, 0], "no data: " + ", ".join(names) + " not in runs.csv")
        suptitle(fig, title, runs, subtitle)
        return fig, (axes[0] if len(metrics) == 1 else axes), floors
    if len(metrics) == 1:
        fig, flat = wrapped_grid(len(models))
        axes = flat[None, :]
    else:
        fig, axes = grid(len(metrics), len(models))
    from matplotlib.ticker import MaxNLocator

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
                ax.set_yscale("log")  # display only: the mean and CI are of the values, not of their logs
                mark_floor(ax, floors[metric])
            if hline is not None:
                ax.axhline(hline, color="0.3", lw=0.8, ls="--", zorder=0)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_xlabel(STEP_LABEL)
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
