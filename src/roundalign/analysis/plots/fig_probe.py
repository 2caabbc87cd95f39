"""Figure 5: the offline probe at identical weights (``roundalign probe``), trainer variant vs engine.

Top left: token-level k3 per model and variant (bars, log scale; an exact zero is drawn at a floor,
hatched and labelled "0 (bitwise)"). Top right: fraction of tokens whose log-prob is bitwise equal.
Bottom: RMS relative error of the hidden state after each decoder layer (log scale), one panel per
model (and engine, when there are several), hue = variant.

Reads ``probe.csv`` and ``probe_layers.csv``; writes ``fig_probe.<fmt>``.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from roundalign.analysis.plots import _grid, _logaxis, _save, _style, _tables
from roundalign.analysis.plots.stress import wilson_interval

STEM = "fig_probe"
K3 = ("token", "mismatch_k3")
EXACT = ("token", "tokens_exact_frac")
LAYER_METRIC = "hidden_rel_err_rms"


def _groups(*tables: pd.DataFrame) -> list[tuple[str, str]]:
    return sorted(set().union(*(set(zip(t["model"], t["engine"])) for t in tables if len(t))))


# what a suffixed engine of the real-engine probe compares (roundalign.analysis.aggregate: <engine>_<suffix>)
_ENGINE_SUFFIX = {"teacher_forced": "prefill", "emulated": "vs emulated"}
MANY_GROUPS = 8  # more (model, engine) groups than this: the two bar panels get a full-width row each


def _engine_parts(engine: str) -> tuple[str, str]:
    """(engine, what it compares: '' for the engine itself) of an aggregate engine name."""
    base, _, suffix = engine.partition("_")
    return base, _ENGINE_SUFFIX.get(suffix, suffix)


def _engine_label(engine: str) -> str:
    base, what = _engine_parts(engine)
    return f"{base} ({what})" if what else base


def _group_label(group: tuple[str, str], multi_engine: bool) -> str:
    return f"{group[0]}\n{_engine_label(group[1])}" if multi_engine else group[0]


def _bars(ax, rows: pd.DataFrame, groups, variants, multi_engine: bool, *, log: bool, counts=None) -> None:
    """Grouped bars: x = (model, engine) group, one bar per variant. ``counts``: {(model, engine, variant): n}
    makes each bar a fraction of n tokens with a 95% Wilson interval (gid "wilson"). On a linear axis an exact 0
    is a short dash in the variant's colour on the axis (gid "zero_frac"), since a bar of height 0 is invisible."""
    pal = _style.palette(variants)
    width = 0.8 / max(len(variants), 1)
    floor = _logaxis.zero_floor(rows["value"]) if log else None
    for k, variant in enumerate(variants):
        for g, group in enumerate(groups):
            v = rows[(rows["model"] == group[0]) & (rows["engine"] == group[1]) & (rows["variant"] == variant)]
            if v.empty or not np.isfinite(v["value"].iloc[0]):
                continue
            value = float(v["value"].iloc[0])
            x = g - 0.4 + width * (k + 0.5)
            if log and value <= 0:
                ax.bar(x, floor, width, color="white", edgecolor=pal[variant], hatch="///", lw=1, gid="zero_bar")
                ax.text(x, floor * 1.3, _logaxis.ZERO_LABEL, rotation=90, ha="center", va="bottom", fontsize=6.5,
                        color="0.25")
            else:
                ax.bar(x, value, width, color=pal[variant])
                if not log and value == 0:
                    ax.plot([x - width * 0.4, x + width * 0.4], [0.004, 0.004], color=pal[variant], lw=2.5,
                            solid_capstyle="butt", gid="zero_frac", clip_on=False)
            n = (counts or {}).get((*group, variant))
            if n:
                lo, hi = wilson_interval(round(value * n), int(n))
                lo, hi = min(lo, value), max(hi, value)  # k / n re-rounded can sit a ulp outside its interval
                ax.errorbar([x], [value], yerr=[[value - lo], [hi - value]], fmt="none", ecolor="0.2", elinewidth=0.8,
                            capsize=1.5, gid="wilson")
    labels = [_group_label(g, multi_engine) for g in groups]
    longest = max((len(line) for label in labels for line in label.split("\n")), default=0)
    if len(groups) > MANY_GROUPS and multi_engine:
        _two_level_axis(ax, groups)
    elif len(groups) > MANY_GROUPS:
        ax.set_xticks(range(len(groups)), labels, rotation=30, ha="right", rotation_mode="anchor", fontsize=7)
    elif multi_engine or len(groups) > 3 or longest * len(groups) > 50:  # slanted, so neighbours cannot collide
        ax.set_xticks(range(len(groups)), labels, rotation=30, ha="right", rotation_mode="anchor", fontsize=7)
    else:
        ax.set_xticks(range(len(groups)), labels)
    ax.set_xlim(-0.5, len(groups) - 0.5)
    ax.grid(False, axis="x")
    if log:
        _logaxis.set_log_y(ax)
        if floor is not None:
            ax.set_ylim(floor / 3, ax.get_ylim()[1] * (30 if (rows["value"] > 0).sum() == 0 else 3))


