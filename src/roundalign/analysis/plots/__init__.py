"""Paper figures from the aggregated tables (``roundalign aggregate``), one module per figure.

Each module ``fig_<name>.py`` has a ``plot_<name>(DataFrames...) -> (fig, axes)`` that builds the figure
and saves nothing (rliable style), and a ``make(aggregate_dir, out_dir, formats) -> list[Path]`` that
reads only the aggregate tables and writes exactly ``<out_dir>/<STEM>.<fmt>`` for each format.
``summary.py`` is the table: ``summarize(runs, run_status) -> DataFrame``; its ``make`` writes
``summary.csv`` and ``summary.md``.

Reruns give byte-identical files: categories are sorted (models alphabetically, variants in the canonical
order of ``roundalign.training.config.TRAIN_VARIANTS``), bootstrap bands are seeded (``seed=0``), every rcParam is
reset inside the plotting code, and timestamps are removed from the file metadata.

    roundalign plot --aggregate results/smoke/aggregate --out figures/smoke --formats png,pdf
    # every sweep in one process, with the stress figures where there are stress tables (make figures)
    roundalign plot --aggregate results/smoke/aggregate results/stress/aggregate \
        --out figures/smoke figures/stress --stress

``CAPTIONS`` maps each file stem to a one-paragraph caption (for a Snakemake report).
"""

from __future__ import annotations

import multiprocessing
import pickle
import queue
import time
import traceback
from pathlib import Path

from roundalign.analysis.plots import (fig_attn, fig_attribution, fig_is_ratio, fig_k3, fig_logp_diff, fig_probe,
                                       fig_reward, summary)
from roundalign.analysis.plots import dose as dose_plots
from roundalign.analysis.plots import stress as stress_plots
from roundalign.analysis.plots._save import FORMATS, check_formats
from roundalign.analysis.plots._tables import load_table, table_path, tables

# stem -> module, in the order they are made
FIGURES = {m.STEM: m for m in (fig_reward, fig_k3, fig_is_ratio, fig_logp_diff, fig_probe, fig_attn, fig_attribution,
                                 summary)}
# figures drawn only from a table that not every aggregate holds: stem -> that table. Left out (all figures asked
# for) where it is absent; asked for by name, a missing table is an error.
OPTIONAL_FIGURES = {fig_attribution.STEM: fig_attribution.TABLE}
# The figures of a sweep with a dose axis (its aggregate holds stress_runs.csv: the stress and dose experiments) when
# all are drawn with its stress figures (make figures): the probe and the summary table. The other per-model figures
# repeat there what the stress figures show per dose with intervals over runs (fig_reward: stress_reward; fig_k3,
# fig_logp_diff and fig_is_ratio, the token mismatch per step: stress_mismatch), or an axis such a sweep does not have
# (fig_attn: the trainer's attention); drawing them cost a quarter of `make figures`.
STRESS_SWEEP_FIGURES = (fig_probe.STEM, summary.STEM)

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
        "layer is drawn dashed over it and named in the panel. A probe against real vLLM adds, per engine mode, the "
        "engine's own prefill of its sampled tokens ('prefill') and the emulated engine ('vs emulated'); with more "
        "than eight model-engine entries the two bar panels are stacked, each as wide as the figure."),
    "fig_attn": (
        "Mismatch of every training arm, trainer variant x trainer attention, one panel per policy (entries that "
        "reuse a policy with another attention share its panel): a bar is the mean over seeds of each run's median "
        "token-level k3 over its steps (log scale), dots are the seeds, exact zeros sit on the floor labelled "
        "'0 (bitwise)'. With two attentions (the vllm-cpu sweep: the trainer's SDPA and the engine's own CPU "
        "kernel) baseline/full x sdpa/vllm_cpu is the 2x2: neither, alignment alone, attention alone, both."),
    "fig_attribution": (
        "Where the train-vs-engine mismatch comes from (roundalign attribute, one panel per model and engine mode, "
        "at the warm-started weights, with the engine and trainer settings of the sweep's training runs): the engine "
        "samples one completion per prompt and the trainer rescores the same tokens, and the sources of their "
        "difference are equalized one by one in a fixed order (filled markers joined by a line: the cumulative "
        "waterfall, 'none' = nothing equalized) and each alone against nothing (hollow markers, just right of that "
        "source's step). y: token-level k3 estimate of KL(engine || trainer), nats per token (log scale, one scale for all "
        "panels); error bars: 95% percentile bootstrap intervals over prompts. Exact zeros, bitwise-identical "
        "log-probabilities on every token, sit on the dotted floor labelled '0 (bitwise)', a decade below the "
        "smallest positive k3 (an interval reaching below it is drawn down to it). Under each step: the k3 "
        "it removes, in percent of step 0's (paired over the same resamples; negative where equalizing the source "
        "added k3; '0': exactly nothing, '~0%': under half a percent either way). Sources a backend or setting does not have are left out (attribution.json says why)."),
    "summary": (
        "Per model and trainer variant, over seeds: number of seeds, of finished and of collapsed runs "
        "with their collapse steps, runs whose reward collapsed, final reward (mean of reward/mean over the "
        "last 10% of logged steps, at least one, then mean over seeds), peak token-level k3 (maximum "
        "over steps, then mean over seeds), and whether the arm learns: the mean reward of the first and of the last "
        "10 logged steps and their difference, with a 95% bootstrap interval over seeds and the steps of each "
        "window (the arm learns when the interval lies above 0)."),
}


