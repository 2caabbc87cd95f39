"""Peak memory and time of scoring sampled tokens over a Qwen-sized vocabulary (151,936 x 1,536, bf16 head):
the engine-scored head (scoring=engine, roundalign.numerics.sampler, chunks of rows) and TRL 1.16's fused head (its
online log-sum-exp over vocabulary tiles), forward + backward; and the same formula unchunked, forward only with
autograd's graph held (plain autograd keeps the [N, V] logits for its backward; its bf16 backward took 302 s for
128 tokens on an AVX2 CPU, against 12 s chunked, so it is not timed). Each arm runs in a fresh process (its peak
resident memory is that process's ru_maxrss), all in one run of this script, in turns. The chunked arm's log-probs are checked bitwise against
the unchunked formula's (per-row GEMM bits: bf16 F.linear gives a row the same bits whatever other rows share
the call on the CPUs measured).

    .venv/bin/python -m tools.bench.scoring [--tokens 512] [--rounds 2] [--out results/bench/scoring.txt]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from roundalign.io import atomic_write_text
from roundalign.numerics.sampler import engine_logprobs, engine_logprobs_reference

ROOT = Path(__file__).resolve().parents[2]
VOCAB, HIDDEN = 151_936, 1_536
ARMS = ("engine_chunked", "trl_fused", "engine_unchunked")


def _arm(name: str, tokens: int) -> dict:
    torch.manual_seed(0)
    # made in bf16 directly: an fp32 temporary of the head (890 MiB) would set the process's peak before any arm runs
    hidden = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16).requires_grad_()
    weight = torch.randn(VOCAB, HIDDEN, dtype=torch.bfloat16).mul_(HIDDEN ** -0.5).requires_grad_()
    targets = torch.randint(0, VOCAB, (tokens,))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    if name == "engine_chunked":
        lp, ent = engine_logprobs(hidden, weight, None, targets, 1.0, entropy=True)
    elif name == "engine_unchunked":
        x = torch.nn.functional.linear(hidden, weight).float().div(torch.full((tokens, 1), 1.0)).log_softmax(-1)
        lp, ent = x.gather(-1, targets[:, None]).squeeze(-1), -(x.exp() * x).sum(-1)
        del x  # the graph keeps what its backward needs
    else:
        from trl.kernels import ChunkedLogProbFunction  # noqa: PLC0415 -- lazy: TRL stays out of the other arms' peak RSS

        lp, ent, *_ = ChunkedLogProbFunction.apply(hidden, weight, None, targets, 1.0, 32768, None, 1.0,
                                                   ("log_probs", "entropy"))
    if name != "engine_unchunked":
        (lp.sum() + 0.01 * ent.sum()).backward()
    dt = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {"arm": name, "seconds": dt, "peak_rss_mib": peak / 1024, "above_inputs_mib": (peak - base) / 1024,
           "logp_sum": float(lp.detach().double().sum())}
    if name == "engine_chunked":  # bitwise the unchunked formula, computed here without a gradient
        with torch.no_grad():
            ref = engine_logprobs_reference(hidden.detach(), weight.detach(), None, targets, 1.0)
        out["bitwise_unchunked"] = bool(torch.equal(lp.detach(), ref))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.arm:
        print(json.dumps(_arm(a.arm, a.tokens)))
        return 0
    results: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for r in range(a.rounds):
        order = ARMS[r % len(ARMS):] + ARMS[:r % len(ARMS)]  # rotate which arm runs first
        for arm in order:
            proc = subprocess.run([sys.executable, "-m", "tools.bench.scoring", "--arm", arm, "--tokens",
                                   str(a.tokens)], capture_output=True, text=True, check=True, cwd=ROOT)
            results[arm].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"[bench-scoring] round {r + 1} {arm}: {results[arm][-1]}", file=sys.stderr)

    lines = [f"# scoring {a.tokens} tokens over a {VOCAB:,} x {HIDDEN:,} bf16 head, fresh process per arm, {a.rounds} "
             f"rounds in turns (torch {torch.__version__}, {torch.get_num_threads()} threads, "
             f"{platform.processor() or platform.machine()}; tools/bench/scoring.py). Peak RSS above inputs: the "
             f"process's peak resident memory less what it held once the head and hidden states existed.",
             f"{'arm':18s} {'what':22s} {'median s':>9s} {'peak RSS above inputs, MiB':>27s}  bitwise unchunked"]
    what = {"engine_chunked": "forward + backward", "trl_fused": "forward + backward",
            "engine_unchunked": "forward, graph held"}
    for arm in ARMS:
        xs = results[arm]
        bit = {True: "yes", False: "NO"}.get(xs[0].get("bitwise_unchunked"), "-")
        secs = f"{statistics.median(x['seconds'] for x in xs):9.2f}" if arm != "engine_unchunked" else f"{'-':>9s}"
        lines.append(f"{arm:18s} {what[arm]:22s} {secs} {max(x['above_inputs_mib'] for x in xs):27.0f}  {bit}")
    ratios = [c["seconds"] / t["seconds"] for c, t in zip(results["engine_chunked"], results["trl_fused"])]
    lines.append(f"time engine_chunked / trl_fused per round: {', '.join(f'{r:.2f}' for r in ratios)}")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if a.out:
        atomic_write_text(a.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
