"""Paper figures from the aggregated tables (``roundalign aggregate``), one module per figure.

Each module ``fig_<name>.py`` has a ``plot_<name>(DataFrames...) -> (fig, axes)`` that builds the figure
and saves nothing (rliable style), and a ``make(aggregate_dir, out_dir, formats) -> list[Path]`` that
reads only the aggregate tables and writes exactly ``<out_dir>/<STEM>.<fmt>`` for each format.
``summary.py`` is the table: ``summarize(runs, run_status) -> DataFrame``; its ``make`` writes
``summary.csv`` and ``summary.md``.

Reruns give byte-identical files: categories are sorted (models alphabetically, variants in the canonical
order of ``roundalign.config.TRAIN_VARIANTS``), bootstrap bands are seeded (``seed=0``), every rcParam is
reset inside the plotting code, and timestamps are removed from the file metadata.

    roundalign plot --aggregate results/smoke/aggregate --out figures/smoke --formats png,pdf
    # every sweep in one process, with the stress figures where there are stress tables (make figures)
    roundalign plot --aggregate results/smoke/aggregate results/stress/aggregate \
        --out figures/smoke figures/stress --stress

``CAPTIONS`` maps each file stem to a one-paragraph caption (for a Snakemake report).
"""

from __future__ import annotations

import time
from pathlib import Path

from . import fig_is_ratio, fig_k3, fig_logp_diff, fig_probe, fig_reward, summary
from ._common import FORMATS, check_formats, load_table, tables

# stem -> module, in the order they are made
FIGURES = {m.STEM: m for m in (fig_reward, fig_k3, fig_is_ratio, fig_logp_diff, fig_probe, summary)}

CAPTIONS: dict[str, str] = {
    "fig_reward": (
        "Training reward (reward/mean, the mean task reward over a step's completions) against the GRPO "
        "optimizer step, one panel per model and one colour per trainer variant. Lines are the mean over "
        "seeds and bands a 95% bootstrap confidence interval over seeds; with a single seed a line is that run "
        "and there is no band (the subtitle says which). A triangle marks the step at which a run's rolling "
        "reward mean was flagged as collapsed."),
    "fig_k3": (
        "Train-vs-inference mismatch during training: the token-level k3 estimate of KL(engine || trainer) "
        "in nats per token (log scale) against the optimizer step, one panel per model, mean over seeds "
        "with a 95% bootstrap band (a single seed: the run itself, no band). Exact zeros, i.e. bitwise-identical "
        "log-probabilities, are drawn on the dotted floor labelled '0 (bitwise)'. An x marks the step at which "
        "a run collapsed (non-finite loss, gradient norm or k3)."),
    "fig_is_ratio": (
        "Token-level importance ratio pi_train / pi_engine of the sampled tokens, minimum, mean and "
        "maximum over each step's tokens (rows), against the optimizer step, one column per model. The "
        "dashed line at 1 is perfect agreement; mean over seeds with a 95% bootstrap band (a single seed: the "
        "run itself, no band)."),
    "fig_logp_diff": (
        "Mean and maximum absolute difference between the trainer's and the inference engine's "
        "log-probability of each sampled token, in nats (log scale), against the optimizer step, one "
        "column per model; mean over seeds with a 95% bootstrap band (a single seed: the run itself, no band). "
        "Exact zeros are drawn on the floor labelled '0 (bitwise)'."),
    "fig_probe": (
        "Offline probe at identical weights: the engine samples completions and each trainer variant "
        "recomputes their log-probabilities, once per model and engine (one prompt set, no replicate). Top "
        "left: token-level k3 (nats per token, log scale; a hatched bar labelled '0 (bitwise)' is an exact "
        "zero), a mean over the probe's tokens without an interval (the probe keeps no per-token values). Top "
        "right: fraction of tokens whose log-probability is bitwise equal, with a 95% Wilson interval over the "
        "probe's tokens taken as independent (they are not quite: tokens of one completion correlate); a dash "
        "on the axis is an exact 0. Bottom: RMS relative error of the hidden state after each decoder layer, "
        "trainer variant vs engine (log scale), one panel per model; a variant equal to an earlier one at every "
        "layer is drawn dashed over it and named in the panel."),
    "summary": (
        "Per model and trainer variant, over seeds: number of seeds, of finished and of collapsed runs "
        "with their collapse steps, runs whose reward collapsed, final reward (mean of reward/mean over the "
        "last 10% of logged steps, at least one, then mean over seeds) and peak token-level k3 (maximum "
        "over steps, then mean over seeds)."),
}


def make_all(aggregate_dir, out_dir: str | Path, formats=("png", "pdf"), figures=None, log=print) -> list[Path]:
    """Make every figure (or the stems in ``figures``) into ``out_dir``; returns the written paths.
    ``aggregate_dir`` is a directory or a ``_common.Tables`` (tables already read are not read again).
    Raises FileNotFoundError when ``aggregate_dir`` is missing and ValueError on an unknown format or stem."""
    formats = check_formats(formats)
    figures = list(FIGURES) if figures is None else list(figures)
    unknown = [f for f in figures if f not in FIGURES]
    if unknown:
        raise ValueError(f"unknown figure(s) {', '.join(unknown)}; choose from {', '.join(FIGURES)}")
    agg = tables(aggregate_dir)
    agg["runs"]  # fail before any output when the aggregate is missing
    t0 = time.perf_counter()
    paths: list[Path] = []
    for stem in figures:
        t = time.perf_counter()
        written = FIGURES[stem].make(agg, out_dir, formats)
        paths.extend(written)
        log(f"[plot] {stem}: {', '.join(p.name for p in written)} ({time.perf_counter() - t:.1f}s)")
    log(f"[plot] wrote {len(paths)} files to {out_dir} in {time.perf_counter() - t0:.1f}s")
    return paths


def make_sweeps(pairs, formats=("png", "pdf"), figures=None, stress=False, log=print) -> list[Path]:
    """``make_all`` for each (aggregate_dir, out_dir) of ``pairs`` in one process (the plotting imports are paid
    once, each sweep's tables are read once), and with ``stress`` also the stress figures
    (``roundalign.plots.stress``) of every aggregate directory that holds stress_runs.csv."""
    from . import stress as stress_plots

    formats = check_formats(formats)
    paths: list[Path] = []
    for aggregate_dir, out_dir in pairs:
        agg = tables(aggregate_dir)
        paths += make_all(agg, out_dir, formats, figures, log)
        if stress and agg.has("stress_runs"):
            t = time.perf_counter()
            written = stress_plots.make(agg, out_dir, formats)
            paths += written
            log(f"[plot] stress figures: {len(written)} files to {out_dir} ({time.perf_counter() - t:.1f}s)")
    return paths


__all__ = ["CAPTIONS", "FIGURES", "FORMATS", "make_all", "make_sweeps", "load_table", "tables"]
