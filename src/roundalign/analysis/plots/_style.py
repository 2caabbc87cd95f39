"""The look of the figures: rcParams (seaborn whitegrid/paper), variant palette and order, legend, titles, notes."""

from __future__ import annotations

import contextlib

import matplotlib as mpl
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from roundalign.training.config import TRAIN_VARIANTS

# Figures are built on ``matplotlib.figure.Figure`` directly (never pyplot): no GUI backend is touched and no global
# figure list grows. Every rcParam is reset to matplotlib's defaults inside ``style()``, so the user's matplotlibrc
# cannot change the bytes.
DPI = 150

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
# would give fp32 (the 11th) baseline's blue in the stress figures.
COLORBLIND = ["#0173b2", "#de8f05", "#029e73", "#d55e00", "#cc78bc", "#ca9161", "#fbafe4", "#949494", "#ece133",
              "#56b4e9", "#1a1a1a", "#6a3d9a", "#a50f15", "#1b5e20"]
# One colour per variant. The probe's five (baseline, rope, swiglu, norm, full) keep seaborn's colorblind colours; the
# stress sweep's nine (baseline, rope, full, tis, mis, fp16, fp32-head, full+fp32-head, fp32) take none of its
# light pink, tan or yellow, which would sit next to full's pink and rope's orange there (two pinks; orange, tan
# and yellow) and are hard to tell apart: they take purple, crimson and a dark green.
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


def variant_order(variants) -> list[str]:
    """The trainer variants in their canonical order (baseline first, full alignment, then IS corrections),
    unknown names after them, sorted."""
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

