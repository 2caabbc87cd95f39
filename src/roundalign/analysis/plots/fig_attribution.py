"""Figure: where the mismatch comes from (``roundalign attribute``): one waterfall per model.

Each panel: the token-level k3 between the trainer's and the engine's logprobs of the engine's samples, at
identical weights, after equalizing the sources one by one in the documented order (filled markers joined by a
line: the cumulative waterfall, step 0 = nothing equalized) and each source alone against nothing (hollow
markers, at its own step). Error bars are 95% bootstrap intervals over prompts. Exact zeros (bitwise equal
logprobs on every token) sit on the floor labelled "0 (bitwise)". Under each step: the k3 it removes, in percent
of step 0's.

Reads ``attribution.csv`` (the command's long table; the sweep's aggregate concatenates them with a ``model``
column); writes ``fig_attribution.<fmt>``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from roundalign.analysis.plots import _common as C

STEM = "fig_attribution"
CUMULATIVE, ALONE = "#0173b2", "#de8f05"


def waterfall_panel(ax, df: pd.DataFrame, floor: float | None) -> None:
    """One model's waterfall on ``ax`` (``df``: its rows of attribution.csv)."""
    k3 = df[df["metric"] == "k3"]
    cum = k3[k3["mode"] == "cumulative"].sort_values("step")
    alone = k3[k3["mode"] == "alone"].sort_values("step")
    x = cum["step"].to_numpy()
    labels = ["none"] + [f"+{s}" for s in cum["source"].iloc[1:]]

    def pts(rows):
        v = rows["value"].to_numpy(dtype="float64")
        lo, hi = rows["ci_low"].to_numpy(dtype="float64"), rows["ci_high"].to_numpy(dtype="float64")
        if floor is not None:
            v, lo, hi = (np.where(a > 0, a, floor) for a in (v, lo, hi))
        return v, np.clip(v - lo, 0, None), np.clip(hi - v, 0, None)

    v, dlo, dhi = pts(cum)
    ax.errorbar(x, v, yerr=[dlo, dhi], color=CUMULATIVE, marker="o", ms=5, lw=1.2, capsize=2, label="cumulative",
                zorder=3)
    if len(alone):
        va, alo, ahi = pts(alone)
        ax.errorbar(alone["step"].to_numpy(), va, yerr=[alo, ahi], color=ALONE, marker="o", ms=5, mfc="white",
                    lw=0, elinewidth=1, capsize=2, label="this source alone", zorder=4)
    C.set_log_y(ax)
    C.mark_floor(ax, floor)
    ax.set_xticks(x)
    base = float(cum["value"].iloc[0])
    removed = df[(df["metric"] == "k3_removed") & (df["mode"] == "cumulative")].set_index("step")["value"]
    ticks = [labels[0]] + [f"{lab}\n{100 * removed.get(s, np.nan) / base:.0f}%" if base > 0 else lab
                           for s, lab in zip(x[1:], labels[1:])]
    ax.set_xticklabels(ticks, fontsize=7)
    ax.set_ylabel("token k3 (nats)")


def draw_waterfall(rows, path: str | Path, title: str = "") -> Path:
    """The waterfall of one ``roundalign attribute`` run (its rows) as one figure at ``path``."""
    import matplotlib.pyplot as plt

    df = pd.DataFrame(rows)
    path = Path(path)
    with C.style():
        fig, ax = plt.subplots(figsize=(7.5, 3.6), layout="constrained")
        waterfall_panel(ax, df, C.zero_floor(df[df["metric"] == "k3"][["value", "ci_low"]].to_numpy().ravel()))
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7, loc="upper right")
    C.save(fig, path.parent, path.stem, (path.suffix.lstrip("."),))
    plt.close(fig)
    return path


def draw(t, out_dir, formats) -> list[Path]:
    """One panel per model of the sweep's ``attribution.csv``."""
    import matplotlib.pyplot as plt

    df = t.attribution
    models = sorted(df["model"].unique())
    floor = C.zero_floor(df[df["metric"] == "k3"][["value", "ci_low"]].to_numpy().ravel())
    with C.style():
        fig, axes = plt.subplots(len(models), 1, figsize=(7.5, 3.0 * len(models)), layout="constrained",
                                 squeeze=False)
        for ax, model in zip(axes[:, 0], models):
            rows = df[df["model"] == model]
            waterfall_panel(ax, rows, floor)
            engine = rows["engine"].iloc[0] if "engine" in rows else ""
            ax.set_title(f"{model} ({engine})" if engine else model, fontsize=9)
        axes[0, 0].legend(fontsize=7, loc="upper right")
    paths = C.save(fig, out_dir, STEM, formats)
    plt.close(fig)
    return paths