def make_all(aggregate_dir, out_dir: str | Path, formats=("png", "pdf"), figures=None, log=print) -> list[Path]:
    """Make every figure (or the stems in ``figures``) into ``out_dir``; returns the written paths.
    ``aggregate_dir`` is a directory or a ``_tables.Tables`` (tables already read are not read again).
    Raises FileNotFoundError when ``aggregate_dir`` is missing and ValueError on an unknown format or stem."""
    return make_sweeps([(aggregate_dir, out_dir)], formats, figures, log=log)


# Rough relative cost of each figure (seconds on one core for a sweep of about four models; _shares scales it by a
# sweep's models): the parallel rebuild splits the sweeps between the workers by it and has each start on its
# dearest figures, so that the last figure to start is a cheap one.
_COST = {"fig_is_ratio": 2.2, "stress_survival": 0.9, "stress_mismatch": 1.9, "stress_reward": 1.4,
         "fig_probe": 1.4, "fig_logp_diff": 1.3, "stress_gap": 0.5, "fig_reward": 0.9, "fig_k3": 0.9,
         "stress_dose": 0.7, "dose_gain": 0.7, "fig_attribution": 1.2, "fig_attn": 0.6, "summary": 0.4,
         "stress_summary": 0.1}
_POOL: dict = {}  # what a forked worker inherits: (tables, out_dir) per sweep, the formats, the task queues


def _tasks(pairs, figures, stress, every=False) -> list[tuple[int, str, str]]:
    """(sweep index, kind, stem) of every file group to make, in the canonical (serial) order. With ``every`` (no
    figure named) an optional figure is made only for an aggregate that holds its table, and with ``stress`` too an
    aggregate with stress tables gets ``STRESS_SWEEP_FIGURES`` only, besides its stress figures."""
    tasks = []
    for i, (agg, _) in enumerate(pairs):
        dose_axis = stress and agg.has("stress_runs")
        tasks += [(i, "figure", stem) for stem in figures
                  if not (every and ((stem in OPTIONAL_FIGURES and not agg.has(OPTIONAL_FIGURES[stem]))
                                     or (dose_axis and stem not in STRESS_SWEEP_FIGURES)))]
        if dose_axis:
            tasks += [(i, "stress", stem) for stem in stress_plots.STEMS] + [(i, "stress", "stress_summary")]
        if stress and agg.has("dose_outcome"):  # the dose experiment (plots/dose.py)
            tasks.append((i, "dose", "dose_gain"))
    return tasks


