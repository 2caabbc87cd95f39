"""Log y axes: plain-text tick labels, sparse minor ticks, exact zeros drawn on a labelled "0 (bitwise)" floor."""

from __future__ import annotations

import math
import re

import numpy as np
import pandas as pd
from matplotlib.ticker import LogFormatterSciNotation, LogLocator

ZERO_LABEL = "0 (bitwise)"

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

