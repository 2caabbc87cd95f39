# GRPO runs. The declared outputs are small copies exported when a run finishes; the run directory with
# its checkpoints lives under the workdir, outside the outputs, so Snakemake never deletes it when a job
# fails or is preempted, and a resubmitted job resumes where it stopped (roundalign train resumes itself).


rule train:
    input:
        unpack(train_inputs),
    output:
        metrics="results/{sweep}/runs/{model}/{variant}/seed{seed}/metrics.jsonl",
        run="results/{sweep}/runs/{model}/{variant}/seed{seed}/run.json",
    log:
        "logs/{sweep}/train/{model}/{variant}/seed{seed}.log",
    retries: 2
    conda:
        CONDA_ENV
    threads: lambda wc: SWEEP.train_resources(wc.model)["threads"]
    resources:
        gpu=lambda wc: SWEEP.train_resources(wc.model)["gpu"],
        gpu_model=lambda wc: SWEEP.train_resources(wc.model)["gpu_model"],
        cpus_per_gpu=lambda wc: SWEEP.train_resources(wc.model)["cpus_per_gpu"],
        mem_mb=lambda wc: SWEEP.train_resources(wc.model)["mem_mb"],
        runtime=lambda wc, attempt: SWEEP.train_resources(wc.model, attempt)["runtime"],
    params:
        run_dir=lambda wc: SWEEP.run_dir(wc.model, wc.variant, wc.seed),
        export=lambda wc, output: str(Path(output.run).parent),
        launcher=lambda wc: SWEEP.launcher(wc.model),
        sets=lambda wc: SWEEP.train_set_args(wc.model),
    shell:
        "{params.launcher} -m roundalign train --model {input.model} --variant {wildcards.variant} "
        "--seed {wildcards.seed} --out {params.run_dir} --export {params.export} {params.sets} >> {log} 2>&1"
