"""Figures from the committed aggregate tables only: no training, probe or model rule is included, so a
missing table is a clear MissingInputException instead of a retraining.

    snakemake -s workflow/figures.smk --cores all      # (make figures runs its command directly)

Every sweep with a committed results/<sweep>/aggregate/runs.csv is plotted into figures/<sweep>/, one with
results/<sweep>/aggregate/stress_runs.csv also gets the stress figures, and one with attribution.csv there
fig_attribution. One job draws them all, in one process:
the plotting imports are paid once and each table is read once, so adding a sweep adds only its figures' time
(a process per sweep and kind cost ~4 s each on 2 cores, most of `make figures`), and the figures are shared
out among forked workers, one per core given (`--cores`; the same bytes as one process).
"""

from pathlib import Path


include: "rules/figures_common.smk"


SWEEPS = sorted(
    p.parent.parent.name for p in Path("results").glob("*/aggregate/runs.csv")
)
if not SWEEPS:
    raise ValueError(
        "no results/<sweep>/aggregate/runs.csv found: nothing to plot (run the sweep first)"
    )
STRESS_SWEEPS = [
    s for s in SWEEPS if Path(f"results/{s}/aggregate/stress_runs.csv").is_file()
]
# the dose experiment's sweeps (dose_outcome.csv) also get its figure
DOSE_SWEEPS = [
    s
    for s in STRESS_SWEEPS
    if Path(f"results/{s}/aggregate/dose_outcome.csv").is_file()
]
# sweeps whose aggregate holds an attribution table (attribution: enabled) also get fig_attribution
ATTRIBUTION_SWEEPS = [
    s for s in SWEEPS if Path(f"results/{s}/aggregate/attribution.csv").is_file()
]


rule all:
    default_target: True
    input:
        [figure_targets(s, s in ATTRIBUTION_SWEEPS, s in STRESS_SWEEPS) for s in SWEEPS],
        [stress_figure_targets(s, s in DOSE_SWEEPS) for s in STRESS_SWEEPS],


rule all_figures:
    input:
        [
            expand(
                "results/{sweep}/aggregate/{table}.csv",
                sweep=s,
                table=AGGREGATE_TABLES,
            )
            for s in SWEEPS
        ],
        [
            expand(
                "results/{sweep}/aggregate/{table}.csv", sweep=s, table=STRESS_TABLES
            )
            for s in STRESS_SWEEPS
        ],
        [
            expand(
                "results/{sweep}/aggregate/{table}.csv",
                sweep=s,
                table=ATTRIBUTION_TABLES,
            )
            for s in ATTRIBUTION_SWEEPS
        ],
        [
            expand("results/{sweep}/aggregate/{table}.csv", sweep=s, table=DOSE_TABLES)
            for s in DOSE_SWEEPS
        ],
    output:
        [figure_targets(s, s in ATTRIBUTION_SWEEPS, s in STRESS_SWEEPS) for s in SWEEPS],
        [stress_figure_targets(s, s in DOSE_SWEEPS) for s in STRESS_SWEEPS],
    log:
        "logs/figures.log",
    localrule: True
    conda:
        # CONDA_ENV is relative to workflow/rules/, where the other figure rules live
        "../environment.yml"
    threads: workflow.cores
    params:
        aggregates=" ".join(f"results/{s}/aggregate" for s in SWEEPS),
        outs=" ".join(f"figures/{s}" for s in SWEEPS),
    shell:
        "python -m roundalign plot --aggregate {params.aggregates} --out {params.outs} --stress --jobs {threads} > {log} 2>&1"
