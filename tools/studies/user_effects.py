"""Three mismatch effects RL users report, reproduced at CPU scale against real vLLM (its CPU build, 0.31.0):

1. top-p / top-k without renormalisation (TRL #6789: sequence-level IS ratio mean 0.896, 1.001 after
   renormalising). vLLM's processed logprobs are renormalised over the kept tokens; TRL recomputes a log-softmax
   over the whole vocabulary. Measured: the sequence-level IS ratio mean (trainer / engine) with TRL's recompute,
   and with the trainer computing vLLM's processed logprobs (attribute's ``sampling`` source equalized).
2. The trainer's micro-batch size (verl #2996: old_log_prob differs from log_prob on-policy; equal micro-batch
   sizes are the workaround). Measured: the trainer's logprobs of the same sequences in TRL's padded layout, scored
   1 and 8 sequences per forward, one unpadded sequence per forward (attribute's ``batching`` source), and the
   padded layout with positions taken from the attention mask (its ``positions`` source).
3. Temperature applied on one side only (TRL #4159). The engine samples at T = 0.7 and returns logprobs of
   logits / T; the trainer recomputes at T = 0.7, or forgets T (1.0). Measured: k3 and IS ratio of both.

    .venv-vllm/bin/python -m tools.studies.user_effects --model work/models/tiny/cpu-qwen3-untied/policy \\
        --out results/vllm-cpu/user_effects.json

Writes ``--out`` (JSON, atomically) and prints a table; tests/vllm_cpu/test_attribute_real.py runs it.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402

from roundalign.bridge import vllm_cpu
from roundalign.envinfo import environment_info
from roundalign.io import atomic_write_json, check_writable
from roundalign.models.load import load_model, load_tokenizer
from roundalign.probes.attribute import AttributeConfig, trainer_logprobs, trainer_state, vllm_engine_side
from roundalign.probes.attribution_stats import per_sequence, resample_metrics
from roundalign.probes.probe import ProbeConfig, _prompts


def _stats(train, ref) -> dict:
    s = per_sequence(train, ref)
    m = resample_metrics(s, torch.arange(len(train)))
    deltas = torch.cat([t.double() - r.double() for t, r in zip(train, ref)])
    # a trainer that masks top-k/top-p on its own logits can leave out a token the engine kept and sampled (the
    # two sets differ where the logits do): its logprob is then -inf
    excluded = int(sum((~torch.isfinite(t)).sum() for t in train))
    return {**m, "max_abs_dlogp": float(deltas.abs().max()), "num_tokens": int(deltas.numel()),
            "excluded_tokens": excluded}


def _trainer(model, data, state, cfg, pad_id):
    with trainer_state(model, frozenset(state), cfg, data):
        return trainer_logprobs(model, data, frozenset(state), cfg, pad_id)


def measure(model_dir: str, *, prompts: int = 32, max_new_tokens: int = 24, engine: str = "vllm-cpu-eager",
            log=print) -> dict:
    vllm_cpu.small_kv_cache()
    tok = load_tokenizer(model_dir)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids = _prompts(tok, ProbeConfig(model=model_dir, num_prompts=prompts, seed=0))
    base = AttributeConfig(model=model_dir, engine=engine, backend="vllm", num_prompts=prompts,
                           max_new_tokens=max_new_tokens)
    model = load_model(model_dir)
    out = {"model": model_dir, "engine": engine, "prompts": prompts, "max_new_tokens": max_new_tokens,
           "vocab": len(tok)}

    # 1. top-p / top-k: TRL's recompute (nothing equalized) against vLLM's renormalised processed logprobs
    out["top_p_top_k"] = []
    for top_p, top_k in ((0.9, 0), (0.7, 0), (1.0, 20)):
        cfg = replace(base, top_p=top_p, top_k=top_k)
        data = vllm_engine_side(ids, cfg, log=log)
        row = {"top_p": top_p, "top_k": top_k,
               "trl_recompute": _stats(_trainer(model, data, (), cfg, pad_id), data.decode_logp),
               "vllm_processed": _stats(_trainer(model, data, ("sampling",), cfg, pad_id), data.decode_logp)}
        out["top_p_top_k"].append(row)
        log(f"[effects] top_p={top_p} top_k={top_k}: IS ratio mean {row['trl_recompute']['is_ratio_mean']:.4f} "
            f"(TRL's recompute) vs {row['vllm_processed']['is_ratio_mean']:.4f} (vLLM's processed logprobs)")

    # 2. micro-batch size of the trainer's scoring, same sequences, stock numerics (baseline, sdpa)
    data = vllm_engine_side(ids, base, log=log)
    mb1 = _trainer(model, data, (), replace(base, micro_batch=1), pad_id)
    mb8 = _trainer(model, data, (), replace(base, micro_batch=8), pad_id)
    unpadded = _trainer(model, data, ("batching",), base, pad_id)
    fixed = _trainer(model, data, ("positions",), replace(base, micro_batch=8), pad_id)
    out["micro_batch"] = {"mb1_vs_mb8_padded": _stats(mb1, mb8), "padded_vs_unpadded": _stats(mb8, unpadded),
                          "padded_positions_from_mask_vs_unpadded": _stats(fixed, unpadded)}
    log(f"[effects] micro-batch 1 vs 8 (padded): {out['micro_batch']['mb1_vs_mb8_padded']['exact_frac']:.3f} of "
        f"tokens equal, max |dlogp| {out['micro_batch']['mb1_vs_mb8_padded']['max_abs_dlogp']:.2e}; padded vs "
        f"unpadded: {out['micro_batch']['padded_vs_unpadded']['exact_frac']:.3f} equal, max |dlogp| "
        f"{out['micro_batch']['padded_vs_unpadded']['max_abs_dlogp']:.2e}; padded with positions from the mask vs "
        f"unpadded: {out['micro_batch']['padded_positions_from_mask_vs_unpadded']['exact_frac']:.3f} equal")

    # 3. temperature on one side only
    hot = replace(base, temperature=0.7)
    data = vllm_engine_side(ids, hot, log=log)
    both = _trainer(model, data, ("sampling",), hot, pad_id)
    forgot = _trainer(model, data, ("sampling",), replace(hot, temperature=1.0), pad_id)
    out["temperature"] = {"engine_T": 0.7, "both_sides": _stats(both, data.decode_logp),
                          "trainer_T1": _stats(forgot, data.decode_logp)}
    log(f"[effects] T=0.7 on both sides: k3 {out['temperature']['both_sides']['k3']:.2e}; trainer at T=1: k3 "
        f"{out['temperature']['trainer_T1']['k3']:.2e}, IS ratio mean {out['temperature']['trainer_T1']['is_ratio_mean']:.3g}")

    out["environment"] = environment_info()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True, help="JSON file (written atomically)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--engine", default="vllm-cpu-eager")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    check_writable(Path(args.out))
    res = measure(args.model, prompts=args.prompts, max_new_tokens=args.max_new_tokens, engine=args.engine)
    atomic_write_json(Path(args.out), res)
    print(f"[effects] wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