def _run_task(task) -> tuple[tuple[int, str, str], list[Path], float]:
    i, kind, stem = task
    (agg, out_dir), formats = _POOL["pairs"][i], _POOL["formats"]
    t = time.perf_counter()
    if kind == "figure":
        written = FIGURES[stem].make(agg, out_dir, formats)
    elif kind == "dose":
        written = dose_plots.make(agg, out_dir, formats)
    elif stem == "stress_summary":
        written = stress_plots.make(agg, out_dir, formats, stems=[], summary=True)
    else:
        written = stress_plots.make(agg, out_dir, formats, stems=[stem], summary=False)
    return task, written, time.perf_counter() - t


def _shares(pairs, tasks, procs: int) -> list[list[int]]:
    """The sweeps split into ``procs`` shares (each worker then reads only its own sweeps' tables: reading them all
    in the parent before the fork is a serial ~1.5 s), by estimated cost, the dearest sweep first to the cheapest
    share. A sweep's cost: its figures' ``_COST``, scaled by its number of models (panels; run_status.csv, read
    here, so that the workers inherit it), and ~0.02 s per MB of runs.csv to read."""
    cost: dict[int, float] = {}
    for task in tasks:
        cost[task[0]] = cost.get(task[0], 0.0) + _COST.get(task[2], 1.0)
    for i in cost:
        agg = pairs[i][0]
        models = agg["run_status"]["model"].nunique() if agg.has("run_status") else 1
        cost[i] = cost[i] * (0.5 + 0.2 * models) + 0.02 * (agg.dir / "runs.csv").stat().st_size / 2 ** 20
    shares: list[list[int]] = [[] for _ in range(procs)]
    load = [0.0] * procs
    for sweep in sorted(cost, key=lambda i: (-cost[i], i)):
        k = load.index(min(load))
        shares[k].append(sweep)
        load[k] += cost[sweep]
    return shares


def _claim(k: int, loaded: set):
    """The next task for worker ``k``: the dearest left of its own sweeps; when they are done, the cheapest left of
    a sweep it has read already, else of the sweep with the most left (a worker ahead of its estimate takes over the
    tail of another's, reading as few other sweeps as it can). ``loaded``: the sweeps this worker has read."""
    queues, ends, mine = _POOL["queues"], _POOL["ends"], _POOL["shares"][k]  # ends[i]: [front, back + 1]
    while True:
        left = {i: ends[i][1] - ends[i][0] for i in queues}
        own = [i for i in mine if left[i] > 0]
        if own:
            i = max(own, key=lambda j: (_COST.get(queues[j][ends[j][0]][2], 1.0), -j))
            end = 0
        elif any(n > 0 for n in left.values()):
            i = max((j for j in left if left[j] > 0), key=lambda j: (j in loaded, left[j], -j))
            end = 1
        else:
            return None
        with ends[i].get_lock():
            front, back = ends[i]
            if front < back:
                ends[i][end] = front + 1 if end == 0 else back - 1
                loaded.add(i)
                return queues[i][front if end == 0 else back - 1]


def _worker(k: int, results) -> None:
    """A forked worker: make tasks until none is left, each result (or the exception that stopped it) on
    ``results``."""
    loaded: set = set()
    while (task := _claim(k, loaded)) is not None:
        try:
            results.put(("done", _run_task(task)))
        except BaseException as exc:  # the parent raises it
            try:
                pickle.dumps(exc)
            except Exception:
                exc = RuntimeError("".join(traceback.format_exception(exc)))
            results.put(("error", exc))
            return