def _two_level_axis(ax, groups) -> None:
    """Many (model, engine) groups: the engine (its name without the prefix all engines share) under each group,
    slanted, and each model's name once, centred under its groups, with a thin line between models (gid
    "model_label" / "model_sep"). Upright "model\nengine" labels for 24 groups are too small to read."""
    engines = [_engine_label(e) for _, e in groups]
    prefix = engines[0]
    for e in engines[1:]:
        while not e.startswith(prefix):
            prefix = prefix[:-1]
    prefix = prefix[:prefix.rfind("-") + 1] if "-" in prefix else ""
    ax.set_xticks(range(len(groups)), [e[len(prefix):] for e in engines], rotation=30, ha="right",
                  rotation_mode="anchor", fontsize=7)
    blocks: list[list[int]] = []
    for i, (model, _) in enumerate(groups):
        if blocks and groups[blocks[-1][0]][0] == model:
            blocks[-1].append(i)
        else:
            blocks.append([i])
    # the models on a second x axis below the engines' (a real axis: the layout makes room for it)
    longest = max(len(e) - len(prefix) for e in engines)
    models = ax.secondary_xaxis("bottom")
    models.set_gid("model_axis")
    models.spines["bottom"].set_position(("outward", 16 + 2.1 * longest))
    models.spines["bottom"].set_visible(False)
    models.set_xticks([(b[0] + b[-1]) / 2 for b in blocks], [groups[b[0]][0] for b in blocks], fontsize=8,
                      fontweight="bold")
    models.tick_params(axis="x", length=0)
    for block in blocks[1:]:
        ax.axvline(block[0] - 0.5, color="0.6", lw=0.8, gid="model_sep")
    if prefix:
        ax.set_title(f"{ax.get_title()} (engines {prefix}*)", fontsize=9)


def _layer_lines(ax, d: pd.DataFrame, variants, pal) -> list[str]:
    """One line per variant over the layers. A variant whose values equal an earlier variant's at every layer
    is drawn dashed on top of it (gid "same:<variant>"), so both colours show, and named in a note (gid
    "same_note"): drawn solid it would hide the earlier line completely (tiny-qwen3-untied, vllm-eager: swiglu
    and baseline agree to the last bit, and baseline would vanish). Returns the "<variant> = <earlier>" notes."""
    drawn: dict[str, tuple] = {}
    notes = []
    for variant in variants:
        v = d[d["variant"] == variant].sort_values("layer")
        if v.empty:
            continue
        key = (tuple(v["layer"]), tuple(v["value"]))
        twin = next((u for u, k in drawn.items() if k == key), None)
        if twin is None:
            ax.plot(v["layer"], v["value"], marker="o", ms=3.5, lw=1.5, color=pal[variant], label=variant,
                    gid=f"layers:{variant}")
        else:
            ax.plot(v["layer"], v["value"], marker="o", ms=3.5, lw=1.5, ls=(0, (3, 3)), color=pal[variant],
                    label=variant, gid=f"same:{variant}")
            notes.append(f"{variant} = {twin}")
        drawn[variant] = key
    if notes:
        # between the curves (near the top) and the zero floor (near the bottom), where the panels have room
        ax.text(0.98, 0.5, "\n".join(notes) + " (every layer)", transform=ax.transAxes, ha="right", va="center",
                fontsize=6.5, color="0.3", gid="same_note")
    return notes


# Margins, inches: fixed but for the depth of the bar panels' slanted x labels, which is measured (two panels:
# cheap next to constrained layout's two passes over every panel)
LEFT_IN, RIGHT_IN, WSPACE_IN = 0.85, 0.12, 0.95  # the y label and tick labels left of each panel
TITLE_IN = 0.6  # the two-line figure title and a panel title
PANEL_TITLE_IN = 0.28  # a panel title (and the per-layer title above the layer panels' titles)
LAYERS_HSPACE_IN, BOTTOM_IN = 0.6, 0.5  # an x label and tick labels below a layer panel (then the next's title)
TITLE_CHARS = 36  # a layer panel's title on one line up to this long where panels share a row (~3 in wide)


