"""Benchmark: activation memory of ``full`` over ``baseline``, as ratios measured in one run.

    python -m tools.bench.memory --out results/bench/memory.txt      # ~1 min on 2 CPU cores
    make bench                                                           # the same, with the other benchmarks

One training step (forward + ``loss.backward()``) of a tiny bf16 Qwen2 and Qwen3 (4 layers, hidden 256,
intermediate 1408 = 5.5x hidden as Qwen2.5, 4 heads / 2 KV heads, vocab 512, batch 2 x 256 tokens), with and
without ``gradient_checkpointing_enable()`` (HF default: non-reentrant), for ``baseline``, ``full`` with eager
region kernels and ``full`` with compiled ones. Measured by ``roundalign.verify.activation_memory.step_memory``:

- saved: bytes autograd keeps for backward at the end of the forward (unique storages, parameters excluded).
  Without checkpointing this is also the peak of live saved bytes during the forward (saved tensors only
  accumulate there); with it, only what crosses layers is saved.
- peak: the largest total of live tensors created during forward + backward (activations, temporaries,
  recomputation, parameter gradients). Tracked with a Python dispatch mode, under which torch.compile'd code
  does not run compiled, so it is not reported (n/a) for compiled kernels.

The vocabulary is small on purpose: with Qwen's 152k-entry vocabulary the logits and the loss would dominate
both variants and hide the decoder layers' share. Bytes are deterministic (no timing). Goal: full/baseline
<= 1.10 on saved bytes (tests/test_activation_memory.py asserts it on a smaller config).
"""

from __future__ import annotations

import argparse
import io
import sys
from contextlib import redirect_stdout
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from roundalign import apply_alignment
from roundalign.envinfo import environment_info
from roundalign.io import atomic_write_text
from roundalign.verify.activation_memory import step_memory

VARIANTS = ("baseline", "full/eager", "full/compiled")


def tiny_model(arch: str) -> torch.nn.Module:
    cfg_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[arch]
    cfg = cfg_cls(hidden_size=256, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, vocab_size=512, max_position_embeddings=4096,
                  attn_implementation="eager")
    torch.manual_seed(0)
    return model_cls(cfg).to(torch.bfloat16).train()


def measure(arch: str, use_checkpointing: bool, bsz: int, seq: int) -> dict[str, object]:
    model = tiny_model(arch)
    if use_checkpointing:
        model.gradient_checkpointing_enable()
    ids = torch.randint(0, model.config.vocab_size, (bsz, seq), generator=torch.Generator().manual_seed(0))
    out = {}
    for v in VARIANTS:
        variant, _, kernels = v.partition("/")
        apply_alignment(model, variant, kernels=kernels or "eager")
        out[v] = step_memory(model, ids, track_peak=kernels != "compiled")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="text report to write")
    parser.add_argument("--bsz", type=int, default=2, help="sequences per batch")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    buf = io.StringIO()
    with redirect_stdout(buf):
        print(f"# {__doc__.splitlines()[0]}")
        print(f"# batch {args.bsz} x {args.seq} tokens; bytes in MiB (2^20); ratios over baseline")
        for key, value in environment_info().items():
            print(f"# {key}: {value}")
        print(f"{'arch':6} {'checkpointing':13} {'variant':14} {'saved_mib':>10} {'peak_mib':>9} "
              f"{'saved_ratio':>11} {'peak_ratio':>10}")
        for arch in ("qwen2", "qwen3"):
            for use_ckpt in (False, True):
                res = measure(arch, use_ckpt, args.bsz, args.seq)
                base = res["baseline"]
                for v, m in res.items():
                    peak_mib, peak_ratio = ("n/a", "n/a") if m.peak_bytes is None else (
                        f"{m.peak_bytes / 2**20:.3f}", f"{m.peak_bytes / base.peak_bytes:.3f}")
                    print(f"{arch:6} {('on' if use_ckpt else 'off'):13} {v:14} {m.saved_bytes / 2**20:10.3f} "
                          f"{peak_mib:>9} {m.saved_bytes / base.saved_bytes:11.3f} {peak_ratio:>10}", flush=True)
    sys.stdout.write(buf.getvalue())
    atomic_write_text(args.out, buf.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
