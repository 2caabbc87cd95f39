# Aggregation of every run, probe and attribution into tidy tables, and the figures. The figures rule is shared with
# workflow/figures.smk, the entry point that rebuilds figures from committed tables without training.


rule aggregate:
    input:
        runs=lambda wc: run_outputs(wc.sweep),
        probes=lambda wc: probe_outputs(wc.sweep),
        attribution=lambda wc: attribution_outputs(wc.sweep),
    output:
        expand("results/{{sweep}}/aggregate/{table}.csv", table=SWEEP_TABLES),
    log:
        "logs/{sweep}/aggregate.log",
    localrule: True
    conda:
        CONDA_ENV
    params:
        stress=stress_args(),
        metrics=aggregate_args(),
    shell:
        "python -m roundalign aggregate --results results/{wildcards.sweep} --sweep {wildcards.sweep} "
        "--out results/{wildcards.sweep}/aggregate {params.metrics} {params.stress} > {log} 2>&1"


include: "figures_rule.smk"
include: "stress_figures_rule.smk"
