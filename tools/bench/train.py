"""Benchmark of the GRPO runner on CPU: steps per second, full/baseline step time, smoke-run wall time.

    python -m tools.bench.train --out results/bench/train.txt        # ~3 min on 2 CPU cores

1. Warm-starts a tiny Qwen2 model (hidden 64, 2 layers; `pretrain-tiny`, 400 steps) and a small one
   (hidden 256, 4 layers, no warm start).
2. For each, runs GRPO with `baseline` and `full` alternately (rounds x steps each, emulated engine,
   8 prompts x 4 completions per step, up to 6 tokens) and reports the median per-step time
   (`step_time_s` of metrics.jsonl, which includes the extra no-grad forward of the mismatch metrics),
   steps per second and the full/baseline ratio. Goal: ratio <= 1.05.
3. Times a 4-step smoke run through the command line, start-up included (goal: well under a minute).

    .venv-vllm/bin/python -m tools.bench.train --backend vllm --out results/bench/train_vllm_cpu.txt   # ~45 min

With ``--backend vllm`` (in the vLLM-CPU environment, ``make vllm-env``) the rollouts come from the real engine: TRL's
colocated vLLM-CPU 0.31.0 in its default compiled mode, target ``vllm-cpu-compiled``, compiled region kernels, each run
building its own engine. Two models (``VLLM_MODELS``): a warm-started tiny one (hidden 128, head_dim 32, <= 6 tokens,
where fixed costs dominate) and a small one (hidden 512, 4 layers, 64-token completions). Four arms
(``VLLM_ARMS``): ``baseline`` + SDPA (the reference), ``full`` + SDPA, ``full`` + the engine's own attention kernel
with ``scoring: engine`` (the arm that is on-policy token for token), and ``baseline`` + SDPA with DDP's
``find_unused_parameters=True`` (transformers' default for one process; the runner turns the search off). Each round
runs every arm once, the order rotated by one arm per round; each ratio comes with a bootstrap interval and its
per-round values, each arm with the fraction of tokens whose trainer log-prob is bitwise the engine's. Then one
more run per arm under torch.profiler breaks a step down (generation, weight sync, attention forward and backward,
fp32 regions, scoring, optimizer). Goal (issue "Exactly on-policy against the stock engine"): full + engine attention
+ engine scoring <= 1.05x baseline + SDPA on both models.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import redirect_stdout
from pathlib import Path

import datasets
import torch
from transformers import TrainerCallback
from transformers.utils import logging as hf_logging
from trl.generation.vllm_generation import VLLMGeneration

from roundalign.bridge import vllm_cpu, vllm_cpu_attention
from roundalign.envinfo import environment_info
from roundalign.io import atomic_write_text
from roundalign.models.pretrain import pretrain_tiny
from roundalign.models.tiny import make_tiny
from roundalign.training import train as train_mod
from roundalign.training.config import build_config
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
    p.add_argument("--models", nargs="+", choices=("tiny", "small"), default=None,
                   help="--backend vllm: which of the two models (default both)")
    p.add_argument("--profile-steps", type=int, default=2,
                   help="--backend vllm: steps profiled per arm for the breakdown (0: no breakdown)")
    args = p.parse_args(argv)
    vllm = args.backend == "vllm"
    args.rounds = args.rounds if args.rounds is not None else 3
    args.steps = args.steps if args.steps is not None else (None if vllm else 15)  # vllm: each model's own
    torch.set_num_threads(1)
    if args.backend == "vllm":
        return main_vllm(args)

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


# The arms of ``--backend vllm``: (label, variant, trainer attention, scoring, DDP find_unused_parameters). The first
# is the reference of every ratio; the last is the first with transformers' default for a one-process DDP run.
VLLM_ARMS = (
    ("baseline+sdpa", "baseline", "sdpa", "trl", False),
    ("full+sdpa", "full", "sdpa", "trl", False),
    ("full+vllm_cpu", "full", "vllm_cpu", "engine", False),
    ("baseline+sdpa find_unused", "baseline", "sdpa", "trl", True),
)
# (name, make_tiny kwargs, pretrain-tiny steps (0: random weights), run overrides, steps per run). The small model's
# bf16 steps took ~45 s at 4 prompts x 4 completions on an AVX2 CPU (no bf16 GEMM units): 2 x 2 a step there.
VLLM_MODELS = (
    ("tiny (h128, 2 layers, 8x4 completions of <=6 tokens)", {"hidden": 128, "heads": 4, "layers": 2}, 300,
     {"max_completion_length": 6}, 30),
    ("small (h512, 4 layers, 2x2 completions of 64 tokens)", {"hidden": 512, "heads": 8, "kv_heads": 2, "layers": 4},
     0, {"max_completion_length": 64, "prompts_per_step": 2, "num_generations": 2, "per_device_batch_size": 4}, 4),
)
# What the breakdown counts, by profiler event name; an event inside one already counted is not counted again.
# The autograd Functions show up under their class names (forward) and "<name>Backward" (backward); rp: are the
# ranges this script puts around TRL's vLLM calls.
BREAKDOWN = (
    ("generate (vLLM)", r"^rp:generate$"),
    ("weight sync", r"^rp:sync_weights$"),
    ("attention fwd: engine kernel", r"^VllmCpuAttentionFunction$"),
    ("attention fwd: SDPA", r"^aten::scaled_dot_product_attention$"),
    ("attention bwd (SDPA's gradient)", r"(VllmCpuAttentionFunctionBackward|ScaledDotProduct\w*Backward)"),
    ("fp32 regions fwd", r"^(_RecomputeInBackward|_RopeFused)$"),
    ("fp32 regions bwd", r"(_RecomputeInBackward|_RopeFused)Backward"),
    ("scoring fwd (LM head + log-softmax)", r"^(EngineLogprobFunction|ChunkedLogProbFunction)$"),
    ("scoring bwd", r"(EngineLogprobFunction|ChunkedLogProbFunction)Backward"),
    ("optimizer step", r"^Optimizer\.step"),
)


@contextlib.contextmanager
def _find_unused(value: bool):
    """GRPOConfig(ddp_find_unused_parameters=value) for the runs inside (the runner sets False)."""
    build = train_mod.build_grpo_args

    def patched(*a, **k):
        args = build(*a, **k)
        args.ddp_find_unused_parameters = value
        return args

    train_mod.build_grpo_args = patched
    try:
        yield
    finally:
        train_mod.build_grpo_args = build


@contextlib.contextmanager
def _ranges():
    """torch.profiler ranges around TRL's vLLM generate and weight sync (what the breakdown names them)."""
    saved = {n: getattr(VLLMGeneration, n) for n in ("generate", "sync_weights")}

    def wrap(name, fn):
        def wrapped(self, *a, **k):
            with torch.profiler.record_function(f"rp:{name}"):
                return fn(self, *a, **k)
        return wrapped

    for n, fn in saved.items():
        setattr(VLLMGeneration, n, wrap(n, fn))
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(VLLMGeneration, n, fn)


