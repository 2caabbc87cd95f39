# Figures from the aggregated tables only (the main Snakefile's; workflow/figures.smk, the entry point that rebuilds
# figures from committed tables without any training rule, has its own rule). fig_attribution where the config's
# attribution: is enabled; a sweep with a dose axis (stress:) only fig_probe and the summary of them.


rule figures:
    input:
        expand(
            "results/{{sweep}}/aggregate/{table}.csv",
            table=AGGREGATE_TABLES + (ATTRIBUTION_TABLES if SWEEP.attribution else []),
        ),
    output:
        *[
            report(
                f"figures/{{sweep}}/{stem}.png",
                caption=f"../report/{stem}.rst",
                category="Figures",
            )
            for stem in figure_stems(
                SWEEP.attribution is not None, SWEEP.stress is not None
            )
        ],
        expand(
            "figures/{{sweep}}/{stem}.pdf",
            stem=figure_stems(SWEEP.attribution is not None, SWEEP.stress is not None),
        ),
        report(
            "figures/{sweep}/summary.csv",
            caption="../report/summary.rst",
            category="Summary table",
        ),
        "figures/{sweep}/summary.md",
    log:
        "logs/{sweep}/figures.log",
    localrule: True
    conda:
        CONDA_ENV
    params:
        # a sweep with a dose axis: the probe and the summary (the stress figures show the rest per dose)
        figures=(
            "--figures " + ",".join(STRESS_SWEEP_FIGURE_STEMS + ["summary"])
            if SWEEP.stress is not None
            else ""
        ),
    shell:
        "python -m roundalign plot --aggregate results/{wildcards.sweep}/aggregate --out figures/{wildcards.sweep} "
        "{params.figures} > {log} 2>&1"
