# Figures from the aggregated tables only. Included by the main Snakefile and by workflow/figures.smk,
# the entry point that rebuilds figures from committed tables without any training rule.


rule figures:
    input:
        expand("results/{{sweep}}/aggregate/{table}.csv", table=AGGREGATE_TABLES),
    output:
        *[
            report(
                f"figures/{{sweep}}/{stem}.png",
                caption=f"../report/{stem}.rst",
                category="Figures",
            )
            for stem in FIGURE_STEMS
        ],
        expand("figures/{{sweep}}/{stem}.pdf", stem=FIGURE_STEMS),
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
    shell:
        "python -m roundalign plot --aggregate results/{wildcards.sweep}/aggregate --out figures/{wildcards.sweep} "
        "> {log} 2>&1"
