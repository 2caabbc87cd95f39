"""The trainer against the REAL engine, vLLM 0.31.0's CPU build, at identical weights (run in .venv-vllm).

    .venv-vllm/bin/python -m tools.bench.vllm_cpu --out results/bench/vllm_cpu.txt

For each architecture (random Qwen2 with q/k/v biases, Qwen3 with q/k norms; 4 layers, hidden 128, head_dim 32,
lognormal norm weights) and each engine mode (``vllm-cpu-compiled``, the default, and ``vllm-cpu-eager``):

- teacher-forced: the engine's ``prompt_logprobs`` of 8 random sequences of 16-256 tokens (one prefill per
  request, one request per call) against the trainer's one-forward logprobs of the same tokens;
- sampled: 8 prompts x 24 tokens sampled by the engine (T = 1, vLLM's processed logprobs, decoded through its
  KV cache) against the trainer's rescoring of the same tokens, as GRPO sees them.

The trainer runs every variant with either vLLM's CPU attention kernel (``vllm_cpu``: equal attention, so what
is left is where rounding happens) or its stock attention (``sdpa``). k3 = mean(rho - 1 - delta), delta =
logp_train - logp_engine, in nats per token. Also written: ``<out stem>.csv`` (tidy: arch, engine, side, attn,
variant, metric, value) and the engine record (kernel build, GEMM dispatch, attention ISA, and for the compiled
engine its norms' reduction orders, which ``norm`` and ``full`` take: ``apply_alignment(norm_sum_orders=...)``).
The engines run the GEMM dispatch that training runs (``vllm_cpu.install_live_gemm_dispatch``).
"""

import argparse
import gc
import json
import os
import tempfile
import time
from pathlib import Path

import pandas as pd

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402

from roundalign import apply_alignment
from roundalign.bridge import vllm_cpu, vllm_cpu_attention, vllm_guard
from roundalign.io import atomic_write_csv, atomic_write_json, atomic_write_text
from roundalign.models.tiny import random_qwen
from roundalign.numerics.plan import cpu_kernel_build

torch.set_num_threads(1)

VARIANTS = ("baseline", "rope", "swiglu", "norm", "full")
ARCHS = {"qwen2": 10, "qwen3": 11}  # arch: seed
MODES = ("compiled", "eager")
VOCAB = 256


