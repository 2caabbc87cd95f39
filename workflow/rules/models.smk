# Preparing models and data. Tiny models are built and warm-started locally; hub snapshots and datasets
# are fetched on the submit host (localrule), since compute nodes often have no network.


rule make_tiny:
    output:
        directory(f"{WORK}/models/tiny/{{model}}/base"),
    log:
        f"{LOGS}/make_tiny/{{model}}.log",
    conda:
        CONDA_ENV
    params:
        args=lambda wc: tiny_args(wc.model),
    shell:
        "python -m roundalign make-tiny --out {output} {params.args} > {log} 2>&1"


rule pretrain_tiny:
    input:
        f"{WORK}/models/tiny/{{model}}/base",
    output:
        directory(f"{WORK}/models/tiny/{{model}}/policy"),
    log:
        f"{LOGS}/pretrain_tiny/{{model}}.log",
    conda:
        CONDA_ENV
    resources:
        mem_mb=4000,
        runtime=30,
    params:
        steps=lambda wc: SWEEP.models[wc.model]["tiny"]["pretrain_steps"],
        seed=lambda wc: SWEEP.models[wc.model]["tiny"]["seed"],
        task=lambda wc: SWEEP.pretrain_args(wc.model),
    shell:
        "python -m roundalign pretrain-tiny --model {input} --out {output} --steps {params.steps} "
        "--seed {params.seed} {params.task} > {log} 2>&1"


rule fetch_model:
    output:
        directory(f"{WORK}/models/hub/{{model}}/policy"),
    log:
        f"{LOGS}/fetch_model/{{model}}.log",
    localrule: True
    conda:
        CONDA_ENV
    params:
        hub_id=lambda wc: SWEEP.models[wc.model]["hub_id"],
        revision=lambda wc: SWEEP.models[wc.model]["revision"],
    shell:
        "python -m roundalign fetch-model --hub-id {params.hub_id} --revision {params.revision} "
        "--out {output} > {log} 2>&1"


rule prepare_data:
    output:
        f"{WORK}/data/{{slug}}.jsonl",
    log:
        f"{LOGS}/prepare_data/{{slug}}.log",
    localrule: True
    conda:
        CONDA_ENV
    params:
        dataset=SWEEP.config["data"]["math_dataset"],
        split=SWEEP.config["data"]["math_split"],
    shell:
        "python -m roundalign prepare-data --dataset {params.dataset} --split {params.split} "
        "--out {output} > {log} 2>&1"
