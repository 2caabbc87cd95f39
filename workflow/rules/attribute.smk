# Where the mismatch comes from (attribution: in the config): per model and engine, the engine samples at the
# warm-started weights, the trainer rescores the same tokens, and the sources of the difference are equalized one by
# one (roundalign attribute). Run by the sweep's `python:` as the train and probe jobs are (vLLM's CPU build for
# the vllm-cpu sweep); resources as the probe's.


rule attribute:
    input:
        model=policy,
    output:
        table="results/{sweep}/attribution/{model}/{engine}/attribution.csv",
        meta="results/{sweep}/attribution/{model}/{engine}/attribution.json",
        waterfall="results/{sweep}/attribution/{model}/{engine}/waterfall.png",
    log:
        "logs/{sweep}/attribution/{model}/{engine}.log",
    conda:
        CONDA_ENV
    resources:
        gpu=lambda wc: SWEEP.attribution_resources(wc.model, wc.engine)["gpu"],
        gpu_model=lambda wc: SWEEP.attribution_resources(wc.model, wc.engine)[
            "gpu_model"
        ],
        cpus_per_gpu=lambda wc: SWEEP.attribution_resources(wc.model, wc.engine)[
            "cpus_per_gpu"
        ],
        mem_mb=lambda wc: SWEEP.attribution_resources(wc.model, wc.engine)["mem_mb"],
        runtime=lambda wc: SWEEP.attribution_resources(wc.model, wc.engine)["runtime"],
    params:
        python=SWEEP.python,
        args=lambda wc: SWEEP.attribute_args(wc.model, wc.engine),
        out=lambda wc, output: str(Path(output.table).parent),
    shell:
        "{params.python} -m roundalign attribute --model {input.model} --engine {wildcards.engine} {params.args} "
        "--out {params.out} > {log} 2>&1"
