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
import re
from pathlib import Path

import matplotlib as mpl
import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import LogFormatterSciNotation, LogLocator, StrMethodFormatter

from roundalign.io import atomic_path

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
    # only where the sweep attributes its mismatch (attribution: in its config)
    "attribution": {"sweep": "str", "model": "str", "engine": "str", "step": "int64", "source": "str", "mode": "str",
                    "metric": "str", "value": "float64", "ci_low": "float64", "ci_high": "float64"},
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
        df = pd.read_csv(path, dtype=dtypes, keep_default_na=False, na_values={c: [""] for c, t in
                                                                            dtypes.items() if t != "str"})
    except (ValueError, pd.errors.ParserError) as exc:
        raise ValueError(f"{path}: not an aggregate table ({exc})") from None
    # Python strings (object dtype), not pandas' default Arrow strings: the figures iterate these columns (sets of
    # models, zips of keys), and iterating an Arrow array element by element was ~3 s of `make figures`.
    return df.astype({c: object for c, t in dtypes.items() if t == "str" and c in df.columns})


class Tables:
    """The aggregate tables of one directory, each read at most once: several figures draw from runs.csv, the
    largest table (11 MB for the stress sweep), and one process draws them all. ``tables[name]`` reads
    ``<name>.csv`` (``load_table``'s fixed dtypes for the general tables, pandas' for the stress tables)."""

    def __init__(self, aggregate_dir: str | Path):
        self.dir = Path(aggregate_dir)
        self._cache: dict[str, pd.DataFrame] = {}

    def __getitem__(self, name: str) -> pd.DataFrame:
        if name not in self._cache:
            if name in _TABLES:
                self._cache[name] = load_table(self.dir, name)
            else:
                path = self.dir / f"{name}.csv"
                if not path.is_file():
                    raise FileNotFoundError(f"{path} does not exist (written by `roundalign aggregate`)")
                self._cache[name] = pd.read_csv(path)
        return self._cache[name]

    def preload(self, extra=()) -> None:
        """Read now every general table this directory holds, and those of ``extra`` that it holds (the parallel
        figure rebuild reads in the parent, so that forked workers inherit the tables instead of each reading)."""
        for name in [*_TABLES, *extra]:
            if self.has(name):
                self[name]

    def has(self, name: str) -> bool:
        return name in self._cache or (self.dir / f"{name}.csv").is_file()


def tables(aggregate: str | Path | Tables) -> Tables:
    """``aggregate`` as a ``Tables`` (a directory path is wrapped; a ``Tables`` is returned as it is)."""
    return aggregate if isinstance(aggregate, Tables) else Tables(aggregate)


# seaborn 0.13.2's axes_style("whitegrid") and plotting_context("paper"), written out: importing seaborn (and
# the scipy.stats it pulls in) cost ~1 s of every figure process; tests/test_plots.py checks these against it.
# Less seaborn's "image.cmap": "rocket", a colormap only an imported seaborn registers (no figure draws an image).
_SEABORN_WHITEGRID_PAPER = {
    "figure.facecolor": "white", "axes.labelcolor": ".15", "xtick.direction": "out", "ytick.direction": "out",
    "xtick.color": ".15", "ytick.color": ".15", "axes.axisbelow": True, "grid.linestyle": "-", "text.color": ".15",
    "font.family": ["sans-serif"], "font.sans-serif": ["Arial", "DejaVu Sans", "Liberation Sans",
                                                       "Bitstream Vera Sans", "sans-serif"],
    "lines.solid_capstyle": "round", "patch.edgecolor": "w", "patch.force_edgecolor": True,
    "xtick.top": False, "ytick.right": False, "axes.grid": True, "axes.facecolor": "white", "axes.edgecolor": ".8",
    "grid.color": ".8", "axes.spines.left": True, "axes.spines.bottom": True, "axes.spines.right": True,
    "axes.spines.top": True, "xtick.bottom": False, "ytick.left": False,
    "axes.linewidth": 1.0, "grid.linewidth": 0.8, "lines.linewidth": 1.2000000000000002,
    "lines.markersize": 4.800000000000001, "patch.linewidth": 0.8, "xtick.major.width": 1.0,
    "ytick.major.width": 1.0, "xtick.minor.width": 0.8, "ytick.minor.width": 0.8,
    "xtick.major.size": 4.800000000000001, "ytick.major.size": 4.800000000000001, "xtick.minor.size": 3.2,
    "ytick.minor.size": 3.2, "font.size": 9.600000000000001, "axes.labelsize": 9.600000000000001,
    "axes.titlesize": 9.600000000000001, "xtick.labelsize": 8.8, "ytick.labelsize": 8.8, "legend.fontsize": 8.8,
    "legend.title_fontsize": 9.600000000000001,
}
# seaborn's "colorblind" palette (10 colours), then near-black: TRAIN_VARIANTS has 11 entries, and a wrap-around
# gave fp32 (the 11th) baseline's blue in the stress figures.
COLORBLIND = ["#0173b2", "#de8f05", "#029e73", "#d55e00", "#cc78bc", "#ca9161", "#fbafe4", "#949494", "#ece133",
              "#56b4e9", "#1a1a1a", "#6a3d9a", "#a50f15", "#1b5e20"]
