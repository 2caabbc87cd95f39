"""Figures from the committed aggregate tables only: no training, probe or model rule is included, so a
missing table is a clear MissingInputException instead of a retraining.

    snakemake -s workflow/figures.smk --cores 1        # (make figures)

Every sweep with a committed results/<sweep>/aggregate/runs.csv is plotted into figures/<sweep>/.
"""

from pathlib import Path


include: "rules/figures_common.smk"
include: "rules/figures_rule.smk"
include: "rules/stress_figures_rule.smk"


SWEEPS = sorted(
    p.parent.parent.name for p in Path("results").glob("*/aggregate/runs.csv")
)
if not SWEEPS:
    raise ValueError(
        "no results/<sweep>/aggregate/runs.csv found: nothing to plot (run the sweep first)"
    )


rule all:
    default_target: True
    input:
        [figure_targets(s) for s in SWEEPS],
        [
            stress_figure_targets(s)
            for s in SWEEPS
            if Path(f"results/{s}/aggregate/stress_runs.csv").is_file()
        ],