def _layout(fig: Figure, *, bars, bars_grid, layers_grid, layers_title, bars_share: float) -> None:
    """Fixed layout (``_grid.set_layout``): the bar panels in the top ``bars_share`` of the figure (side by side or,
    for many groups, stacked), each with room below for its x labels as deep as they are, the per-layer title and
    panels below, the variant legend centred on the right in the width it needs."""
    width, height = fig.get_size_inches()
    renderer = fig._get_renderer()
    right = RIGHT_IN
    if fig.legends:
        leg = fig.legends[0]
        leg.set_loc("center right")
        leg.set_bbox_to_anchor((1 - RIGHT_IN / width, 0.5), transform=fig.transFigure)
        right += leg.get_window_extent(renderer).width / fig.dpi + 0.1
    # below each bar panel: its tick labels (and a two-level axis' model names), as deep as drawn
    depth = [(ax.get_window_extent(renderer).y0 - ax.get_tightbbox(renderer).y0) / fig.dpi + 0.05 for ax in bars]
    bars_h = bars_share * height
    stacked = bars_grid.get_geometry() == (2, 1)
    # a layer panel's title wider than its panel reaches past it (the widest, for the last column): off the legend
    nrows, ncols = layers_grid.get_geometry()
    panel_w = (width - LEFT_IN - right - (ncols - 1) * WSPACE_IN) / ncols
    title_w = max(ax.title.get_window_extent(renderer).width for ax in fig.axes[2:]) / fig.dpi
    if title_w > panel_w:  # (the overflow grows as the panels narrow to make room for it: solved for)
        right += (title_w - panel_w) / (2 - 1 / ncols) + 0.05
    usable_w = width - LEFT_IN - right
    if stacked:
        panel_h = (bars_h - TITLE_IN - depth[0] - PANEL_TITLE_IN - depth[1]) / 2
        bars_grid.update(left=LEFT_IN / width, right=1 - right / width, top=1 - TITLE_IN / height,
                         bottom=1 - (bars_h - depth[1]) / height, hspace=(depth[0] + PANEL_TITLE_IN) / panel_h)
    else:
        # a y label longer than its panel reaches above it, beside the panel title: keep it below the figure title
        label = max(ax.yaxis.label.get_window_extent(renderer).height for ax in bars) / fig.dpi
        # (its top, top - (label - panel height) / 2, at least the title's depth below the figure's top)
        top = max(TITLE_IN, 2 * (TITLE_IN - PANEL_TITLE_IN + 0.06) + label - (bars_h - max(depth)))
        panel_w = (usable_w - WSPACE_IN) / 2
        bars_grid.update(left=LEFT_IN / width, right=1 - right / width, top=1 - top / height,
                         bottom=1 - (bars_h - max(depth)) / height, wspace=WSPACE_IN / panel_w)
    layers_title.set_y(1 - (bars_h + 0.04) / height)
    title_h = max(ax.title.get_window_extent(renderer).height for ax in fig.axes[2:]) / fig.dpi + 0.1  # 1 or 2 lines
    top = bars_h + 0.04 + PANEL_TITLE_IN + title_h
    hspace = LAYERS_HSPACE_IN + title_h
    panel_w = (usable_w - (ncols - 1) * WSPACE_IN) / ncols
    panel_h = (height - top - BOTTOM_IN - (nrows - 1) * hspace) / nrows
    layers_grid.update(left=LEFT_IN / width, right=1 - right / width, top=1 - top / height, bottom=BOTTOM_IN / height,
                       wspace=WSPACE_IN / panel_w, hspace=hspace / panel_h)
    for ax in fig.axes:  # GridSpec.update moves only pyplot's axes
        ax._set_position(ax.get_subplotspec().get_position(fig))
    fig._suptitle.set_y(1 - 0.06 / height)
    fig._suptitle.set_verticalalignment("top")