def _parallel(pairs, tasks, procs: int):
    """``_run_task`` of every task in ``procs`` forked workers; yields each result as it comes."""
    ctx = multiprocessing.get_context("fork")
    queues = {i: sorted((t for t in tasks if t[0] == i), key=lambda t: -_COST.get(t[2], 1.0))
              for i in dict.fromkeys(t[0] for t in tasks)}  # each sweep's tasks, dearest first
    _POOL.update(shares=_shares(pairs, tasks, procs), queues=queues,
                 ends={i: ctx.Array("i", [0, len(q)]) for i, q in queues.items()})
    results = ctx.Queue()
    workers = [ctx.Process(target=_worker, args=(k, results), daemon=True) for k in range(procs)]
    try:
        for w in workers:
            w.start()
        for _ in tasks:
            while True:
                try:
                    kind, value = results.get(timeout=1.0)
                    break
                except queue.Empty:
                    if any(w.is_alive() for w in workers):
                        continue
                    try:  # every worker has exited: what one put last has reached the queue by now
                        kind, value = results.get(timeout=1.0)
                        break
                    except queue.Empty:
                        raise RuntimeError(f"figure workers exited with {[w.exitcode for w in workers]} before "
                                           "every figure was made") from None
            if kind == "error":
                raise value
            yield value
    finally:
        for w in workers:
            if w.is_alive():
                w.terminate()
            w.join()


def make_sweeps(pairs, formats=("png", "pdf"), figures=None, stress=False, jobs: int = 1, log=print) -> list[Path]:
    """``make_all`` for each (aggregate_dir, out_dir) of ``pairs``, and with ``stress`` also the stress figures
    (``roundalign.analysis.plots.stress``) of every aggregate directory that holds stress_runs.csv; returns the written paths
    in the serial order whatever ``jobs`` is. Without ``figures``, ``OPTIONAL_FIGURES`` are made where their table
    is there (fig_attribution where the aggregate holds attribution.csv), and with ``stress`` an aggregate that holds
    stress_runs.csv gets ``STRESS_SWEEP_FIGURES`` of the per-model figures.

    Each table is read once per process that needs it, when first needed. With ``jobs`` > 1 the figures are drawn
    by that many forked worker processes, which inherit the imports (nothing is pickled but the task and the
    paths), each with its share of the sweeps (``_shares``) and reading only their tables; each figure is drawn by
    one process from the same tables either way, so the files are the same bytes as a serial run's
    (tests/test_plots.py)."""
    formats = check_formats(formats)
    every = figures is None
    figures = list(FIGURES) if every else list(figures)
    unknown = [f for f in figures if f not in FIGURES]
    if unknown:
        raise ValueError(f"unknown figure(s) {', '.join(unknown)}; choose from {', '.join(FIGURES)}")
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    pairs = [(tables(a), Path(o)) for a, o in pairs]
    for agg, out_dir in pairs:  # fail before any output when an aggregate is missing
        table_path(agg.dir, "runs")
        out_dir.mkdir(parents=True, exist_ok=True)
    tasks = _tasks(pairs, figures, stress, every)
    procs = min(jobs, len(tasks))
    _POOL.update(pairs=pairs, formats=formats)
    t0 = time.perf_counter()
    done: dict = {}
    try:
        for task, written, dt in (_parallel(pairs, tasks, procs) if procs > 1 else map(_run_task, tasks)):
            done[task] = written
            log(f"[plot] {pairs[task[0]][1]}/{task[2]}: {', '.join(p.name for p in written)} ({dt:.1f}s)")
    finally:
        _POOL.clear()
    paths = [p for task in tasks for p in done[task]]
    log(f"[plot] wrote {len(paths)} files in {time.perf_counter() - t0:.1f}s "
        f"({procs} process{'es' if procs > 1 else ''})")
    return paths


__all__ = ["CAPTIONS", "FIGURES", "FORMATS", "OPTIONAL_FIGURES", "STRESS_SWEEP_FIGURES", "make_all", "make_sweeps", "load_table", "tables"]
