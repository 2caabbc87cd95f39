# Figures of a mismatch-stress sweep (configs/stress.yaml) from its aggregated stress tables only. Included by
# the main Snakefile (through report.smk) and by workflow/figures.smk.


rule stress_figures:
    input:
        expand("results/{{sweep}}/aggregate/{table}.csv", table=STRESS_TABLES),
    output:
        *[
            report(
                f"figures/{{sweep}}/{stem}.png",
                caption=f"../report/{stem}.rst",
                category="Stress figures",
            )
            for stem in STRESS_FIGURE_STEMS
        ],
        expand("figures/{{sweep}}/{stem}.pdf", stem=STRESS_FIGURE_STEMS),
        expand("figures/{{sweep}}/stress_summary.{ext}", ext=["csv", "md"]),
    log:
        "logs/{sweep}/stress_figures.log",
    localrule: True
    conda:
        CONDA_ENV
    shell:
        "python -m roundalign plot-stress --aggregate results/{wildcards.sweep}/aggregate "
        "--out figures/{wildcards.sweep} > {log} 2>&1"


# The dose experiment's own figure (configs/dose.yaml; analysis/plots/dose.py), from its outcome table.
rule dose_figures:
    input:
        "results/{sweep}/aggregate/dose_outcome.csv",
    output:
        expand(
            "figures/{{sweep}}/{stem}.{ext}",
            stem=DOSE_FIGURE_STEMS,
            ext=["png", "pdf"],
        ),
    log:
        "logs/{sweep}/dose_figures.log",
    localrule: True
    conda:
        CONDA_ENV
    shell:
        "python -m roundalign plot-dose --aggregate results/{wildcards.sweep}/aggregate "
        "--out figures/{wildcards.sweep} > {log} 2>&1"