def plot_probe(probe: pd.DataFrame, probe_layers: pd.DataFrame):
    """Returns (fig, axes) with axes = {"k3": Axes, "tokens_exact_frac": Axes, "layers": array of Axes}."""
    with _style.style():
        groups = _groups(probe, probe_layers)
        multi_engine = len({g[1] for g in groups}) > 1
        k3 = probe[(probe["level"] == K3[0]) & (probe["metric"] == K3[1])]
        exact = probe[(probe["level"] == EXACT[0]) & (probe["metric"] == EXACT[1])]
        layers = probe_layers[probe_layers["metric"] == LAYER_METRIC]
        layer_groups = _groups(layers)
        variants = _style.variant_order(set(k3["variant"]) | set(exact["variant"]) | set(layers["variant"]))

        n = max(len(layer_groups), 1)
        ncols = n if n <= 3 else min(4, math.ceil(math.sqrt(n)))
        nrows = math.ceil(n / ncols)
        width = max(2 * _grid.PANEL_SIZE_IN[0], ncols * _grid.PANEL_SIZE_IN[0]) + 1.3
        many = len(groups) > MANY_GROUPS
        top_h = 2.6 if many else 1.2  # many groups: k3 above the bitwise fractions, each as wide as the figure
        fig = Figure(figsize=(width, _grid.PANEL_SIZE_IN[1] * (top_h + nrows) + 0.6))
        bars_grid = fig.add_gridspec(2, 1) if many else fig.add_gridspec(1, 2)
        layers_grid = fig.add_gridspec(nrows, ncols)
        ax_k3, ax_exact = fig.add_subplot(bars_grid[0]), fig.add_subplot(bars_grid[1])
        layer_axes = np.array([fig.add_subplot(layers_grid[i // ncols, i % ncols]) for i in range(n)])

        ax_k3.set_title("token-level k3 at identical weights", fontsize=9)
        if k3.empty:
            _style.no_data(ax_k3, "no data: token-level mismatch_k3\nnot in probe.csv")
        else:
            _bars(ax_k3, k3, groups, variants, multi_engine, log=True)
            ax_k3.set_ylabel("k3 KL estimate (nats / token)")
        ax_exact.set_title("bitwise-equal tokens", fontsize=9)
        if exact.empty:
            _style.no_data(ax_exact, "no data: token-level tokens_exact_frac\nnot in probe.csv")
        else:
            n_tok = probe[(probe["level"] == "token") & (probe["metric"] == "num_tokens")]
            counts = {(r.model, r.engine, r.variant): r.value for r in n_tok.itertuples(index=False)
                      if np.isfinite(r.value) and r.value > 0}
            _bars(ax_exact, exact, groups, variants, multi_engine, log=False, counts=counts)
            if (exact["value"] == 0).all():
                ax_exact.text(0.5, 0.5, "no token's log-prob is bitwise equal\n(every fraction is 0)",
                              transform=ax_exact.transAxes, ha="center", va="center", fontsize=8, color="0.35",
                              gid="all_zero")
            ax_exact.set_ylim(0, 1.05)
            ax_exact.set_ylabel("fraction of tokens with equal log p")

        pal = _style.palette(variants)
        floor = _logaxis.zero_floor(layers["value"])
        if layers.empty:
            _style.no_data(layer_axes[0], f"no data: {LAYER_METRIC}\nnot in probe_layers.csv")
        for ax, group in zip(layer_axes, layer_groups):
            d = _logaxis.apply_floor(layers[(layers["model"] == group[0]) & (layers["engine"] == group[1])], floor)
            _layer_lines(ax, d, variants, pal)
            _logaxis.set_log_y(ax)
            _logaxis.mark_floor(ax, floor)
            top = float(d["value"].max()) if len(d) else float("nan")
            if np.isfinite(top) and top > 0:  # up to the next decade, so that a labelled tick sits above the data
                ax.set_ylim(top=10.0 ** math.ceil(math.log10(top) + 1e-9))
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            where = ", ".join(part for part in _engine_parts(group[1]) if part)
            title = f"{group[0]} ({where})" if multi_engine else group[0]
            if ncols > 1 and len(title) > TITLE_CHARS:  # two lines rather than over the next panel's title
                title = f"{group[0]}\n({where})"
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("decoder layer (0 = first)")
            ax.set_ylabel("hidden-state RMS rel. error")
        layers_title = fig.text(0.5, 0, "per-layer relative error of the residual stream, trainer variant vs engine",
                                ha="center", va="top", fontsize=9)
        _grid.set_layout(fig, functools.partial(_layout, bars=(ax_k3, ax_exact), bars_grid=bars_grid,
                                                layers_grid=layers_grid, layers_title=layers_title,
                                                bars_share=top_h / (top_h + nrows)))
        _style.variant_legend(fig, variants)
        engines = sorted({g[1] for g in groups})
        engine = f" (engine {engines[0]})" if len(engines) == 1 else ""
        _style.suptitle(fig, "Mismatch probe at identical weights" + engine, probe if len(probe) else probe_layers)
    return fig, {"k3": ax_k3, "tokens_exact_frac": ax_exact, "layers": layer_axes}


def make(aggregate_dir: str | Path, out_dir: str | Path, formats=("png", "pdf")) -> list[Path]:
    tables = _tables.tables(aggregate_dir)
    fig, _ = plot_probe(tables["probe"], tables["probe_layers"])
    return _save.save(fig, out_dir, STEM, _save.check_formats(formats))
