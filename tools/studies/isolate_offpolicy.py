"""Isolate the off-policy tokens of a GRPO step against the real vLLM-CPU engine (compiled mode, `full`).

Question: `roundalign train --backend vllm --engine vllm-cpu-compiled --attn vllm_cpu --variant full` logs
`mismatch/token/k3` ~1e-13 on most steps (logits bitwise) but far above 1e-10 on some. Which tokens differ, and why?

What it does (each phase a separate process, one at a time, 1 thread; intermediates under --work):
  capture   reruns the sweep run's config for --steps 1 into a fresh --out (the runner reseeds the sampler from
            (seed, step, rank), so step 1 is reproducible) with hooks on RoundalignGRPOTrainer._log_mismatch and
            trl_bridge.step_mismatch_metrics: saves prompts, completions, the engine's sampling logprobs (DECODE,
            batched, KV cache), the trainer's logprobs (one PREFILL over the left-padded batch), TRL's LLM kwargs.
  engine    builds a standalone vLLM-CPU engine with TRL's kwargs (live F.linear GEMM dispatch, as the runner), in
            --mode compiled (stock) or eager (enforce_eager=True), and scores the captured sequences:
              prefill1   teacher-forced prompt_logprobs, one request per generate() call (prompt = prompt+completion)
              prefillB   the same, all requests in one generate() call
              decodeB    teacher-forced DECODE of all requests in one generate() call (the engine's own sampling
                         schedule: a logits processor forces each completion token; raw logprobs)
              decode1    teacher-forced decode, one request per call
              decodeB_nosplit / decode1_nosplit   as above with cpu_attn_get_scheduler_metadata(enable_kv_split=False)
              decodeB_noprefix   decodeB with enable_prefix_caching=False (separate engine)
  trainer   the trainer's forward on the captured batch as TRL scores it (fused LM head), with apply_alignment(full,
            vllm-cpu-compiled) region kernels eager (the run's `kernels: eager`), compiled, or mixed (only the RMSNorm
            regions compiled / only RoPE+SwiGLU compiled); saves logprobs, logits and per-module outputs.
  micro     op-level checks: bf16 F.linear row results vs row count M for the model's (K, N); vLLM-CPU attention
            (attend_one) row t of a Tq=T call vs a Tq=1 call.
  analyze   compares everything, writes the report (--report).

Run from the repository root:
  OMP_NUM_THREADS=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 \
      .venv-vllm/bin/python -m tools.studies.isolate_offpolicy all
(defaults: the sweep's cpu-qwen25-tied/full/seed1 run, step 1). `all` runs capture, engine compiled, engine eager,
trainer, micro and analyze in sequence as child processes (about 5 min on 2 shared cores); --out must not exist
(rm -rf /tmp/isolate_offpolicy first to rerun). Other steps: --steps N --batch N-1.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

# The step isolated: the committed vllm-cpu sweep's cpu-qwen25-tied.vllm_cpu/full/seed1 config at step 1, with the
# region kernels the sweep first ran (`--kernels eager`: TrainConfig's default then, k3 8.6e-8 at step 1; the
# committed run, with compiled kernels, is at the floor there). The policy is the sweep's warm start (run the sweep
# first: snakemake --cores 2 --configfile configs/vllm-cpu.yaml).
ROOT = Path(__file__).resolve().parents[2]
DEF_RUN = ROOT / "results/vllm-cpu/runs/cpu-qwen25-tied.vllm_cpu/full/seed1"
DEF_MODEL = ROOT / "work/models/tiny/cpu-qwen25-tied/policy"
ENV = {"OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
       "ROUNDALIGN_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _env():
    for k, v in ENV.items():
        os.environ[k] = v


def _amx_first():
    # AMX: a bf16 oneDNN GEMM first asks the kernel for AMX tile permission (SGL's kernel does not; SIGILL otherwise)
    import torch  # noqa: PLC0415 -- lazy: after _env() sets OMP_NUM_THREADS
    torch.nn.functional.linear(torch.ones(4, 64, dtype=torch.bfloat16), torch.ones(64, 64, dtype=torch.bfloat16))


# ------------------------------------------------------------------------------------------------ capture
def capture(a):
    _env()
    _amx_first()
    import torch  # noqa: PLC0415 -- lazy: after _env() sets OMP_NUM_THREADS
    from trl.generation import vllm_generation  # noqa: PLC0415 -- lazy: after _env() sets OMP_NUM_THREADS

    import roundalign.training.trl_bridge as TB  # noqa: PLC0415 -- lazy: after _env() sets OMP_NUM_THREADS
    from roundalign.training.config import build_config  # noqa: PLC0415 -- lazy: after _env() sets OMP_NUM_THREADS
    from roundalign.training.train import run_train  # noqa: PLC0415 -- lazy: after _env() sets OMP_NUM_THREADS

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    base = json.loads((Path(a.run) / "run.json").read_text())["config"]
    base = {k: v for k, v in base.items() if v is not None}
    base.update(model=str(a.model), steps=a.steps, kernels=a.kernels)
    cfg = build_config(base=base)
    torch.set_num_threads(1)

    rec = {"batches": []}
    orig_llm = vllm_generation.LLM

    def llm_spy(*args, **kw):
        rec["llm_kwargs"] = {k: (v if isinstance(v, (int, float, str, bool, type(None))) else repr(v))
                             for k, v in kw.items()}
        return orig_llm(*args, **kw)

    vllm_generation.LLM = llm_spy
    orig_log, orig_smm = TB.RoundalignGRPOTrainer._log_mismatch, TB.step_mismatch_metrics

    def smm(train_logp, engine_logp, completion_mask, entropy, mismatch_is=None):
        out = orig_smm(train_logp, engine_logp, completion_mask, entropy, mismatch_is)
        rec["batches"][-1].update(train_logp=train_logp.detach().float().clone(),
                                  engine_logp=engine_logp.detach().float().clone(), metrics=out)
        return out

    def log_mismatch(self, output):
        rec["batches"].append({k: output[k].detach().clone() for k in
                               ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask",
                                "sampling_per_token_logps")})
        rec["batches"][-1]["global_step"] = self.state.global_step
        rec["batches"][-1]["torch_threads"] = torch.get_num_threads()
        return orig_log(self, output)

    TB.RoundalignGRPOTrainer._log_mismatch = log_mismatch
    TB.step_mismatch_metrics = smm
    out = Path(a.out)
    if out.exists():
        raise SystemExit(f"{out} exists: give a fresh --out")
    t0 = time.time()
    res = run_train(cfg, out, log=print)
    rec["status"], rec["wall_s"] = res.status, time.time() - t0
    rec["metrics_jsonl"] = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    torch.save(rec, work / "capture.pt")
    print("captured", len(rec["batches"]), "batches; k3 per step:",
          [m.get("mismatch/token/k3") for m in rec["metrics_jsonl"]])


# ------------------------------------------------------------------------------------------------ engine
def _sequences(b):
    """(prompt tokens, completion tokens) per row, padding removed (TRL left-pads prompts, right-pads completions)."""
    seqs = []
    for i in range(b["prompt_ids"].shape[0]):
        p = b["prompt_ids"][i][b["prompt_mask"][i].bool()].tolist()
        c = b["completion_ids"][i][b["completion_mask"][i].bool()].tolist()
        seqs.append((p, c))
    return seqs


def engine(a):
    _env()
    _amx_first()
    import torch  # noqa: PLC0415 -- lazy: after _env() sets OMP_NUM_THREADS
    import vllm._custom_ops as OPS  # noqa: PLC0415 -- optional: vllm
    from vllm import LLM, SamplingParams  # noqa: PLC0415 -- optional: vllm
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor  # noqa: PLC0415 -- optional: vllm
    from vllm.v1.sample.logits_processor.builtin import process_dict_updates  # noqa: PLC0415 -- optional: vllm

    from roundalign.bridge.vllm_cpu import engine_kernels, install_live_gemm_dispatch  # noqa: PLC0415 -- lazy: after _env() sets OMP_NUM_THREADS

    class ForceTokens(LogitsProcessor):
        """Teacher-forced decode: a request with extra_args {"force": [t0, t1, ...]} samples t_k at its k-th
        output position (every other logit -inf). Logprobs are read raw, before any logits processor."""

        def __init__(self, vllm_config, device, is_pin_memory):
            self.req = {}

        def is_argmax_invariant(self):
            return False

        def update_state(self, batch_update: BatchUpdate | None):
            process_dict_updates(self.req, batch_update,
                                 lambda p, _pt, out: (p.extra_args or {}).get("force") and (p.extra_args["force"], out))

        def apply(self, logits):
            for i, (target, out) in self.req.items():
                k = len(out)
                if k < len(target):
                    t = target[k]
                    row = torch.full_like(logits[i], float("-inf"))
                    row[t] = 0.0
                    logits[i] = row
            return logits

    work = Path(a.work)
    rec = torch.load(work / "capture.pt", weights_only=False)
    b = rec["batches"][a.batch]
    seqs = _sequences(b)
    kw = {k: v for k, v in rec["llm_kwargs"].items() if k in (
        "model", "gpu_memory_utilization", "max_model_len", "max_num_seqs", "enable_sleep_mode", "seed",
        "max_num_batched_tokens", "model_impl", "trust_remote_code", "tensor_parallel_size")}
    kw.update(logprobs_mode="raw_logprobs", logits_processors=[ForceTokens])
    if a.mode == "eager":
        kw["enforce_eager"] = True
    install_live_gemm_dispatch()

    split = {"on": True}
    orig_meta = OPS.cpu_attn_get_scheduler_metadata

    def meta(*args, **k):
        if not split["on"]:
            k["enable_kv_split"] = False
        return orig_meta(*args, **k)

    OPS.cpu_attn_get_scheduler_metadata = meta
    results = {"mode": a.mode, "llm_kwargs": {k: repr(v) for k, v in kw.items()}}

    def build(**extra):
        llm = LLM(**{**kw, **extra})
        torch.set_num_threads(1)  # as the runner does after building the trainer
        return llm

    def decode(llm, rows):
        sp = [SamplingParams(max_tokens=len(c), min_tokens=len(c), temperature=1.0, top_k=0, top_p=1.0,
                             logprobs=0, ignore_eos=True, extra_args={"force": c}) for _, c in rows]
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in rows], sp, use_tqdm=False)
        res = []
        for (p, c), o in zip(rows, outs):
            got = list(o.outputs[0].token_ids)
            assert got == c, ("forcing failed", got, c)
            res.append([lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, c)])
        return res

    def prefill(llm, rows):
        sp = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, top_k=0, top_p=1.0)
        outs = llm.generate([{"prompt_token_ids": p + c} for p, c in rows], sp, use_tqdm=False)
        return [[o.prompt_logprobs[len(p) + j][t].logprob for j, t in enumerate(c)] for (p, c), o in zip(rows, outs)]

    llm = build()
    results["kernels"] = engine_kernels(llm)
    results["torch_threads"] = torch.get_num_threads()
    # the sampling schedule first (the engine's first work after the build, as in the run)
    results["decodeB"] = decode(llm, seqs)
    results["decodeB_again"] = decode(llm, seqs)
    results["decode1"] = [decode(llm, [s])[0] for s in seqs]
    results["prefill1"] = [prefill(llm, [s])[0] for s in seqs]
    results["prefillB"] = prefill(llm, seqs)
    split["on"] = False
    results["decodeB_nosplit"] = decode(llm, seqs)
    results["decode1_nosplit"] = [decode(llm, [s])[0] for s in seqs]
    split["on"] = True
    # decode with batch sizes 2, 4, 8, 16 (consecutive groups), to see whether the batch size alone matters
    for g in (2, 4, 8, 16):
        res = []
        for i in range(0, len(seqs), g):
            res += decode(llm, seqs[i:i + g])
        results[f"decode{g}"] = res
    torch.save(results, work / f"engine_{a.mode}.pt")
    print("engine", a.mode, "done")


# ------------------------------------------------------------------------------------------------ trainer
TRAINER_VARIANTS = ("eager", "compiled", "norms-compiled", "others-compiled")


def trainer(a):
    """The trainer's forward on the captured batch, as TRL scores it (one prefill of the left-padded batch, positions
    from the mask, `vllm_cpu` attention, apply_alignment(full, vllm-cpu-compiled)), with the fp32 region kernels
    eager (the run's `kernels: eager`), compiled (Inductor, the target's default), or mixed: only the two RMSNorm
    regions compiled (norms-compiled) or only RoPE/SwiGLU compiled (others-compiled)."""
    _env()
    _amx_first()
    import torch  # noqa: PLC0415 -- lazy: after _env() sets OMP_NUM_THREADS

    from roundalign.models.load import load_model  # noqa: PLC0415 -- lazy: after _env() sets OMP_NUM_THREADS
    from roundalign.numerics import apply_alignment  # noqa: PLC0415 -- lazy: after _env() sets OMP_NUM_THREADS
    from roundalign.numerics import regions as R  # noqa: PLC0415 -- lazy: after _env() sets OMP_NUM_THREADS

    torch.set_num_threads(1)
    work = Path(a.work)
    rec = torch.load(work / "capture.pt", weights_only=False)
    b = rec["batches"][a.batch]
    ids = torch.cat([b["prompt_ids"], b["completion_ids"]], 1)
    am = torch.cat([b["prompt_mask"], b["completion_mask"]], 1)
    pos = (am.long().cumsum(-1) - 1).clamp(min=0)
    P, C = b["prompt_ids"].shape[1], b["completion_ids"].shape[1]
    norms = ("rmsnorm_fused", "add_rmsnorm_fp32_sum", "add_rmsnorm_bf16_sum")
    E, Cm = R.region_kernels("eager"), R.region_kernels("compiled")
    out = {}
    for v in TRAINER_VARIANTS:
        if v in ("eager", "compiled"):
            R._KERNEL_CACHE["eager"] = E
            ns, mode = (E if v == "eager" else Cm), v
        else:
            pick = (lambda n: n in norms) if v == "norms-compiled" else (lambda n: n not in norms)
            ns = types.SimpleNamespace(mode="eager", **{n: getattr(Cm if pick(n) else E, n) for n in R._FUSED})
            mode = "eager"
        R._KERNEL_CACHE["eager"] = ns if mode == "eager" else E
        model = load_model(a.model, dtype="bf16", attn="vllm_cpu")
        apply_alignment(model, "full", "vllm-cpu-compiled", kernels=mode)
        from trl.trainer.utils import add_fused_lm_head  # noqa: PLC0415 -- lazy: after _env() sets OMP_NUM_THREADS
        add_fused_lm_head(model, temperature=1.0, cast_lm_head_to_fp32=False, outputs=("log_probs", "entropy"))
        acts = {}

        def hook(name):
            def f(_m, _i, o):
                acts[name] = (o[0] if isinstance(o, tuple) else o).detach().clone()
            return f

        hs = [m.register_forward_hook(hook(n)) for n, m in model.named_modules()
              if n.endswith(("layernorm", "model.norm", "self_attn", "mlp"))]
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=am, position_ids=pos).logits[:, P - 1:-1]
            # TRL 1.16's own scoring call (GRPOTrainer._get_per_token_logps_and_entropies: labels, fused LM head)
            labels = ids.masked_fill(am == 0, -100)
            labels[:, :-C] = -100
            trl = model(input_ids=ids, attention_mask=am, position_ids=pos, labels=labels,
                        fused_lm_head=True).log_probs[:, -C:]
        for h in hs:
            h.remove()
        tgt = b["completion_ids"]
        # vllm_style: the engine's compute_logprobs (fp32 log_softmax of the bf16 logits), for bitwise comparison
        out[v] = {"vllm_style": logits.float().log_softmax(-1).gather(-1, tgt.unsqueeze(-1)).squeeze(-1),
                  "trl_style": trl.float(), "logits": logits, "acts": acts}
        print("trainer variant", v, "done")
    R._KERNEL_CACHE["eager"] = E
    torch.save(out, work / "trainer.pt")


# ------------------------------------------------------------------------------------------------ micro
def micro(a):
    _env()
    _amx_first()
    import torch  # noqa: PLC0415 -- lazy: after _env() sets OMP_NUM_THREADS
    import torch.nn.functional as F  # noqa: PLC0415 -- lazy: after _env() sets OMP_NUM_THREADS
    from safetensors.torch import load_file  # noqa: PLC0415 -- lazy: after _env() sets OMP_NUM_THREADS

    import roundalign.bridge.vllm_cpu_attention as VC  # noqa: PLC0415 -- lazy: after _env() sets OMP_NUM_THREADS

    torch.set_num_threads(1)
    lines = []
    sd = load_file(str(Path(a.model) / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    shapes = []
    for name, w in sd.items():
        if w.ndim == 2 and "layers.0" in name or "embed" in name:
            shapes.append((name, w))
    for name, w in shapes:
        X = (torch.randn(1500, w.shape[1], generator=g)).bfloat16()
        ref = F.linear(X, w)
        bad = 0
        tried = 0
        for M in list(range(1, 65)) + [100, 128, 256, 512, 1000]:
            for s in (0, 13):
                tried += 1
                bad += not torch.equal(F.linear(X[s:s + M], w), ref[s:s + M])
        lines.append(f"F.linear {name} (N,K)={tuple(w.shape)}: row results depend on M in {bad} of {tried} (M, offset) cases")
    H, HKV, D = 4, 2, 32
    for T in (16, 33, 48, 64, 65, 96, 129):
        q = torch.randn(T, H, D, generator=g).bfloat16()
        k = torch.randn(T, HKV, D, generator=g).bfloat16()
        v = torch.randn(T, HKV, D, generator=g).bfloat16()
        full = VC.attend_one(q, k, v, D ** -0.5)
        bad = sum(not torch.equal(VC.attend_one(q[t:t + 1], k[:t + 1], v[:t + 1], D ** -0.5)[0], full[t]) for t in range(T))
        lines.append(f"vLLM-CPU attention, T={T}: rows of the Tq=T call differing from Tq=1 calls: {bad}/{T}")
    tp = Path(a.work) / "trainer.pt"
    if tp.exists():
        from roundalign.numerics import regions as R  # noqa: PLC0415 -- lazy: after _env() sets OMP_NUM_THREADS

        t = torch.load(tp, weights_only=False)
        rec = torch.load(Path(a.work) / "capture.pt", weights_only=False)["batches"][a.batch]
        ids = torch.cat([rec["prompt_ids"], rec["completion_ids"]], 1)
        am = torch.cat([rec["prompt_mask"], rec["completion_mask"]], 1).bool()
        A, B = t["eager"]["acts"], t["norms-compiled"]["acts"]
        for name in A:
            d = (A[name] != B[name]) & am.unsqueeze(-1)
            lines.append(f"trainer eager vs norms-compiled kernels, output of {name}: {int(d.sum())} elements differ, "
                         f"rows (seq, padded pos) {sorted({tuple(x) for x in d.any(-1).nonzero().tolist()})[:8]}")
        n0 = "model.layers.0.post_attention_layernorm"
        d0 = ((A[n0] != B[n0]) & am.unsqueeze(-1)).nonzero().tolist()
        if d0:
            bb, pp, jj = d0[0]
            emb = sd["model.embed_tokens.weight"][ids[bb, pp]]
            attn = A["model.layers.0.self_attn"][bb, pp]
            w = sd["model.layers.0.post_attention_layernorm.weight"]
            x = (attn.float() + emb.float())[None].repeat(4, 1)  # layer 0: residual = the embedding
            fe = R.rmsnorm_fused(x, w, 1e-6, keep_fp32=True)[0]
            fc = torch.compile(lambda x, w: R.rmsnorm_fused(x, w, 1e-6, keep_fp32=True), dynamic=True)(x, w)[0]
            q = x[0] * x[0]
            lines.append(f"first differing element: {n0}, seq {bb}, padded pos {pp}, element {jj} "
                         f"(input = fp32 sum of embedding and attention output)")
            lines.append(f"  fp32 norm output there: eager formula {fe[jj].item()!r}, Inductor-compiled {fc[jj].item()!r}; "
                         f"bf16: eager {fe[jj].bfloat16().item()!r}, compiled {fc[jj].bfloat16().item()!r}")
            lo, hi = fe[jj].bfloat16().float(), fc[jj].bfloat16().float()
            lines.append(f"  bf16 neighbours {lo.item()!r} and {hi.item()!r}, midpoint {((lo + hi) / 2).item()!r}: "
                         f"the eager value is {'EXACTLY the midpoint (tie, rounds to even)' if fe[jj] == (lo + hi) / 2 else 'not the midpoint'}")
            lines.append(f"  fp32 outputs of that row differing (last bits) between eager and compiled: "
                         f"{int((fe != fc).sum())}/128; bf16 outputs differing: {int((fe.bfloat16() != fc.bfloat16()).sum())}/128")
            lines.append(f"  mean of squares: torch mean {q.mean().item()!r}, sequential {sum(q.tolist(), 0.0) / 128!r} (f64 sum), "
                         f"8-lane {(q.view(-1, 8).sum(0).sum() / 128).item()!r}, 16-lane {(q.view(-1, 16).sum(0).sum() / 128).item()!r}")
    (Path(a.work) / "micro.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


# ------------------------------------------------------------------------------------------------ analyze
def analyze(a):
    import torch  # noqa: PLC0415 -- lazy: after _env() sets OMP_NUM_THREADS

    from roundalign import metrics as M  # noqa: PLC0415 -- lazy: after _env() sets OMP_NUM_THREADS

    work = Path(a.work)
    rec = torch.load(work / "capture.pt", weights_only=False)
    b = rec["batches"][a.batch]
    seqs = _sequences(b)
    mask = b["completion_mask"].bool()
    T = mask.shape[1]

    def pad(rows):
        out = torch.zeros(len(rows), T, dtype=torch.float32)
        for i, r in enumerate(rows):
            out[i, :len(r)] = torch.tensor(r, dtype=torch.float32)
        return out

    train, samp = b["train_logp"], b["engine_logp"]
    L = []
    ref = [m for m in (json.loads(x) for x in (Path(a.run) / "metrics.jsonl").read_text().splitlines())]
    L.append(f"run: {a.run} step {b['global_step'] + 1}; model {a.model}")
    L.append(f"sweep's logged k3 at this step: {ref[a.batch].get('mismatch/token/k3'):.6e}; rerun (--out fresh): "
             f"{rec['metrics_jsonl'][a.batch].get('mismatch/token/k3'):.6e}; recomputed here: "
             f"{b['metrics']['mismatch/token/k3']:.6e}")
    L.append(f"sequences {len(seqs)}, completion tokens {int(mask.sum())}, prompt lengths "
             f"{min(len(p) for p, _ in seqs)}-{max(len(p) for p, _ in seqs)}, completion lengths "
             f"{min(len(c) for _, c in seqs)}-{max(len(c) for _, c in seqs)}; trainer threads {b['torch_threads']}")

    def k3(x, y):
        return float(M.mismatch_metrics(x, y, mask)["token"]["mismatch_k3"])

    def cmp(name, x, y):
        d = (x - y).abs() * mask
        nd = int(((x != y) & mask).sum())
        rows = sorted({int(i) for i in (((x != y) & mask).nonzero()[:, 0])})
        L.append(f"  {name:<52} tokens differing {nd:4d}/{int(mask.sum())}  k3 {k3(x, y):.3e}  "
                 f"max|d| {float(d.max()):.3e}  in sequences {rows}")
        return nd

    L.append("")
    L.append("== trainer (TRL rescoring, prefill) vs engine sampling (decode) ==")
    cmp("trainer vs engine sampling logprobs", train, samp)
    L.append(f"  tokens with |d| > 1e-6: {int((((train - samp).abs() > 1e-6) & mask).sum())} (the rest are the two fp32 "
             "log-softmax implementations, TRL's fused LM head vs vLLM's log_softmax, on equal logits)")
    diff = ((((train - samp).abs() > 1e-6)) & mask).nonzero().tolist()
    L.append("  tokens with |d| > 1e-6 (seq, pos): " + ", ".join(f"({i},{j})" for i, j in diff[:60])
             + (" ..." if len(diff) > 60 else ""))
    for i in sorted({i for i, _ in diff}):
        p, c = seqs[i]
        first = min(j for ii, j in diff if ii == i)
        n = sum(1 for ii, _ in diff if ii == i)
        L.append(f"  seq {i}: prompt {len(p)} tokens, completion {len(c)}; first differing position {first} "
                 f"(absolute {len(p) + first}), {n} of {len(c)} tokens beyond 1e-6; |d| = "
                 + ", ".join(f"{abs(float(train[i, j] - samp[i, j])):.2e}" for ii, j in diff if ii == i))
    for mode in ("compiled", "eager"):
        f = work / f"engine_{mode}.pt"
        if not f.exists():
            continue
        e = torch.load(f, weights_only=False)
        L.append("")
        L.append(f"== standalone engine, {mode} ({e['kernels'].get('gemm')}, attention "
                 f"{e['kernels'].get('attention_backend')}, threads {e['torch_threads']}) ==")
        E = {k: pad(v) for k, v in e.items() if k.startswith(("decode", "prefill"))}
        if mode == "compiled":
            cmp("decodeB (forced, batched) vs run's sampling", E["decodeB"], samp)
            cmp("decodeB vs decodeB again (determinism)", E["decodeB"], E["decodeB_again"])
            cmp("run trainer vs engine prefill1 (incl. softmax noise)", train, E["prefill1"])
            cmp("run trainer vs engine prefillB (incl. softmax noise)", train, E["prefillB"])
            cmp("run trainer vs engine decode1 (incl. softmax noise)", train, E["decode1"])
        cmp("engine prefill1 vs prefillB", E["prefill1"], E["prefillB"])
        cmp("engine decodeB vs prefill1", E["decodeB"], E["prefill1"])
        cmp("engine decode1 vs prefill1", E["decode1"], E["prefill1"])
        cmp("engine decodeB vs decode1", E["decodeB"], E["decode1"])
        for g in (2, 4, 8, 16):
            cmp(f"engine decode{g} (groups of {g}) vs prefill1", E[f"decode{g}"], E["prefill1"])
        cmp("engine decodeB_nosplit vs decodeB", E["decodeB_nosplit"], E["decodeB"])
        cmp("engine decodeB_nosplit vs prefill1", E["decodeB_nosplit"], E["prefill1"])
        cmp("engine decode1_nosplit vs prefill1", E["decode1_nosplit"], E["prefill1"])
    tp = work / "trainer.pt"
    ec = work / "engine_compiled.pt"
    if tp.exists() and ec.exists():
        t = torch.load(tp, weights_only=False)
        pre = pad(torch.load(ec, weights_only=False)["prefill1"])
        L.append("")
        L.append("== trainer forward recomputed here (TRL's scoring call; region kernels eager / compiled / mixed) ==")
        L.append("  trl_style = TRL's fused-LM-head log_probs (the run's metric); vllm_style = fp32 log_softmax of the")
        L.append("  bf16 logits, as the engine computes its logprobs (bitwise comparable with the engine)")
        for v, d in t.items():
            cmp(f"[{v}] trl_style vs run's trainer logprobs", d["trl_style"], train)
            cmp(f"[{v}] vllm_style vs engine prefill1", d["vllm_style"], pre)
            cmp(f"[{v}] trl_style vs engine sampling (run's k3)", d["trl_style"], samp)
    m = work / "micro.txt"
    if m.exists():
        L.append("")
        L.append("== op-level checks (random bf16 inputs, 1 thread) ==")
        L += ["  " + x for x in m.read_text().splitlines()]
    text = "\n".join(L) + "\n"
    Path(a.report).parent.mkdir(parents=True, exist_ok=True)
    Path(a.report).write_text(text)
    print(text)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=["capture", "engine", "trainer", "micro", "analyze", "all"])
    ap.add_argument("--run", default=str(DEF_RUN), help="exported run dir holding run.json and metrics.jsonl")
    ap.add_argument("--model", default=str(DEF_MODEL))
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--kernels", choices=["eager", "compiled"], default="eager",
                    help="the rerun's region kernels (default eager: how the isolated step was first trained)")
    ap.add_argument("--batch", type=int, default=0, help="which captured generation batch (step - 1)")
    ap.add_argument("--out", default="/tmp/isolate_offpolicy/run", help="fresh run directory for the rerun")
    ap.add_argument("--work", default="/tmp/isolate_offpolicy")
    ap.add_argument("--mode", choices=["compiled", "eager"], default="compiled")
    ap.add_argument("--report", default="results/vllm-cpu/offpolicy_isolation.txt")
    a = ap.parse_args()
    if a.phase == "all":
        _env()
        common = ["--run", a.run, "--model", a.model, "--work", a.work, "--batch", str(a.batch)]
        for args in (["capture", "--out", a.out, "--steps", str(a.steps), "--kernels", a.kernels],
                     ["engine", "--mode", "compiled"],
                     ["engine", "--mode", "eager"], ["trainer"], ["micro"], ["analyze", "--report", a.report]):
            subprocess.run([sys.executable, "-m", "tools.studies.isolate_offpolicy", *args, *common], check=True,
                           cwd=ROOT, env={**os.environ, **ENV})
        return
    {"capture": capture, "engine": engine, "trainer": trainer, "micro": micro, "analyze": analyze}[a.phase](a)


if __name__ == "__main__":
    main()
