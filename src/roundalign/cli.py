"""Command line: ``roundalign <verb> ...`` (or ``python -m roundalign <verb> ...``).

Examples::

    # a tiny Qwen3-style model with a locally built tokenizer
    roundalign make-tiny --arch qwen3 --out work/models/tiny-qwen3 --hidden 64 --layers 2

    # offline mismatch probe at identical weights, every alignment variant
    roundalign probe --model work/models/tiny-qwen3 --engine vllm-compiled --attn eager \\
        --engine-gemm same --variants baseline,rope,swiglu,norm,full --prompts 8 \\
        --max-new-tokens 16 --seed 0 --out results/probe/tiny-qwen3.csv

This module only parses arguments and calls ``run_<verb>``; every argument is validated (with the valid
choices named) before a model is loaded.
"""

from __future__ import annotations

import argparse
import os
import sys


def _setup_runtime() -> None:
    # On small CPU machines torch with >1 thread made step times swing by 10x; default to 1 unless asked.
    import torch
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(int(os.environ.get("ROUNDALIGN_THREADS", "1")))
    hf_logging.disable_progress_bar()  # per-file "Loading weights" bars drown our own progress lines


def _csv_list(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def make_parser() -> argparse.ArgumentParser:
    from .engine import ATTN_IMPLS, ENGINE_GEMMS
    from .numerics import ENGINES, VARIANTS
    from .tiny import ARCHS

    p = argparse.ArgumentParser(prog="roundalign", description=__doc__.split("\n\n")[0],
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
    pr.add_argument("--model", required=True, help="model directory (or a cached hub id)")
    pr.add_argument("--engine", default="vllm-compiled", help=f"engine rounding: {', '.join(ENGINES)}")
    pr.add_argument("--attn", default="eager", help=f"attention on both sides: {', '.join(ATTN_IMPLS)}")
    pr.add_argument("--engine-gemm", default="same", help=f"engine GEMMs: {', '.join(ENGINE_GEMMS)}")
    pr.add_argument("--splitk-chunk", type=int, default=64, help="K-chunk of the splitk GEMM, elements (default 64)")
    pr.add_argument("--variants", type=_csv_list, default=VARIANTS,
                    help=f"comma-separated trainer variants (default all: {','.join(VARIANTS)})")
    pr.add_argument("--prompts", type=int, default=8, help="number of prompts (default 8)")
    pr.add_argument("--max-new-tokens", type=int, default=16, help="completion cap, tokens (default 16)")
    pr.add_argument("--context-tokens", type=int, default=0,
                    help="random filler tokens before each prompt, to probe at far positions (default 0)")
    pr.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    pr.add_argument("--dtype", default="bf16", help="model dtype: bf16, fp16, fp32 (default bf16)")
    pr.add_argument("--seed", type=int, default=0, help="prompt and sampling seed (default 0)")
    pr.add_argument("--out", required=True, help="output CSV; <stem>_layers.csv and <stem>.json go beside it")
    return p


def run_make_tiny(args) -> None:
    from .tiny import make_tiny

    out = make_tiny(args.arch, args.out, hidden=args.hidden, layers=args.layers, heads=args.heads,
                    kv_heads=args.kv_heads, intermediate=args.intermediate, vocab=args.vocab, tie=args.tie,
                    seed=args.seed, qk_outlier_scale=args.qk_outlier_scale)
    print(f"[make-tiny] wrote {out}")


def run_probe_cli(args) -> None:
    from .io import check_writable
    from .models import resolve_model_path
    from .probe import ProbeConfig, run_probe

    cfg = ProbeConfig(model=args.model, engine=args.engine, attn=args.attn, engine_gemm=args.engine_gemm,
                      variants=args.variants, num_prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                      seed=args.seed, temperature=args.temperature, context_tokens=args.context_tokens,
                      splitk_chunk=args.splitk_chunk, dtype=args.dtype)
    resolve_model_path(cfg.model)  # fails fast on a missing model
    check_writable(args.out)
    _setup_runtime()
    run_probe(cfg, args.out)


VERBS = {"make-tiny": run_make_tiny, "probe": run_probe_cli}


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        VERBS[args.verb](args)
    except (ValueError, FileNotFoundError, NotADirectoryError, PermissionError, IsADirectoryError, TypeError,
            RuntimeError) as exc:
        if os.environ.get("ROUNDALIGN_DEBUG"):
            raise
        print(f"roundalign {args.verb}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
