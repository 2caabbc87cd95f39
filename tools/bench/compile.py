"""Benchmark: a compiled aligned model against a compiled stock model, forward+backward, ratios within one run.

    python -m tools.bench.compile --out results/bench/compile.txt        # compiles dominate: ~15 min on 2 cores

On a CPU without AVX-512 (AVX2 only) some of torch's bf16 GEMM layouts run at ~1 GFLOP/s, and the default shape then spends
~95% of a step in aten::mm (51 s a step, measured): pass a smaller --hidden/--seq there, as make bench does.

The fair comparison for ``torch.compile``: a compiled stock model fuses its own elementwise ops too. Same
Qwen-shaped bf16 model as bench_numerics.py part 1 (hidden 512, intermediate 2816, 4 layers, sdpa, batch
2 x 512 tokens), both architectures. Arms, each its own copy of the model compiled once (``fullgraph=True``,
static shapes) and warmed up, then timed in interleaved rounds so machine noise hits all alike:

- ``stock eager``: transformers as is, for scale;
- ``stock compiled``: ``emulate_precision_casts=True`` (Inductor keeps eager's roundings): the reference (ratio 1);
- ``full/<engine> compiled``: the aligned model compiled the same way (inside a compile each region is its
  formula, so region kernel modes do not apply), for a GPU target and the CPU build's compiled target;
- ``stock compiled, Inductor default``: what ``emulate_precision_casts`` itself costs.

Goal: ``full`` compiled <= 1.0x stock compiled. Timings are wall clock with one torch thread; no test asserts them.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from roundalign import apply_alignment
from roundalign.envinfo import environment_info
from roundalign.io import atomic_write_text
from roundalign.models.load import load_model
from roundalign.models.tiny import make_tiny

EMULATE = {"emulate_precision_casts": True}
# arm -> (variant, engine, compile options or None for eager)
ARMS = {
    "stock eager": ("baseline", "vllm-compiled", None),
    "stock compiled": ("baseline", "vllm-compiled", EMULATE),
    "full/vllm-compiled compiled": ("full", "vllm-compiled", EMULATE),
    "full/vllm-cpu-compiled compiled": ("full", "vllm-cpu-compiled", EMULATE),
    "stock compiled, Inductor default": ("baseline", "vllm-compiled", {}),
}
REFERENCE = "stock compiled"


def time_arms(arch: str, root: Path, rounds: int, seq: int, hidden: int, layers: int) -> dict[str, list[float]]:
    path = make_tiny(arch, root / f"bench-{arch}", hidden=hidden, intermediate=hidden * 11 // 2, layers=layers,
                     heads=hidden // 64, kv_heads=2, seed=0)
    base = load_model(str(path), dtype="bf16", attn="sdpa").train()
    ids = torch.randint(0, base.config.vocab_size, (2, seq), generator=torch.Generator().manual_seed(0))
    runs = {}
    for arm, (variant, engine, options) in ARMS.items():
        model = apply_alignment(copy.deepcopy(base), variant, engine=engine)
        fn = model if options is None else torch.compile(model, fullgraph=True, dynamic=False, options=options)
        runs[arm] = (model, fn)

    def step(arm: str) -> float:
        model, fn = runs[arm]
        t = time.perf_counter()
        model.zero_grad(set_to_none=True)
        fn(input_ids=ids, labels=ids).loss.backward()
        return time.perf_counter() - t

    for arm in ARMS:  # compilation (forward and backward graphs) and warm-up
        t0 = time.perf_counter()
        step(arm)
        step(arm)
        print(f"  {arch} {arm}: compiled and warmed up in {time.perf_counter() - t0:.0f} s", flush=True)
    times: dict[str, list[float]] = {a: [] for a in ARMS}
    for _ in range(rounds):
        for arm in ARMS:
            times[arm].append(step(arm))
    return times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="results/bench/compile.txt", help="where to record the output")
    p.add_argument("--rounds", type=int, default=12, help="interleaved timing rounds (default 12)")
    p.add_argument("--seq", type=int, default=512, help="tokens per sequence (default 512)")
    p.add_argument("--hidden", type=int, default=512, help="hidden size, intermediate 5.5x (default 512)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    hf_logging.disable_progress_bar()
    env = environment_info()
    kernels = env["cpu_kernels"]
    load = os.getloadavg()[1]
    lines = [f"# roundalign torch.compile cost ({time.strftime('%Y-%m-%d')}, git {env['git_sha']}, "
             f"torch {env['versions']['torch']}, 1 torch thread)",
             f"forward+backward, hidden {args.hidden}, intermediate {args.hidden * 11 // 2}, {args.layers} layers, "
             f"batch 2 x {args.seq} tokens, bf16, sdpa, "
             f"fullgraph static-shape compiles, {args.rounds} interleaved rounds; ratio = median / median of "
             f"'{REFERENCE}'",
             # the CPU decides the kernels and so the times: the record names it
             f"CPU: {kernels['model']}, ATen {kernels['torch_capability']}, ISA {' '.join(kernels['isa'])}; "
             f"{os.cpu_count()} CPUs, 5-min load average {load:.1f} at the start",
             f"{'arch':6} {'arm':33} {'median ms':>10} {'ratio':>7} {'ratio min..max over rounds':>28}"]
    print("\n".join(lines), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ("qwen2", "qwen3"):
            times = time_arms(arch, Path(tmp), args.rounds, args.seq, args.hidden, args.layers)
            ref = times[REFERENCE]
            for arm, ts in times.items():
                per_round = [t / r for t, r in zip(ts, ref)]
                line = (f"{arch:6} {arm:33} {1000 * statistics.median(ts):10.1f} "
                        f"{statistics.median(ts) / statistics.median(ref):7.3f} "
                        f"{min(per_round):13.3f}..{max(per_round):.3f}")
                lines.append(line)
                print(line, flush=True)
    atomic_write_text(args.out, "\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
