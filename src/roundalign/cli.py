"""Command line: ``roundalign <verb> ...`` (or ``python -m roundalign <verb> ...``).

Examples::

    # a tiny Qwen3-style model with a locally built tokenizer
    roundalign make-tiny --arch qwen3 --out work/models/tiny-qwen3 --hidden 64 --layers 2

    # offline mismatch probe at identical weights, every alignment variant
    roundalign probe --model work/models/tiny-qwen3 --engine vllm-compiled --attn eager \\
        --engine-gemm same --variants baseline,rope,swiglu,norm,full --prompts 8 \\
        --max-new-tokens 16 --seed 0 --out results/probe/tiny-qwen3.csv

    # does the rounding map hold on the vLLM installed here? (vLLM's CPU build; exit 0 when it does)
    roundalign check-engine --engine vllm-cpu-eager,vllm-cpu-compiled --out results/check-engine

This module only parses arguments and calls ``run_<verb>``; every argument is validated (with the valid
choices named) before a model is loaded. Each verb imports its own stack when it runs (the imports marked
``lazy``): the figure verbs (``FIGURE_VERBS``) never load torch, and ``--help`` stays quick.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import shutil
import socket
import sys
import textwrap
from pathlib import Path

from roundalign.numerics.engines import CPU_ENGINES, is_cpu
from roundalign.settings import SettingError, add_argument, add_arguments, from_args, setting
from roundalign.training.config import (TrainConfig, build_config, parse_set, setting_default, setting_help,
                                        setting_type, show_value)


def _setup_runtime() -> None:
    # On small CPU machines torch with >1 thread made step times swing by 10x; default to 1 unless asked.
    import torch  # noqa: PLC0415 -- lazy: torch, off the figure verbs
    from transformers.utils import logging as hf_logging  # noqa: PLC0415 -- lazy: off the figure verbs

    from roundalign.envinfo import torch_threads  # noqa: PLC0415 -- lazy: torch, off the figure verbs

    torch.set_num_threads(torch_threads())
    hf_logging.disable_progress_bar()  # per-file "Loading weights" bars drown our own progress lines
    if importlib.util.find_spec("datasets") is not None:  # the harness's; the library install has none
        import datasets  # noqa: PLC0415 -- optional: datasets (the harness extra)

        datasets.disable_progress_bars()


def _csv_list(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _add_figure_verbs(sub) -> None:
    ps = sub.add_parser("plot-stress", help="figures of a stress sweep from its aggregated stress tables")
    ps.add_argument("--aggregate", required=True, help="aggregate directory holding stress_*.csv")
    ps.add_argument("--out", required=True, help="figure directory")
    ps.add_argument("--formats", default="png,pdf", help="comma-separated formats (default png,pdf)")

    pdz = sub.add_parser("plot-dose", help="the dose experiment's figure (dose_gain) from its dose_outcome.csv")
    pdz.add_argument("--aggregate", required=True, help="aggregate directory holding dose_outcome.csv")
    pdz.add_argument("--out", required=True, help="figure directory")
    pdz.add_argument("--formats", default="png,pdf", help="comma-separated formats (default png,pdf)")

    pl = sub.add_parser("plot", help="paper figures and summary table from aggregate directories")
    pl.add_argument("--aggregate", required=True, nargs="+",
                    help="directory written by `roundalign aggregate`; several (one per sweep) are drawn in one "
                         "process, each into the --out directory at the same position")
    pl.add_argument("--out", required=True, nargs="+",
                    help="output directory: fig_<name>.<fmt>, summary.csv, summary.md (one per --aggregate)")
    pl.add_argument("--formats", type=_csv_list, default=("png", "pdf"),
                    help="comma-separated image formats: png, pdf, svg (default png,pdf)")
    pl.add_argument("--figures", type=_csv_list, default=None,
                    help="comma-separated figure stems to make (default all: fig_reward, fig_k3, fig_is_ratio, "
                         "fig_logp_diff, fig_probe, fig_attn, summary, and fig_attribution where the aggregate holds "
                         "attribution.csv)")
    pl.add_argument("--stress", action="store_true",
                    help="also the stress figures (as plot-stress) of each aggregate directory holding "
                         "stress_runs.csv; without --figures, such a directory gets fig_probe and summary of the "
                         "per-model figures (the others repeat what its stress figures show per dose)")
    pl.add_argument("--jobs", type=int, default=1,
                    help="worker processes drawing the figures (forked, same bytes as one process; default 1)")


# Verbs that only read tables and draw. They get a parser of their own: make_parser() names the choices of every
# verb, and roundalign.models.tiny (ARCHS) imports torch, ~3 s of each figure process on 2 cores.
FIGURE_VERBS = ("plot", "plot-stress", "plot-dose")


def make_figure_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="roundalign", description=__doc__.split("\n\n")[0].replace("``", ""))
    _add_figure_verbs(p.add_subparsers(dest="verb", required=True, metavar="VERB"))
    return p


# train settings with a flag of their own; every other one is set with --config or --set KEY=VALUE
TRAIN_FLAGS = ("model", "variant", "seed", "backend", "engine", "attn", "task", "steps")


def train_flag_help(key: str) -> str:
    """The help of ``roundalign train --<key>``: the setting's own help (TrainConfig's field metadata), with its
    default (or, for model, where else it may be given)."""
    if key == "model":
        return f"required (here or as `model:` in --config): {setting_help(key)}"
    return f"{setting_help(key)} (default {show_value(setting_default(key))})"


def _add_train_flag(parser: argparse.ArgumentParser, key: str) -> None:
    parser.add_argument("--" + key.replace("_", "-"), dest=key, type=int if setting_type(key) is int else None,
                        help=train_flag_help(key).replace("%", "%%"))


def train_settings_epilog(width: int | None = None) -> str:
    """Every train setting (the keys of --config and --set) with its default and help, from TrainConfig's field
    metadata, as ``roundalign train --help`` ends; wrapped at ``width`` (default: the terminal's, as argparse)."""
    width = width or min(shutil.get_terminal_size().columns - 2, 118)
    lines = textwrap.wrap("train settings (keys of the --config YAML file and of --set KEY=VALUE; "
                          "docs/settings.md):", width)
    for f in dataclasses.fields(TrainConfig):
        default = "required" if f.default is dataclasses.MISSING else f"default {show_value(f.default)}"
        lines.append(f"  {f.name} ({default})")
        lines += textwrap.wrap(setting_help(f.name), width, initial_indent=" " * 6, subsequent_indent=" " * 6,
                               break_on_hyphens=False)
    return "\n".join(lines)


def make_parser() -> argparse.ArgumentParser:
    # the command verbs' modules import torch: ~3 s that the figure verbs' parser (above) does without
    from roundalign.models.tiny import ARCHS  # noqa: PLC0415 -- lazy: torch, off the figure verbs
    from roundalign.probes.attribute import AttributeConfig  # noqa: PLC0415 -- lazy: torch, off the figure verbs
    from roundalign.probes.probe import ProbeConfig  # noqa: PLC0415 -- lazy: torch, off the figure verbs

    p = argparse.ArgumentParser(prog="roundalign", description=__doc__.split("\n\n")[0].replace("``", ""),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="verb", required=True, metavar="VERB")

    t = sub.add_parser("make-tiny", help="build a tiny Qwen-architecture model + local tokenizer")
    t.add_argument("--arch", required=True, help=f"one of {', '.join(ARCHS)}")
    t.add_argument("--out", required=True, help="output directory (written atomically)")
    t.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    t.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    t.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    t.add_argument("--kv-heads", type=int, default=2, help="key/value heads (default 2)")
    t.add_argument("--intermediate", type=int, default=None, help="MLP width (default: 3x hidden)")
    t.add_argument("--vocab", type=int, default=None, help="vocab size (default: tokenizer size rounded up to 64)")
    t.add_argument("--tie", action=argparse.BooleanOptionalAction, default=True,
                   help="tie lm_head to the embedding (default: tied)")
    t.add_argument("--qk-outlier-scale", type=float, default=1.0,
                   help="scale of a few outlier q/k channels, as real checkpoints have (default 1.0 = off)")
    t.add_argument("--seed", type=int, default=0, help="init seed (default 0)")

    pr = sub.add_parser("probe", help="offline train-vs-engine mismatch probe at identical weights")
    add_arguments(pr, ProbeConfig)
    pr.add_argument("--out", required=True, help="output CSV; <stem>_layers.csv and <stem>.json go beside it")
    add_argument(pr, "backend", default="emulated")
    add_argument(pr, "device")
    add_argument(pr, "vllm_gpu_memory_utilization", dest="gpu_memory_utilization", default=PROBE_GPU_MEMORY)
    add_argument(pr, "vllm_cpu_gemm", default="stock", valid=PROBE_CPU_GEMMS)

    at = sub.add_parser("attribute", help="where the train-vs-engine mismatch comes from: sources equalized one by "
                        "one at identical weights (attribution.csv, attribution.json, waterfall.png)")
    add_arguments(at, AttributeConfig)
    at.add_argument("--out", required=True, help="output directory")

    ce = sub.add_parser("check-engine", help="whether the rounding maps hold on the vLLM installed here: its CPU build "
                        "against the aligned trainer on a tiny model, per engine mode (exit 0: every map holds, 1: one "
                        "does not)")
    ce.add_argument("--engine", type=_csv_list, default=None,
                    help=f"comma-separated engine modes to check, in this order (default {','.join(CPU_ENGINES)})")
    ce.add_argument("--model", help="model directory (Qwen2/Qwen3, head_dim >= 32); default: a tiny model built here")
    ce.add_argument("--arch", help="without --model: the tiny model's architecture, qwen2 or qwen3 (default qwen3)")
    ce.add_argument("--prompts", type=int, default=4, help="prompts, one completion each (default 4)")
    ce.add_argument("--max-new-tokens", type=int, default=16, help="completion length cap in tokens (default 16)")
    ce.add_argument("--context-tokens", type=int, default=112,
                    help="random tokens before each prompt (default 112: decoding crosses the first 128-token KV block)")
    ce.add_argument("--seed", type=int, default=0, help="seed of the prompts, the tiny model and the engine (default 0)")
    ce.add_argument("--out", help="directory for check_engine.json (default: print only)")

    tr = sub.add_parser("train", help="GRPO run on TRL's GRPOTrainer (resumes when rerun on the same --out)",
                        epilog=train_settings_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    for key in TRAIN_FLAGS[:3]:
        _add_train_flag(tr, key)
    tr.add_argument("--out", required=True, help="run directory: metrics.jsonl, run.json, checkpoints/")
    tr.add_argument("--config", help="YAML file of train settings (the keys listed below; docs/settings.md)")
    for key in TRAIN_FLAGS[3:]:
        _add_train_flag(tr, key)
    tr.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override any train setting (listed below); repeatable")
    tr.add_argument("--export", metavar="DIR",
                    help="when the run has finished (done or collapsed), copy metrics.jsonl and run.json into DIR "
                         "(atomically; the sweep's declared outputs, kept apart from the checkpoints)")

    pt = sub.add_parser("pretrain-tiny", help="short supervised warm start of a tiny model on arith or digits (TRL SFT)")
    pt.add_argument("--model", required=True, help="tiny model directory (from make-tiny)")
    pt.add_argument("--out", required=True, help="output model directory (written atomically)")
    pt.add_argument("--steps", type=int, default=1200, help="optimizer steps (default 1200)")
    pt.add_argument("--lr", type=float, default=3e-3, help="learning rate (default 3e-3)")
    pt.add_argument("--batch-size", type=int, default=32, help="examples per step (default 32)")
    pt.add_argument("--max-operand", type=int, default=49, help="largest arith operand (default 49)")
    pt.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    pt.add_argument("--task", choices=("arith", "digits"), default="arith", help="warm-start task (default arith)")
    pt.add_argument("--digits-op", choices=("copy", "reverse", "sort"), default="copy", help="task digits: the op")
    pt.add_argument("--digits-min-len", type=int, default=8, help="task digits: shortest string, digits (default 8)")
    pt.add_argument("--digits-max-len", type=int, default=32, help="task digits: longest string, digits (default 32)")
    pt.add_argument("--digits-len-step", type=int, default=1, help="task digits: length step (default 1)")

    ag = sub.add_parser("aggregate", help="gather a sweep's per-run and probe files into tidy long CSV tables")
    ag.add_argument("--results", required=True,
                    help="results root R holding runs/{model}/{variant}/seed{N}/ and probe/{model}/{engine}.csv")
    ag.add_argument("--out", required=True, help="output directory (R/aggregate by convention): runs.csv, "
                                                 "run_status.csv, probe.csv, probe_layers.csv")
    ag.add_argument("--strict", action="store_true",
                    help="fail (exit 2) naming every bad file; default: skip them with one warning")
    ag.add_argument("--sweep", help="value of the sweep column (default: the results root's directory name)")
    ag.add_argument("--metrics", type=_csv_list, default=None,
                    help="comma-separated metrics.jsonl keys to keep in runs.csv (default: every key)")
    ag.add_argument("--stress-dose-key", help="stress sweep: also write stress_runs/stress_survival/stress_gap.csv, "
                                              "with this train setting as the dose column")
    ag.add_argument("--stress-floor", default="fp32", help="stress: floor variant of the share of gap (default fp32)")
    ag.add_argument("--stress-gap-metric", default="mismatch/token/logp_abs_diff_mean",
                    help="stress: metric of the share of gap (default mismatch/token/logp_abs_diff_mean)")

    dp = sub.add_parser("dose-probe", help="the dose experiment's probe table (dose, variant, metric, value) from its "
                                           "probes, one per dose")
    dp.add_argument("--probes", nargs="+", required=True, help="probe CSVs (each with its .json beside it)")
    dp.add_argument("--out", required=True, help="output CSV (results/<sweep>/probe/dose_probe.csv by convention)")

    _add_figure_verbs(sub)

    fm = sub.add_parser("fetch-model", help="download a hub model snapshot (on a host with network)")
    fm.add_argument("--hub-id", required=True, help="hub id, e.g. Qwen/Qwen2.5-Math-1.5B")
    fm.add_argument("--revision", default="main", help="branch, tag or commit (default main)")
    fm.add_argument("--out", required=True, help="output directory (written atomically)")

    pd_ = sub.add_parser("prepare-data", help="write a hub math dataset as local JSONL (problem, answer)")
    pd_.add_argument("--dataset", required=True, help="hub dataset id, e.g. DigitalLearningGmbH/MATH-lighteval")
    pd_.add_argument("--split", default="train", help="split (default train)")
    pd_.add_argument("--out", required=True, help="output .jsonl file (written atomically)")
    return p


def run_fetch_model(args) -> None:
    from roundalign.models.fetch import fetch_model  # noqa: PLC0415 -- lazy: hub, datasets

    fetch_model(args.hub_id, args.out, revision=args.revision)


def run_prepare_data(args) -> None:
    from roundalign.models.fetch import prepare_math_data  # noqa: PLC0415 -- lazy: hub, datasets

    prepare_math_data(args.dataset, args.split, args.out)


def run_make_tiny(args) -> None:
    from roundalign.models.tiny import make_tiny  # noqa: PLC0415 -- lazy: torch, off the figure verbs

    out = make_tiny(args.arch, args.out, hidden=args.hidden, layers=args.layers, heads=args.heads,
                    kv_heads=args.kv_heads, intermediate=args.intermediate, vocab=args.vocab, tie=args.tie,
                    seed=args.seed, qk_outlier_scale=args.qk_outlier_scale)
    print(f"[make-tiny] wrote {out}")


# the share of GPU memory a probe's vLLM may take while it samples (training's colocated engine takes less): the
# sweep's probe.gpu_memory_utilization default, from the settings tree
PROBE_GPU_MEMORY = setting("probe.gpu_memory_utilization").default
# a probe's vLLM-CPU engine runs vLLM's own GEMM kernels ("stock"), or F.linear on live weights as training does
PROBE_CPU_GEMMS = ("stock", "live")


def run_probe_cli(args) -> None:
    from roundalign.probes.probe import ProbeConfig, run_probe  # noqa: PLC0415 -- lazy: torch, off the figure verbs

    cfg = from_args(ProbeConfig, args)
    if args.backend == "emulated" and (args.device is not None or args.gpu_memory_utilization != PROBE_GPU_MEMORY):
        raise SettingError("--device and --gpu-memory-utilization are the vllm backend's (where real vLLM samples); "
                           "the emulated backend runs on the CPU")
    if args.vllm_cpu_gemm not in PROBE_CPU_GEMMS:
        raise SettingError(f"--vllm-cpu-gemm {args.vllm_cpu_gemm}: a probe takes {' or '.join(PROBE_CPU_GEMMS)}")
    if args.vllm_cpu_gemm != "stock" and not (args.backend == "vllm" and is_cpu(cfg.engine)):
        raise SettingError(f"--vllm-cpu-gemm {args.vllm_cpu_gemm} is the vLLM-CPU engines' (--backend vllm with "
                           f"a vllm-cpu engine), not --backend {args.backend} with engine {cfg.engine}")
    if args.backend == "vllm" and is_cpu(cfg.engine) and args.device not in (None, "cpu"):
        raise SettingError(f"--device {args.device}: engine {cfg.engine} is vLLM's CPU build, and the trainer "
                           "rescores on the CPU too (leave --device out, or give cpu)")
    _setup_runtime()
    if args.backend == "vllm":
        from roundalign.probes.probe_real import run_probe_real  # noqa: PLC0415 -- lazy: torch, off the figure verbs

        if is_cpu(cfg.engine):
            # vLLM's CPU build in this process: its model (hooks, GEMM dispatch) is then readable; a 1 GiB KV
            # cache is plenty for probe-sized requests and changes no numerics
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            from roundalign.bridge import vllm_cpu  # noqa: PLC0415 -- lazy: torch, off the figure verbs

            vllm_cpu.small_kv_cache()
            if args.vllm_cpu_gemm == "live":
                vllm_cpu.install_live_gemm_dispatch()

        run_probe_real(cfg, args.out, device=args.device or ("cpu" if is_cpu(cfg.engine) else "cuda"),
                       gpu_memory_utilization=args.gpu_memory_utilization)
    else:
        run_probe(cfg, args.out)


def run_attribute_cli(args) -> None:
    from roundalign.probes.attribute import AttributeConfig, run_attribute  # noqa: PLC0415 -- lazy: torch

    cfg = from_args(AttributeConfig, args)
    _setup_runtime()
    if cfg.backend == "vllm" and is_cpu(cfg.engine):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine's model readable in this process
    rows = run_attribute(cfg, args.out)
    from roundalign.analysis.plots.fig_attribution import draw_waterfall  # noqa: PLC0415 -- lazy: pandas, matplotlib

    model = Path(cfg.model.rstrip("/"))
    name = model.parent.name if model.name == "policy" and model.parent.name else model.name  # a sweep's policy dir
    path = draw_waterfall(rows, Path(args.out) / "waterfall.png", title=f"{name}: {cfg.engine} ({cfg.backend})")
    print(f"[attribute] wrote {path}")


def run_check_engine_cli(args) -> int:
    from roundalign.probes.check_engine import CheckEngineConfig, run_check_engine  # noqa: PLC0415 -- lazy: torch

    cfg = CheckEngineConfig(**({"engines": args.engine} if args.engine is not None else {}), model=args.model,
                            arch=args.arch, num_prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                            context_tokens=args.context_tokens, seed=args.seed)
    _setup_runtime()
    # the engine in this process: its model (hooks, GEMM dispatch) and its Inductor code are then readable
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return 0 if run_check_engine(cfg, args.out)["holds"] else 1


def run_train_cli(args) -> int:
    from roundalign.training.train import run_train  # noqa: PLC0415 -- lazy: torch, off the figure verbs

    flags = {k: getattr(args, k) for k in TRAIN_FLAGS if getattr(args, k) is not None}
    cfg = build_config(file=args.config, overrides={**flags, **parse_set(args.overrides)})
    _setup_runtime()
    from roundalign.training.distributed import rank_log  # noqa: PLC0415 -- lazy: torch, off the figure verbs

    result = run_train(cfg, args.out, log=rank_log())  # under accelerate launch: lines say which rank printed them
    if args.export and result.status in ("done", "collapsed"):
        from roundalign.training.train import export_run  # noqa: PLC0415 -- lazy: torch, off the figure verbs

        export_run(result.out_dir, args.export)
    return result.exit_code


def run_pretrain_tiny(args) -> None:
    from roundalign.models.pretrain import pretrain_tiny  # noqa: PLC0415 -- lazy: torch, off the figure verbs

    _setup_runtime()
    pretrain_tiny(args.model, args.out, steps=args.steps, learning_rate=args.lr, batch_size=args.batch_size,
                  max_operand=args.max_operand, seed=args.seed, task=args.task,
                  digits={"op": args.digits_op, "min_len": args.digits_min_len, "max_len": args.digits_max_len,
                          "len_step": args.digits_len_step} if args.task == "digits" else None)


def run_aggregate(args) -> None:
    from roundalign.analysis.aggregate import aggregate  # noqa: PLC0415 -- lazy: pandas, matplotlib

    aggregate(args.results, args.out, strict=args.strict, sweep=args.sweep, metrics=args.metrics)
    if args.stress_dose_key:
        from roundalign.analysis.stress import write_stress_tables  # noqa: PLC0415 -- lazy: pandas, matplotlib

        write_stress_tables(args.results, args.out, args.stress_dose_key, floor=args.stress_floor,
                            gap_metric=args.stress_gap_metric, sweep=args.sweep)
        if args.stress_dose_key == "engine_dose_bits":  # the dose experiment: its outcome per run (analysis/dose.py)
            from roundalign.analysis.dose import write_dose_tables  # noqa: PLC0415 -- lazy: pandas, matplotlib

            write_dose_tables(args.out)


def run_dose_probe(args) -> None:
    from roundalign.analysis.dose import write_dose_probe  # noqa: PLC0415 -- lazy: pandas, matplotlib

    print(f"[dose-probe] wrote {write_dose_probe(args.probes, args.out)}")


def run_plot_stress(args) -> None:
    from roundalign.analysis.plots.stress import make  # noqa: PLC0415 -- lazy: pandas, matplotlib

    make(args.aggregate, args.out, tuple(f for f in args.formats.split(",") if f))


def run_plot_dose(args) -> None:
    from roundalign.analysis.plots.dose import make  # noqa: PLC0415 -- lazy: pandas, matplotlib

    make(args.aggregate, args.out, tuple(f for f in args.formats.split(",") if f))


def run_plot(args) -> None:
    from roundalign.analysis.plots import make_sweeps  # noqa: PLC0415 -- lazy: pandas, matplotlib

    if len(args.aggregate) != len(args.out):
        raise ValueError(f"{len(args.aggregate)} --aggregate directories but {len(args.out)} --out directories: "
                         "give one output directory per aggregate directory")
    make_sweeps(list(zip(args.aggregate, args.out)), formats=args.formats, figures=args.figures, stress=args.stress,
                jobs=args.jobs)


VERBS = {"make-tiny": run_make_tiny, "probe": run_probe_cli, "attribute": run_attribute_cli,
         "check-engine": run_check_engine_cli, "train": run_train_cli,
         "pretrain-tiny": run_pretrain_tiny, "aggregate": run_aggregate, "plot": run_plot,
         "plot-stress": run_plot_stress, "plot-dose": run_plot_dose, "dose-probe": run_dose_probe,
         "fetch-model": run_fetch_model, "prepare-data": run_prepare_data}


# The verbs that need the harness extra (pip install 'roundalign[harness]'), and the packages each one imports; the
# library install runs the others (make-tiny, probe, attribute, check-engine, fetch-model).
HARNESS_VERBS = {
    "train": ("trl", "accelerate", "datasets", "math_verify"), "pretrain-tiny": ("trl", "datasets"),
    "prepare-data": ("datasets",), "aggregate": ("statsmodels", "matplotlib"), "dose-probe": ("statsmodels",),
    "plot": ("matplotlib", "seaborn"), "plot-stress": ("matplotlib", "seaborn"), "plot-dose": ("matplotlib", "seaborn"),
}


def check_harness(verb: str) -> None:
    """Refuse a harness verb in a library-only install, naming what is missing and the extra that brings it."""
    missing = [m for m in HARNESS_VERBS.get(verb, ()) if importlib.util.find_spec(m) is None]
    if missing:
        raise RuntimeError(f"{verb} needs {', '.join(missing)}, from the harness extra: pip install "
                           "'roundalign[harness]' (the library install runs make-tiny, probe, attribute and "
                           "check-engine)")


def claim_free_master_port() -> None:
    """A process started alone (no launcher: WORLD_SIZE and MASTER_PORT unset) takes a free port for the
    torch.distributed group it may start: accelerate's CPU state (accelerate/state.py:253-254) otherwise defaults
    MASTER_PORT to 29500, TRL's colocated vLLM then keeps it (trl/trainer/utils.py ensure_master_addr_port), and two
    runs at once on one machine collided there ("EADDRINUSE"; seen with two training jobs of a sweep, and two
    `roundalign train --backend vllm` side by side). Under accelerate launch / torchrun the launcher's port stands."""
    if os.environ.get("WORLD_SIZE") or os.environ.get("MASTER_PORT"):
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = (make_figure_parser() if argv[:1] and argv[0] in FIGURE_VERBS else make_parser()).parse_args(argv)
    if args.verb in ("train", "pretrain-tiny", "probe", "attribute", "check-engine"):
        claim_free_master_port()
    try:
        check_harness(args.verb)
        code = VERBS[args.verb](args)
    except (ValueError, FileNotFoundError, NotADirectoryError, PermissionError, IsADirectoryError, TypeError,
            RuntimeError) as exc:
        if os.environ.get("ROUNDALIGN_DEBUG"):
            raise
        print(f"roundalign {args.verb}: error: {exc}", file=sys.stderr)
        return 2
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