def _profile_callback(first: int, last: int):
    """A TrainerCallback that profiles optimizer steps first..last (1-based) on the CPU and keeps the wall time."""
    class Profile(TrainerCallback):
        prof = None
        wall = 0.0
        steps = last - first + 1

        def on_step_begin(self, args, state, control, **kw):
            if state.global_step + 1 == first:
                self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                self.prof.__enter__()
                self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if state.global_step == last and self.prof is not None:
                self.wall = time.perf_counter() - self.t0
                self.prof.__exit__(None, None, None)

    return Profile()


def breakdown(prof) -> dict[str, float]:
    """Seconds per category of ``BREAKDOWN`` (outermost matching events only, each event counted once)."""
    pats = [(name, re.compile(rx)) for name, rx in BREAKDOWN]
    out = {name: 0.0 for name, _ in BREAKDOWN}

    def category(ev):
        return next((name for name, rx in pats if rx.search(ev.name)), None)

    for ev in prof.events():
        cat = category(ev)
        if cat is None:
            continue
        parent, inside = ev.cpu_parent, False
        while parent is not None:
            if category(parent) is not None:
                inside = True
                break
            parent = parent.cpu_parent
        if not inside:
            out[cat] += ev.cpu_time_total / 1e6
    return out


def _bootstrap_ratio(num: list[float], den: list[float], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of median(num)/median(den), resampling each arm's step times."""
    rng = random.Random(seed)
    ratios = sorted(statistics.median(rng.choices(num, k=len(num))) / statistics.median(rng.choices(den, k=len(den)))
                    for _ in range(n))
    return ratios[int(0.025 * n)], ratios[int(0.975 * n) - 1]


def main_vllm(args) -> int:
    """GRPO step time against the real engine, arms of ``VLLM_ARMS`` in rotated order, on the two ``VLLM_MODELS``;
    then one profiled run per arm for the breakdown."""
    if not vllm_cpu_attention.available():
        raise SystemExit("tools.bench.train --backend vllm: vLLM's CPU build is not importable here; run it with "
                         ".venv-vllm/bin/python (make vllm-env)")

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    lines, say = _recorder()
    env = environment_info()
    import vllm  # noqa: PLC0415 -- optional: vllm

    say(f"# roundalign GRPO step time against the real engine ({time.strftime('%Y-%m-%d')}, git {env['git_sha']}, "
        f"torch {env['versions']['torch']}, trl {env['versions']['trl']}, vllm-cpu {vllm.__version__}, "
        f"{os.cpu_count()} CPU cores ({env['cpu_kernels']['torch_capability']}), torch 1 thread)")
    say("Arms (label: variant + trainer attention, scoring): baseline+sdpa = baseline, SDPA, TRL's fused head; "
        "full+sdpa = full, SDPA, TRL's head; full+vllm_cpu = full, the engine's attention kernel (SDPA's "
        "gradient), scoring: engine (the on-policy arm); '... find_unused' = the same run with DDP's "
        "find_unused_parameters=True (transformers' default for a one-process DDP run, which the runner turns "
        "off). Region kernels compiled, colocated vLLM-CPU in compiled mode (target vllm-cpu-compiled), "
        "batch as each model's heading says, each run builds its own engine, the first step of each run dropped. "
        "Each round runs every arm once, the order rotated by one arm per round.")
    models = VLLM_MODELS if args.models is None else [m for m in VLLM_MODELS if m[0].split()[0] in args.models]
    with tempfile.TemporaryDirectory() as tmp, _ranges():
        root = Path(tmp)
        for mi, (name, shape, warm, run, steps) in enumerate(models):
            steps = args.steps or steps
            model = make_tiny("qwen2", root / f"m{mi}", **shape)
            if warm:
                model = pretrain_tiny(model, root / f"m{mi}-sft", steps=warm, log=lambda *_: None)
            say(f"\n## {name}: {args.rounds} rounds x {steps} steps"
                + (f", warm start: {warm} pretrain-tiny steps" if warm else ", random weights"))
            times = {a[0]: [] for a in VLLM_ARMS}
            per_round = {a[0]: [] for a in VLLM_ARMS}
            exact = {a[0]: [] for a in VLLM_ARMS}
            n = len(VLLM_ARMS)
            for r in range(args.rounds):
                for label, variant, attn, scoring, unused in VLLM_ARMS[r % n:] + VLLM_ARMS[:r % n]:
                    t0 = time.perf_counter()
                    tag = f"m{mi}r{r}{'u' if unused else ''}"
                    with _find_unused(unused):
                        ts = step_times(str(model), variant, steps, root, tag, "compiled", backend="vllm",
                                        engine="vllm-cpu-compiled", attn=attn, scoring=scoring, **run)
                    times[label] += ts
                    per_round[label].append(statistics.median(ts))
                    out = root / f"{tag}-{variant}-compiled-{attn}"
                    exact[label] += [json.loads(x)["mismatch/token/tokens_exact_frac"]
                                     for x in (out / "metrics.jsonl").read_text().splitlines()]
                    vllm_cpu.uninstall_live_gemm_dispatch()
                    print(f"  {name.split()[0]} round {r + 1}/{args.rounds} {label}: {time.perf_counter() - t0:.0f} s"
                          " with the engine's start", flush=True)
            ref = VLLM_ARMS[0][0]
            base = statistics.median(times[ref])
            say(f"{'arm':27} {'median step s':>13} {'ratio':>6} {'95% bootstrap':>15} {'per-round ratios':>24} "
                f"{'exact tokens (min / median over steps)':>40}")
            for label, ts in times.items():
                med = statistics.median(ts)
                lo, hi = _bootstrap_ratio(ts, times[ref])
                rounds = " ".join(f"{a / b:.3f}" for a, b in zip(per_round[label], per_round[ref]))
                say(f"{label:27} {med:13.4f} {med / base:6.3f} {f'{lo:.3f}-{hi:.3f}':>15} {rounds:>24} "
                    f"{f'{min(exact[label]):.4f} / {statistics.median(exact[label]):.4f}':>40}")
            if args.profile_steps:
                first, last = 2, 1 + args.profile_steps
                say(f"\nbreakdown ({name.split()[0]}): ms per step under torch.profiler, steps {first}-{last} of one "
                    "more run per arm (the profiler's overhead included; 'other' = the profiled wall time not in "
                    "a row above: the model's GEMMs, norms, activations, TRL's own work, DDP)")
                rows, walls = {}, {}
                for label, variant, attn, scoring, unused in VLLM_ARMS:
                    cb = _profile_callback(first, last)
                    cfg = build_config(overrides={"model": str(model), "variant": variant, "steps": last,
                                                  "kernels": "compiled", **RUN, "backend": "vllm",
                                                  "engine": "vllm-cpu-compiled", "attn": attn, "scoring": scoring,
                                                  **run})
                    with _find_unused(unused):
                        run_train(cfg, root / f"m{mi}-prof-{label.replace(' ', '_').replace('+', '_')}",
                                  callbacks=[cb], log=lambda *_: None)
                    vllm_cpu.uninstall_live_gemm_dispatch()
                    steps_n = last - first + 1
                    rows[label] = {k: 1e3 * v / steps_n for k, v in breakdown(cb.prof).items()}
                    walls[label] = 1e3 * cb.wall / steps_n
                labels = [a[0] for a in VLLM_ARMS]
                say(f"{'ms / step':36}" + "".join(f"{lab[:26]:>27}" for lab in labels))
                for cat, _ in BREAKDOWN:
                    say(f"{cat:36}" + "".join(f"{rows[lab][cat]:27.1f}" for lab in labels))
                say(f"{'other':36}" + "".join(f"{walls[lab] - sum(rows[lab].values()):27.1f}" for lab in labels))
                say(f"{'profiled step (wall)':36}" + "".join(f"{walls[lab]:27.1f}" for lab in labels))
        say("\n(ratio: median step time over baseline+sdpa's; 95% bootstrap: percentile interval of that ratio, "
            "resampling each arm's steps; per-round ratios: each round's median over baseline+sdpa's in the same "
            "round. exact tokens: mismatch/token/tokens_exact_frac, the fraction of sampled tokens whose trainer "
            "log-prob is bitwise the engine's, per step.)")
    atomic_write_text(args.out, "\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
