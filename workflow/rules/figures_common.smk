# Constants and target helpers shared by the main Snakefile and workflow/figures.smk.

FIGURE_STEMS = [
    "fig_reward",
    "fig_k3",
    "fig_is_ratio",
    "fig_logp_diff",
    "fig_probe",
    "fig_attn",
]
AGGREGATE_TABLES = ["runs", "run_status", "probe", "probe_layers"]
# drawn where the aggregate has them: a sweep with attribution: enabled (roundalign attribute per model and engine)
ATTRIBUTION_TABLES = ["attribution"]
ATTRIBUTION_FIGURE_STEMS = ["fig_attribution"]
STRESS_TABLES = ["stress_runs", "stress_survival", "stress_gap"]
DOSE_TABLES = ["dose_outcome", "dose_gain", "dose_tests"]
STRESS_FIGURE_STEMS = [
    "stress_survival",
    "stress_mismatch",
    "stress_reward",
    "stress_dose",
    "stress_gap",
]
# Shell rules run `python -m roundalign` from PATH: the environment Snakemake runs in (make puts .venv/bin
# first; on a cluster, the activated conda environment of environment.yml, which jobs inherit). The conda
# directive documents that environment for --software-deployment-method conda.
CONDA_ENV = "../../environment.yml"


# the per-model figures of a sweep with a dose axis (stress: in its config; its aggregate holds stress_runs.csv),
# drawn beside its stress figures: roundalign.analysis.plots.STRESS_SWEEP_FIGURES (the rest repeat the stress figures)
STRESS_SWEEP_FIGURE_STEMS = ["fig_probe"]


def figure_stems(attribution=False, stress=False):
    if stress:
        return STRESS_SWEEP_FIGURE_STEMS
    return FIGURE_STEMS + (ATTRIBUTION_FIGURE_STEMS if attribution else [])


def figure_targets(sweep, attribution=False, stress=False):
    return expand(
        "figures/{sweep}/{stem}.{ext}",
        sweep=sweep,
        stem=figure_stems(attribution, stress),
        ext=["png", "pdf"],
    ) + expand("figures/{sweep}/summary.{ext}", sweep=sweep, ext=["csv", "md"])


# the dose experiment's own figure (analysis/plots/dose.py), drawn with the stress figures of a sweep whose aggregate
# holds dose_outcome.csv
DOSE_FIGURE_STEMS = ["dose_gain"]


def stress_figure_targets(sweep, dose=False):
    return expand(
        "figures/{sweep}/{stem}.{ext}",
        sweep=sweep,
        stem=STRESS_FIGURE_STEMS + (DOSE_FIGURE_STEMS if dose else []),
        ext=["png", "pdf"],
    ) + expand("figures/{sweep}/stress_summary.{ext}", sweep=sweep, ext=["csv", "md"])
