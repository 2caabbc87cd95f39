"""Benchmark: cost of alignment and what it buys, measured as ratios within one run.

    python -m tools.bench.numerics --out results/bench/numerics.txt        # ~5 min on 2 CPU cores
    make bench                                                                 # the same

Part 1: forward+backward time of each variant over ``baseline`` on a Qwen-shaped bf16 model with
hidden size 512 (intermediate 2816 = 5.5x, as Qwen2.5; 4 layers; batch 2 x 512 tokens), both
architectures, with the regions as separate torch ops (``eager`` kernels, the exact reference) and
compiled into one fused kernel per region (``full/compiled``). Variants are interleaved round-robin so machine noise hits all alike; we report the
median over rounds and the spread (min/max of per-round ratios). Goal: full/baseline <= 1.05.

Part 2: the offline probe's baseline/full mismatch ratios (k3 and mean |delta logp|) on tiny models
against both engine modes with equal kernels, then under each extra kernel difference (Inductor's own
RMSNorm reduction, split-K GEMMs with bf16 partials, sdpa), and at far positions (2048 context tokens,
outlier q/k channels).

Timings are wall clock on this machine with one torch thread; they are not asserted by tests.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import time
from contextlib import redirect_stdout
from pathlib import Path

import pandas as pd
import torch
from transformers.utils import logging as hf_logging

from roundalign import apply_alignment
from roundalign.envinfo import environment_info
from roundalign.io import atomic_write_text
from roundalign.models.load import load_model
from roundalign.models.tiny import make_tiny
from roundalign.probes.probe import ProbeConfig, run_probe


def time_variants(arch: str, root: Path, rounds: int, seq: int) -> dict[str, list[float]]:
    path = make_tiny(arch, root / f"bench-{arch}", hidden=512, intermediate=2816, layers=4, heads=8, kv_heads=2,
                     seed=0)
    model = load_model(str(path), dtype="bf16", attn="sdpa")
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (2, seq), generator=torch.Generator().manual_seed(0))

    def step() -> float:
        t = time.perf_counter()
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        return time.perf_counter() - t

    variants = ("baseline", "rope", "swiglu", "norm", "full", "full/compiled")

    def align(v: str) -> None:
        variant, _, kernels = v.partition("/")
        apply_alignment(model, variant, kernels=kernels or "eager")

    times: dict[str, list[float]] = {v: [] for v in variants}
    for v in variants:  # warm-up (and torch.compile's one-time compilation for full/compiled)
        align(v)
        step()
        step()
    for _ in range(rounds):
        for v in variants:
            align(v)
            times[v].append(step())
    return times


def part1(out, root: Path, rounds: int, seq: int) -> None:
    print("## Part 1: forward+backward time over baseline (hidden 512, intermediate 2816, 4 layers, "
          f"batch 2 x {seq} tokens, bf16, sdpa, {rounds} interleaved rounds)", file=out)
    print(f"{'arch':6} {'variant':13} {'median ms':>10} {'ratio':>7} {'ratio min..max over rounds':>28}", file=out)
    for arch in ("qwen2", "qwen3"):
        times = time_variants(arch, root, rounds, seq)
        base = times["baseline"]
        for v, ts in times.items():
            per_round = [t / b for t, b in zip(ts, base)]
            ratio = statistics.median(ts) / statistics.median(base)
            print(f"{arch:6} {v:13} {1000 * statistics.median(ts):10.1f} {ratio:7.3f} "
                  f"{min(per_round):13.3f}..{max(per_round):.3f}", file=out, flush=True)


def part2(out, root: Path) -> None:
    print("\n## Part 2: probe at identical weights, baseline/full ratios (8 prompts x 16 tokens; engine "
          "vllm-compiled = Inductor-compiled pieces, vllm-eager = hand-modelled CUDA ops; split-K: 16-element "
          "chunks, partials stored in bf16; norm red. = who reduces the RMSNorm mean in the compiled engine)",
          file=out)
    # engine, attention, GEMM, norm reduction, context tokens, q/k outlier scale
    settings = [("vllm-compiled", "eager", "same", "opaque", 0, 1.0), ("vllm-eager", "eager", "same", "opaque", 0, 1.0),
                ("vllm-compiled", "eager", "same", "inductor", 0, 1.0),
                ("vllm-compiled", "eager", "splitk", "opaque", 0, 1.0), ("vllm-compiled", "sdpa", "same", "opaque", 0, 1.0),
                ("vllm-compiled", "eager", "splitk", "opaque", 2048, 8.0)]
    print(f"{'model':20} {'engine':13} {'attn':5} {'gemm':6} {'norm red.':9} {'ctx':>5} {'k3 base':>10} "
          f"{'k3 full':>10} {'k3 ratio':>9} {'|d| base':>9} {'|d| full':>9} {'exact full':>10} {'k3 rope/base':>12}",
          file=out)
    for arch in ("qwen2", "qwen3"):
        for engine, attn, gemm, red, ctx, outlier in settings:
            name = f"tiny-{arch}" + (f"-outlier{outlier:g}" if outlier != 1.0 else "")
            mdir = root / name
            if not mdir.exists():
                make_tiny(arch, mdir, hidden=128, layers=4, heads=4, kv_heads=2, seed=0, qk_outlier_scale=outlier)
            cfg = ProbeConfig(model=str(mdir), engine=engine, attn=attn, engine_gemm=gemm, norm_reduction=red,
                              variants=("baseline", "rope", "full"), num_prompts=8, max_new_tokens=16,
                              context_tokens=ctx, splitk_chunk=16)
            with redirect_stdout(io.StringIO()):
                table, _ = run_probe(cfg, root / f"probe-{name}-{engine}-{attn}-{gemm}-{red}-{ctx}.csv",
                                     log=lambda *_: None)
            tok = table[table.level == "token"].pivot(index="variant", columns="metric", values="value")
            k3b, k3f, k3r = (tok.loc[v, "mismatch_k3"] for v in ("baseline", "full", "rope"))
            ratio = f"{k3b / k3f:9.1f}" if k3f > 0 else "  inf(=0)"
            print(f"{name:20} {engine:13} {attn:5} {gemm:6} {red:9} {ctx:5d} {k3b:10.3e} {k3f:10.3e} {ratio} "
                  f"{tok.loc['baseline', 'logp_abs_diff_mean']:9.2e} {tok.loc['full', 'logp_abs_diff_mean']:9.2e} "
                  f"{tok.loc['full', 'tokens_exact_frac']:10.3f} {k3r / k3b:12.3f}", file=out, flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="results/bench/numerics.txt", help="where to record the output")
    p.add_argument("--rounds", type=int, default=12, help="interleaved timing rounds (default 12)")
    p.add_argument("--seq", type=int, default=512, help="tokens per sequence in part 1 (default 512)")
    p.add_argument("--skip-timing", action="store_true", help="only part 2")
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    hf_logging.disable_progress_bar()
    buf = io.StringIO()

    class Tee:
        def write(self, s):
            sys.stdout.write(s)
            buf.write(s)

        def flush(self):
            sys.stdout.flush()

    out = Tee()
    env = environment_info()
    print(f"# roundalign numerics benchmark ({time.strftime('%Y-%m-%d')}, git {env['git_sha']}, "
          f"torch {env['versions']['torch']}, {env['cpu']}, {torch.get_num_threads()} thread)", file=out)
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_timing:
            part1(out, Path(tmp), args.rounds, args.seq)
        part2(out, Path(tmp))
    atomic_write_text(args.out, buf.getvalue())
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    pd.set_option("display.width", 200)
    sys.exit(main())
