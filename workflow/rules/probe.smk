# Offline probe at identical weights: the emulated engine samples, each trainer variant rescores.


rule probe:
    input:
        model=policy,
    output:
        table="results/{sweep}/probe/{model}/{engine}.csv",
        layers="results/{sweep}/probe/{model}/{engine}_layers.csv",
        meta="results/{sweep}/probe/{model}/{engine}.json",
    log:
        "logs/{sweep}/probe/{model}/{engine}.log",
    conda:
        CONDA_ENV
    resources:
        mem_mb=SWEEP.config["probe"]["mem_mb"],
        runtime=SWEEP.config["probe"]["runtime_min"],
    params:
        p=SWEEP.config["probe"],
        variants=",".join(SWEEP.config["probe"]["variants"]),
    shell:
        "python -m roundalign probe --model {input.model} --engine {wildcards.engine} --attn {params.p[attn]} "
        "--engine-gemm {params.p[engine_gemm]} --variants {params.variants} --prompts {params.p[prompts]} "
        "--max-new-tokens {params.p[max_new_tokens]} --context-tokens {params.p[context_tokens]} "
        "--seed 0 --out {output.table} > {log} 2>&1"