def engine_logps(d, mode, seqs, prompts, max_new):
    from vllm import LLM, SamplingParams  # noqa: PLC0415 -- optional: vllm

    # the GEMM dispatch training runs (TRL's weight sync needs it; on AMX CPUs the stock one is SGL's AMX kernel)
    vllm_cpu.install_live_gemm_dispatch()
    try:
        llm = LLM(model=d, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=mode == "eager", seed=0,
                  max_model_len=512, max_num_seqs=8, logprobs_mode="processed_logprobs")
    finally:
        vllm_cpu.uninstall_live_gemm_dispatch()
    tf = []
    for s in seqs:
        out = llm.generate([{"prompt_token_ids": s}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                           use_tqdm=False)[0]
        tf.append(torch.tensor([out.prompt_logprobs[i][s[i]].logprob for i in range(1, len(s))]))
    params = [SamplingParams(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=1000 + i, max_tokens=max_new,
                             logprobs=0, ignore_eos=True) for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    sampled = []
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        toks = list(c.token_ids)
        sampled.append((p, toks, torch.tensor([c.logprobs[i][t].logprob for i, t in enumerate(toks)])))
    record = {**vllm_guard.engine_settings(llm), "kernels": vllm_cpu.engine_kernels(llm)}
    if mode == "compiled":  # how its fused norms sum x^2, read from its own Inductor code (apply_alignment)
        record["norm_sum_orders"] = vllm_cpu.engine_norm_sum_orders(llm)
    del llm
    gc.collect()
    return tf, sampled, record


def trainer_logps(model, ids, start):
    with torch.no_grad():
        lg = model(input_ids=torch.tensor([ids])).logits[0, start - 1:-1].float()
    return torch.log_softmax(lg, -1).gather(-1, torch.tensor(ids[start:]).unsqueeze(-1)).squeeze(-1)


def stats(train, eng):
    d = torch.cat(train).double() - torch.cat(eng).double()
    return {"k3": float((torch.exp(d) - 1 - d).mean()), "abs_mean": float(d.abs().mean()),
            "exact": float((d == 0).double().mean()), "tokens": d.numel()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    args = ap.parse_args()

    vllm_cpu_attention.register()  # the vllm_cpu attention function

    t0 = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (16, 33, 57, 77, 100, 130, 190, 256)]
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 9, 12, 16, 20, 24, 30, 40)]
    rows, records = [], {}
    root = tempfile.mkdtemp(prefix="bench-vllm-cpu-")
    for arch, seed in ARCHS.items():
        d = f"{root}/{arch}"
        model = random_qwen(arch, hidden=128, layers=4, heads=4, kv_heads=2, vocab=VOCAB, seed=seed)
        model.save_pretrained(d)
        for mode in MODES:
            engine = f"vllm-cpu-{mode}"
            tf, sampled, rec = engine_logps(d, mode, seqs, prompts, args.max_new_tokens)
            records[f"{arch}/{engine}"] = rec
            for attn in ("vllm_cpu", "sdpa"):
                model.set_attn_implementation(attn)
                for variant in VARIANTS:
                    orders = rec.get("norm_sum_orders") if variant in ("norm", "full") else None
                    apply_alignment(model, variant, engine, norm_sum_orders=orders)
                    sides = {"teacher-forced": stats([trainer_logps(model, s, 1) for s in seqs], tf),
                             "sampled": stats([trainer_logps(model, p + t, len(p)) for p, t, _ in sampled],
                                              [lp for _, _, lp in sampled])}
                    for side, st in sides.items():
                        for metric, value in st.items():
                            rows.append({"arch": arch, "engine": engine, "side": side, "attn": attn,
                                         "variant": variant, "metric": metric, "value": value})
            print(f"[bench] {arch} {engine} done ({time.perf_counter() - t0:.0f}s)", flush=True)
    table = pd.DataFrame(rows)
    out = Path(args.out)
    atomic_write_csv(table, out.with_suffix(".csv"))

    def val(arch, engine, side, attn, variant, metric):
        q = table.query("arch == @arch and engine == @engine and side == @side and attn == @attn "
                        "and variant == @variant and metric == @metric")
        return float(q["value"].iloc[0])

    lines = [f"# {__doc__.splitlines()[0]}", f"# kernel build {cpu_kernel_build()}; "
             f"tools/bench/vllm_cpu.py in {time.perf_counter() - t0:.0f} s", ""]
    for side in ("teacher-forced", "sampled"):
        lines.append(f"## {side}: k3 per variant (exact-token fraction of full), baseline/full k3 ratio, "
                     "k3 rope/baseline")
        lines.append(f"{'arch':6} {'engine':18} {'attn':8} " + " ".join(f"{v:>9}" for v in VARIANTS)
                     + f" {'full exact':>10} {'base/full':>9} {'rope/base':>9}")
        for arch in ARCHS:
            for mode in MODES:
                engine = f"vllm-cpu-{mode}"
                for attn in ("vllm_cpu", "sdpa"):
                    k3 = {v: val(arch, engine, side, attn, v, "k3") for v in VARIANTS}
                    ratio = k3["baseline"] / k3["full"] if k3["full"] > 0 else float("inf")
                    lines.append(f"{arch:6} {engine:18} {attn:8} " + " ".join(f"{k3[v]:9.2e}" for v in VARIANTS)
                                 + f" {val(arch, engine, side, attn, 'full', 'exact'):10.3f} {ratio:9.2f}"
                                 + f" {k3['rope'] / k3['baseline']:9.2f}")
        lines.append("")
    lines.append("## engine record (guard + kernels)")
    for k, r in records.items():
        lines.append(f"{k}: mode={r['compilation_mode']} backend={r['compile_backend']} build={r.get('cpu_kernel_build')} "
                     f"gemm={r['kernels']['gemm']} attention={r['kernels']['attention_backend']} "
                     f"kv_block={r['kernels']['kv_block_size']}"
                     + (f" norm_sum_orders={sorted(set(map(tuple, r['norm_sum_orders'])))}" if r.get("norm_sum_orders")
                        else ""))
    text = "\n".join(lines) + "\n"
    atomic_write_text(out, text)
    atomic_write_json(out.with_suffix(".json"), json.loads(json.dumps(records, default=str)))
    print(text)


if __name__ == "__main__":
    main()
