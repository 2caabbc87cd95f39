"""Record: how many sampled tokens `full` gets bitwise from the emulated engine's KV-cache decode, per case of
``tests/test_engine.py::test_full_is_on_policy_with_equal_kernels``.

    python -m tools.studies.kv_decode_table --out results/bench/kv_decode.txt     # ~2 min on 2 cores

The test asserts a floor per case (1.0 where the case is bitwise on every CPU measured so far) and prints nothing;
this script runs the same cases with the test's own helpers (same models, prompts, seeds) and writes the counts
with the CPU they were measured on, since the exceptions are decode-vs-prefill kernel-shape effects of the CPU:
which cases fall short, and by how much, changes with the CPU's ISA.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from conftest import random_qwen  # noqa: E402
from test_engine import prompts, trainer_logprobs  # noqa: E402

from roundalign import ENGINES, apply_alignment  # noqa: E402
from roundalign.engine import Engine  # noqa: E402
from roundalign.envinfo import environment_info  # noqa: E402
from roundalign.io import atomic_write_text  # noqa: E402


def cases():
    """The test's parametrization: every engine untied, tied only for the GPU targets, both architectures."""
    for arch in ("qwen2", "qwen3"):
        for engine in ENGINES:
            for tie in (False, True):
                if tie and engine.startswith("vllm-cpu-"):
                    continue
                yield arch, engine, tie


def measure(arch: str, engine: str, tie: bool) -> tuple[int, int, int]:
    """(tokens, tokens `full` gets bitwise, tokens `baseline` gets bitwise), as the test computes them."""
    model = random_qwen(arch, tie=tie)
    eng = Engine(model, engine=engine, attn="eager", gemm="same")
    samples = eng.generate(prompts(lengths=[7, 7, 12, 12, 3]), max_new_tokens=12, seed=3)
    n = sum(len(s.completion_ids) for s in samples)
    apply_alignment(model, "baseline")
    base = sum(int((trainer_logprobs(model, s) == s.logprobs).sum()) for s in samples)
    apply_alignment(model, "full", engine)
    full = sum(int((trainer_logprobs(model, s) == s.logprobs).sum()) for s in samples)
    return n, full, base


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="results/bench/kv_decode.txt", help="where to record the output")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    env = environment_info()
    k = env["cpu_kernels"]
    lines = [f"# full against the emulated engine's KV-cache decode, equal kernels ({time.strftime('%Y-%m-%d')}, "
             f"git {env['git_sha']}, torch {env['versions']['torch']}, 1 torch thread)",
             f"CPU: {k['model']}, ATen {k['torch_capability']}, ISA {' '.join(k['isa'])}",
             "cases and helpers of tests/test_engine.py::test_full_is_on_policy_with_equal_kernels: 5 prompts "
             "(lengths 7, 7, 12, 12, 3) x 12 sampled tokens, seed 3; a token counts when the trainer's logprob "
             "equals the engine's bitwise",
             f"{'arch':6} {'engine':18} {'tied':5} {'tokens':>6} {'full exact':>10} {'baseline exact':>14}"]
    bitwise = 0
    for arch, engine, tie in cases():
        n, full, base = measure(arch, engine, tie)
        bitwise += full == n
        lines.append(f"{arch:6} {engine:18} {'yes' if tie else 'no':5} {n:6d} {full:10d} {base:14d}")
        print(lines[-1], flush=True)
    lines.append(f"full bitwise on every token in {bitwise} of {len(list(cases()))} cases")
    atomic_write_text(args.out, "\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
