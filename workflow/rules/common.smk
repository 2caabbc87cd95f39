# Shared helpers: the validated sweep (roundalign.training.sweep.Sweep does the cross-field checks, so a malformed
# config fails here, naming the key, before any job starts) and the target lists of every rule.
from roundalign.training.config import ConfigError
from roundalign.training.sweep import Sweep

try:
    SWEEP = Sweep(config)
except ConfigError as exc:
    raise ValueError(f"invalid sweep config: {exc}") from None


# Before the first job of a real run (not a dry run): a `python:` path that does not exist would otherwise fail
# every train and probe job with exit 127, after the model builds and warm starts.
onstart:
    if problem := SWEEP.interpreter_problem():
        raise ValueError(f"invalid sweep config: {problem}")


WORK = str(SWEEP.workdir)
LOGS = f"logs/{SWEEP.name}"
RESULTS = f"results/{SWEEP.name}"


wildcard_constraints:
    model="|".join(sorted(SWEEP.models)),
    variant="[a-z0-9+-]+",
    seed=r"\d+",
    engine="vllm-compiled|vllm-eager|vllm-cpu-compiled|vllm-cpu-eager",
    sweep="[A-Za-z0-9._-]+",


def tiny_args(model):
    t = SWEEP.models[SWEEP.models[model].get("base") or model]["tiny"]
    return (
        f"--arch {t['arch']} --hidden {t['hidden']} --layers {t['layers']} --heads {t['heads']} "
        f"--kv-heads {t['kv_heads']} --seed {t['seed']} --qk-outlier-scale {t['qk_outlier_scale']} "
        + ("--tie" if t["tie"] else "--no-tie")
    )


def policy(wildcards):
    return SWEEP.policy_dir(wildcards.model)


def train_inputs(wildcards):
    inputs = {"model": policy(wildcards)}
    if SWEEP.train_overrides(wildcards.model).get("task") == "math":
        inputs["data"] = SWEEP.math_data_file()
    return inputs


def run_outputs(sweep):
    return expand(
        "results/{sweep}/runs/{run.model}/{run.variant}/seed{run.seed}/run.json",
        sweep=sweep,
        run=SWEEP.runs(),
    )


def probe_outputs(sweep):
    return expand(
        "results/{sweep}/probe/{model}/{engine}.csv",
        sweep=sweep,
        model=SWEEP.probed_models(),
        engine=SWEEP.config["probe"]["engines"],
    )


def attribution_outputs(sweep):
    # none when the config's attribution: is not enabled
    return expand(
        "results/{sweep}/attribution/{model}/{engine}/{file}",
        sweep=sweep,
        model=SWEEP.attributed_models(),
        engine=SWEEP.attribution["engines"] if SWEEP.attribution else [],
        file=["attribution.csv", "attribution.json", "waterfall.png"],
    )


# the dose experiment (configs/dose.yaml): a stress sweep whose dose is the engine's rounding at the regions
IS_DOSE = bool(SWEEP.stress) and SWEEP.stress["dose_key"] == "engine_dose_bits"


def dose_probe_targets(sweep):
    return [f"results/{sweep}/probe/dose_probe.csv"] if IS_DOSE else []


# a stress sweep (config key stress:) adds its own tables and figures, an attribution its table and figure
SWEEP_TABLES = (
    AGGREGATE_TABLES
    + (STRESS_TABLES if SWEEP.stress else [])
    + (DOSE_TABLES if IS_DOSE else [])
    + (ATTRIBUTION_TABLES if SWEEP.attribution else [])
)


def aggregate_targets(sweep):
    return expand(
        "results/{sweep}/aggregate/{table}.csv", sweep=sweep, table=SWEEP_TABLES
    )


def aggregate_args():
    keys = SWEEP.config.get("aggregate_metrics") or []
    return f"--metrics {','.join(keys)}" if keys else ""


def stress_args():
    s = SWEEP.stress
    if not s:
        return ""
    return (
        f"--stress-dose-key {s['dose_key']} --stress-floor {s['floor_variant']} "
        f"--stress-gap-metric {s['gap_metric']}"
    )