# One colour per variant. The probe's five (baseline, rope, swiglu, norm, full) keep seaborn's colorblind colours; the
# stress sweep's nine (baseline, rope, full, tis, mis, fp16, fp32-head, full+fp32-head, fp32) take none of its
# light pink, tan or yellow, which sat next to full's pink and rope's orange there (two pinks; orange, tan and
# yellow) and were hard to tell apart: purple, crimson and a dark green instead.
VARIANT_COLORS = {"baseline": "#0173b2", "rope": "#de8f05", "swiglu": "#029e73", "norm": "#d55e00", "full": "#cc78bc",
                  "tis": "#56b4e9", "mis": "#6a3d9a", "fp16": "#949494", "fp32-head": "#a50f15",
                  "full+fp32-head": "#1b5e20", "fp32": "#1a1a1a"}


@contextlib.contextmanager
def style():
    """Matplotlib defaults + seaborn's whitegrid/paper look, whatever the user's matplotlibrc says."""
    with mpl.rc_context():
        mpl.rcdefaults()  # the backend is not reset (matplotlib's style blacklist)
        mpl.rcParams.update(_SEABORN_WHITEGRID_PAPER)
        mpl.rcParams.update({"svg.hashsalt": "roundalign", "figure.dpi": DPI, "savefig.dpi": DPI,
                             "legend.frameon": False,
                             # a fixed title height: the default (None) measures every top tick label of every
                             # panel at each draw to lift the title above them, a third of a figure's draw time,
                             # and no panel here has top ticks
                             "axes.titley": 1.0})
        yield


def save(fig: Figure, out_dir: str | Path, stem: str, formats) -> list[Path]:
    """Write ``<out_dir>/<stem>.<fmt>`` for each format (atomically) and return the paths."""
    # Spines out of the layout: the style draws no tick marks, so a spine reaches half its line width past its
    # axes, yet measuring it makes matplotlib recompute the axis' ticks, four spines a panel and twice per layout
    # (a fifth of the layout time of a 24-panel figure).
    for ax in fig.axes:
        for spine in ax.spines.values():
            spine.set_in_layout(False)
    # Lay out once and freeze: constrained layout is not idempotent (a second pass can move the axes by a fraction
    # of a point), so without this the bytes of a format would depend on which formats were saved before it.
    # Frozen with no layout engine at all (None, not "none"): savefig gives a figure with any engine, even
    # "none"'s placeholder, an extra draw before the real one, so each format costs one draw.
    with style():
        engine = fig.get_layout_engine()
        if engine is not None:
            engine.execute(fig)  # what Figure.draw runs first, without the disabled draw of every artist after it
        elif hasattr(fig, _GRID_ATTR):
            fixed_grid_layout(fig)
        fig.set_layout_engine(None)
    paths = []
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

# Margins of a ``grid`` figure, inches: fixed rather than found by constrained layout, which measured every
# panel's tick labels twice per figure (two passes) before the two draws of its PNG and PDF, a sixth of
# `make figures`. They fit what these panels hold: a one-line y label and tick labels of up to six characters
# left of each panel, a panel title above it, tick labels and an x label below it, a two-line figure title.
# Rows that share their x axis (``sharex="col"``) have neither x labels nor titles between them.
GRID_MARGINS_IN = {"left": 0.95, "wspace": 0.95, "top": 0.75, "hspace": 0.88, "hspace_shared_x": 0.22,
                   "bottom": 0.5, "right": 0.12}
_GRID_ATTR = "_roundalign_grid"  # the sharex of a figure made by grid(), which fixed_grid_layout lays out


def grid(nrows: int, ncols: int, *, sharex=False, sharey=False) -> tuple[Figure, np.ndarray]:
    width = max(PANEL_SIZE_IN[0] * ncols + 1.3, MIN_WIDTH_IN)
    fig = Figure(figsize=(width, PANEL_SIZE_IN[1] * nrows + 0.7))
    axes = fig.subplots(nrows, ncols, squeeze=False, sharex=sharex, sharey=sharey)
    setattr(fig, _GRID_ATTR, sharex)
    return fig, axes


