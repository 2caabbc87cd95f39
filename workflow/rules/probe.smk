# Offline probe at identical weights: an engine samples (the emulated one on CPU, or real vLLM on one GPU with
# probe.backend vllm, resources from the model's entry), each trainer variant rescores.


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
        gpu=lambda wc: SWEEP.probe_resources(wc.model)["gpu"],
        gpu_model=lambda wc: SWEEP.probe_resources(wc.model)["gpu_model"],
        cpus_per_gpu=lambda wc: SWEEP.probe_resources(wc.model)["cpus_per_gpu"],
        mem_mb=lambda wc: SWEEP.probe_resources(wc.model)["mem_mb"],
        runtime=lambda wc: SWEEP.probe_resources(wc.model)["runtime"],
    params:
        p=SWEEP.config["probe"],
        variants=",".join(SWEEP.config["probe"]["variants"]),
        engine_args=lambda wc: SWEEP.probe_engine_args(wc.model),
        python=SWEEP.python,
        trainer_attn=(
            ""
            if SWEEP.config["probe"]["trainer_attn"] == "same"
            else f"--trainer-attn {SWEEP.config['probe']['trainer_attn']}"
        ),
    shell:
        "{params.python} -m roundalign probe --model {input.model} --engine {wildcards.engine} --attn {params.p[attn]} "
        "{params.trainer_attn} "
        "--engine-gemm {params.p[engine_gemm]} --variants {params.variants} --prompts {params.p[prompts]} "
        "--max-new-tokens {params.p[max_new_tokens]} --context-tokens {params.p[context_tokens]} "
        "--backend {params.p[backend]} --gpu-memory-utilization {params.p[gpu_memory_utilization]} "
        "{params.engine_args} --seed 0 --out {output.table} > {log} 2>&1"


# The dose experiment's probe table: every dose's probe at the warm start's weights, in one table (committed before
# any training: docs/prereg-dose.md).
rule dose_probe:
    input:
        lambda wc: probe_outputs(wc.sweep),
    output:
        "results/{sweep}/probe/dose_probe.csv",
    log:
        "logs/{sweep}/dose_probe.log",
    localrule: True
    conda:
        CONDA_ENV
    shell:
        "python -m roundalign dose-probe --probes {input} --out {output} > {log} 2>&1"
