"""Panel grids: fixed panel sizes and margins (``grid``, ``wrapped_grid``), laid out without a layout engine."""

from __future__ import annotations

import functools
import math

import numpy as np
from matplotlib.figure import Figure

PANEL_SIZE_IN = (3.4, 2.6)  # width, height of one panel, inches
MIN_WIDTH_IN = 6.5  # room for a two-line title and the legend beside a single panel

# Margins of a ``grid`` figure, inches: fixed rather than found by constrained layout, which measures every
# panel's tick labels twice per figure (two passes) before the two draws of its PNG and PDF, a sixth of
# `make figures`. They fit what these panels hold: a one-line y label and tick labels of up to six characters
# left of each panel, a panel title above it, tick labels and an x label below it, a two-line figure title.
# Rows that share their x axis (``sharex="col"``) have neither x labels nor titles between them.
GRID_MARGINS_IN = {"left": 0.95, "wspace": 0.95, "top": 0.75, "hspace": 0.88, "hspace_shared_x": 0.22,
                   "bottom": 0.5, "right": 0.12}
_LAYOUT_ATTR = "_roundalign_layout"  # what lays a figure out at save time (set_layout)


def set_layout(fig: Figure, layout) -> None:
    """Have ``_save.save`` lay ``fig`` out by calling ``layout(fig)`` once, after everything is drawn on it and
    before its first format is written: fixed margins in place of a layout engine (constrained layout measures
    every panel's tick labels twice, a sixth of `make figures`)."""
    setattr(fig, _LAYOUT_ATTR, layout)


def layout_of(fig: Figure):
    """The layout given to ``fig`` by ``set_layout`` (None without one)."""
    return getattr(fig, _LAYOUT_ATTR, None)


def grid(nrows: int, ncols: int, *, sharex=False, sharey=False) -> tuple[Figure, np.ndarray]:
    width = max(PANEL_SIZE_IN[0] * ncols + 1.3, MIN_WIDTH_IN)
    fig = Figure(figsize=(width, PANEL_SIZE_IN[1] * nrows + 0.7))
    axes = fig.subplots(nrows, ncols, squeeze=False, sharex=sharex, sharey=sharey)
    set_layout(fig, functools.partial(fixed_grid_layout, sharex=sharex))
    return fig, axes


def fixed_grid_layout(fig: Figure, *, sharex=False) -> None:
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
    hspace = m["hspace_shared_x" if sharex == "col" else "hspace"]
    panel_w = (width - m["left"] - m["right"] - legend_in - (ncols - 1) * m["wspace"]) / ncols
    panel_h = (height - m["top"] - m["bottom"] - (nrows - 1) * hspace) / nrows
    fig.subplots_adjust(left=m["left"] / width, right=1 - (m["right"] + legend_in) / width,
                        bottom=m["bottom"] / height, top=1 - m["top"] / height,
                        wspace=m["wspace"] / panel_w, hspace=hspace / panel_h)
    if fig._suptitle is not None:
        fig._suptitle.set_y(1 - 0.06 / height)
        fig._suptitle.set_verticalalignment("top")


def set_margins(fig: Figure, *, left: float, right: float, top: float, bottom: float, wspace: float = 0.0,
                hspace: float = 0.0) -> None:
    """Lay ``fig``'s panel grid out at save time (``set_layout``) with these margins and gaps, inches. A figure
    legend at "center right" gets the room it needs on top of ``right`` (its width is measured); one at "lower
    center" sits at the bottom edge, inside ``bottom``."""
    set_layout(fig, functools.partial(fixed_layout, margins={"left": left, "right": right, "top": top,
                                                              "bottom": bottom, "wspace": wspace, "hspace": hspace}))


def fixed_layout(fig: Figure, *, margins: dict) -> None:
    """Place the panels of a figure given ``set_margins``: every panel of its first panel's grid, the figure
    legend (right or bottom), the title at the top and the figure's y label at the left edge."""
    width, height = fig.get_size_inches()
    m = margins
    right = m["right"]
    for leg in fig.legends:
        if leg._outside_loc == "lower" or leg._loc == 8:  # "outside lower center" or "lower center": below the panels
            leg.set_loc("lower center")
            leg.set_bbox_to_anchor((0.5, 0.02 / height), transform=fig.transFigure)
        else:  # right of the panels, centred
            leg.set_loc("center right")
            leg.set_bbox_to_anchor((1 - 0.04 / width, 0.5), transform=fig.transFigure)
            right += leg.get_window_extent(fig._get_renderer()).width / fig.dpi + 0.1
    nrows, ncols = fig.axes[0].get_subplotspec().get_gridspec().get_geometry()
    panel_w = (width - m["left"] - right - (ncols - 1) * m["wspace"]) / ncols
    panel_h = (height - m["top"] - m["bottom"] - (nrows - 1) * m["hspace"]) / nrows
    fig.subplots_adjust(left=m["left"] / width, right=1 - right / width, bottom=m["bottom"] / height,
                        top=1 - m["top"] / height, wspace=m["wspace"] / panel_w, hspace=m["hspace"] / panel_h)
    if fig._suptitle is not None:
        fig._suptitle.set_y(1 - 0.06 / height)
        fig._suptitle.set_verticalalignment("top")
    if fig._supylabel is not None:
        fig._supylabel.set_x(0.04 / width)
        fig._supylabel.set_horizontalalignment("left")


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