def fixed_grid_layout(fig: Figure) -> None:
    """Place a ``grid`` figure's panels with ``GRID_MARGINS_IN``, the figure legend (if any) centred in the room
    it needs on the right (its width is measured: the one artist whose size varies much between figures) and
    the title at the top."""
    width, height = fig.get_size_inches()
    m = GRID_MARGINS_IN
    legend_in = 0.0
    if fig.legends:
        leg = fig.legends[0]
        leg.set_loc("center right")
        leg.set_bbox_to_anchor((1 - m["right"] / width, 0.5), transform=fig.transFigure)
        legend_in = leg.get_window_extent(fig._get_renderer()).width / fig.dpi + 0.1  # the renderer layout engines use
    nrows, ncols = fig.axes[0].get_subplotspec().get_gridspec().get_geometry()
    hspace = m["hspace_shared_x" if getattr(fig, _GRID_ATTR) == "col" else "hspace"]
    panel_w = (width - m["left"] - m["right"] - legend_in - (ncols - 1) * m["wspace"]) / ncols
    panel_h = (height - m["top"] - m["bottom"] - (nrows - 1) * hspace) / nrows
    fig.subplots_adjust(left=m["left"] / width, right=1 - (m["right"] + legend_in) / width,
                        bottom=m["bottom"] / height, top=1 - m["top"] / height,
                        wspace=m["wspace"] / panel_w, hspace=hspace / panel_h)
    if fig._suptitle is not None:
        fig._suptitle.set_y(1 - 0.06 / height)
        fig._suptitle.set_verticalalignment("top")


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
    from roundalign.training.config import TRAIN_VARIANTS

    present = set(variants)
    return [v for v in TRAIN_VARIANTS if v in present] + sorted(present - set(TRAIN_VARIANTS))


def palette(variants) -> dict[str, str]:
    """A fixed colour per variant (by its canonical position, so `full` has one colour in every figure)."""
    spare = [c for c in COLORBLIND if c not in VARIANT_COLORS.values()]
    extra = sorted(set(variants) - set(VARIANT_COLORS))
    return {v: VARIANT_COLORS[v] if v in VARIANT_COLORS else spare[extra.index(v) % len(spare)] for v in variants}


def variant_legend(fig: Figure, variants, extra_handles=(), marker: str | None = None) -> None:
    """One legend for the whole figure, outside the panels on the right (``marker``: marker handles, for
    figures that draw points rather than lines)."""
    pal = palette(variants)
    style = {"marker": marker, "ls": "none", "ms": 6} if marker else {"lw": 2}
    handles = [Line2D([], [], color=pal[v], label=v, **style) for v in variants] + list(extra_handles)
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

_SUPERSCRIPT = str.maketrans("0123456789-", "⁰¹²³⁴⁵⁶⁷⁸⁹⁻")


def plain_log_label(label: str) -> str:
    """matplotlib's mathtext log label as plain text: '$\\mathdefault{6\\times10^{-2}}$' -> '6×10⁻²'."""
    m = re.fullmatch(r"\$\\mathdefault\{(.*)\}\$", label)
    if not m:
        return label
    body = m.group(1).replace("\\times", "×")
    return re.sub(r"\^\{([^}]*)\}", lambda e: e.group(1).translate(_SUPERSCRIPT), body)


class PlainLogFormatter(LogFormatterSciNotation):
    """matplotlib's log tick labels (same values, same choice of labelled ticks) in plain text with Unicode
    superscripts instead of mathtext: parsing and laying out mathtext was a sixth of the figures' draw time."""

    def __call__(self, x, pos=None):
        return plain_log_label(super().__call__(x, pos))


class SparseMinorLogLocator(LogLocator):
    """Minor ticks on a log axis only where they get labels: matplotlib's log formatter labels minor ticks only
    when the view holds at most one power of 10 (``LogFormatter.set_locs``, minor_thresholds[0] = 1), the style
    draws no tick marks and no minor grid, so elsewhere they would be invisible, yet each costs a Tick per draw."""

    def __call__(self):
        lo, hi = sorted(self.axis.get_view_interval())
        if lo > 0 and math.floor(math.log10(hi)) - math.floor(math.nextafter(math.log10(lo), -math.inf)) > 1:
            return []
        return super().__call__()


def set_log_y(ax) -> None:
    """Log-scale y with ``PlainLogFormatter`` labels and ``SparseMinorLogLocator`` minor ticks."""
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(PlainLogFormatter(10))
    ax.yaxis.set_minor_locator(SparseMinorLogLocator(10, None))
    ax.yaxis.set_minor_formatter(PlainLogFormatter(10, labelOnlyBase=False))


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
    from matplotlib.patches import Polygon

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
