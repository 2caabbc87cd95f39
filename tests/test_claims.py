"""docs/claims.md's rows that point at a committed results file hold against that file.

Each row of docs/claims.md's tables whose `artifact` cell names a committed file under results/ or figures/ ("as
above" repeats the row before's) must have an entry in ``CHECKS`` (matched by the start of its claim): a function
that recomputes the row's number(s) from the file and finds them, formatted as the row writes them, in its `value`
cell. A record the numbers are printed into verbatim by the script that made it (a bench .txt) is checked by
``verbatim``: each number must be in the value cell and in the file. A results-backed row with no entry fails, so a
new row cannot go stale unnoticed; ``NOT_RECOMPUTED`` lists the rows that cannot be recomputed from their file, each
with the reason. Reads committed files only: a few seconds.
"""

from __future__ import annotations

import csv
import json
import math
import re
import statistics as st
from collections import defaultdict
from decimal import ROUND_HALF_UP, Decimal
from functools import cache
from pathlib import Path

import pandas as pd
import pytest

from roundalign.analysis.dose import verdicts

ROOT = Path(__file__).resolve().parents[1]
CLAIMS = ROOT / "docs" / "claims.md"
PATH = re.compile(r"(?:results|figures)/[\w./-]+")


# ---------------------------------------------------------------------------------------------------------------
# reading claims.md


def claim_rows() -> list[dict]:
    """Every table row of claims.md with 5 cells, its artifact paths resolved ("as above" = the row before's)."""
    rows, previous = [], []
    for n, line in enumerate(CLAIMS.read_text().splitlines(), 1):
        if not line.startswith("| ") or line.startswith("| claim |"):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if len(cells) != 5:
            continue
        artifact = cells[2]
        paths = previous if artifact.startswith("as above") else [p.rstrip(".,)") for p in PATH.findall(artifact)]
        previous = paths
        rows.append({"line": n, "claim": cells[0], "value": cells[1], "artifact": artifact, "paths": paths})
    return rows


def _in(value: str, *texts: str):
    for t in texts:
        assert t in value, f"value cell {value!r} does not say {t!r} (recomputed from the artifact)"


def _range(lo: float, hi: float, fmt: str, sep: str = "-") -> str:
    return f"{lo:{fmt}}{sep}{hi:{fmt}}"


def _sci(x: float) -> str:
    """1.8e-13 style, as the docs write small numbers."""
    m, e = f"{x:.1e}".split("e")
    return f"{m}e{int(e)}"


# ---------------------------------------------------------------------------------------------------------------
# the committed files, read once


@cache
def _csv(rel: str) -> list[dict]:
    with open(ROOT / rel, newline="") as f:
        return list(csv.DictReader(f))


@cache
def _json(rel: str) -> dict:
    return json.loads((ROOT / rel).read_text())


@cache
def _text(rel: str) -> str:
    return (ROOT / rel).read_text()


@cache
def per_step(sweep: str, metric: str) -> dict[tuple[str, str, str], dict[int, float]]:
    """(model, variant, seed) -> step -> value of ``metric`` in results/<sweep>/aggregate/runs.csv."""
    out: dict = defaultdict(dict)
    for r in _csv(f"results/{sweep}/aggregate/runs.csv"):
        if r["metric"] == metric:
            out[(r["model"], r["variant"], r["seed"])][int(r["step"])] = float(r["value"])
    return dict(out)


def arm_median_k3(sweep: str) -> dict[tuple[str, str], float]:
    """Each run's median per-step token k3, mean over seeds, per (model, variant): what fig_attn draws."""
    arms = defaultdict(list)
    for (model, variant, _), steps in per_step(sweep, "mismatch/token/k3").items():
        arms[(model, variant)].append(st.median(steps.values()))
    return {k: st.mean(v) for k, v in arms.items()}


NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def _printed(x: str, text: str) -> bool:
    """``x`` (as the row writes it, e.g. 8.6e-8 or 1.058) is a number of ``text`` rounded to x's digits."""
    if " " in x:  # a phrase, e.g. "5 min 53 s"
        return x in text
    mantissa = x.split("e")[0].lstrip("+-")
    digits = len(mantissa.replace(".", "").lstrip("0")) or 1
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    for y in NUMBER.findall(text):
        v = float(y)
        if "e" in x and float(f"{v:.{digits - 1}e}") == float(x):
            return True
        if "e" not in x and str(Decimal(y).quantize(Decimal(1).scaleb(-decimals), ROUND_HALF_UP)) == x.lstrip("+"):
            return True
    return False


def verbatim(*numbers: str):
    """The numbers appear in the value cell and, rounded as the row writes them, in the artifact."""
    def check(row):
        text = "\n".join(_text(p) for p in row["paths"] if (ROOT / p).is_file())
        for x in numbers:
            assert re.search(rf"(?<![\d.]){re.escape(x)}(?![\d])", row["value"]), (x, row["value"])
            assert _printed(x, text), f"{x} not in {row['paths']}: stale row?"
    return check


# ---------------------------------------------------------------------------------------------------------------
# recomputations, one per row


def attribution_ends_at_zero(row):
    # per arm (model, engine mode): the metrics of the waterfall's last cumulative step, every source equalized
    last: dict = {}
    for r in _csv("results/vllm-cpu/aggregate/attribution.csv"):
        if r["mode"] == "cumulative":
            step, metrics = last.get((r["model"], r["engine"]), (-1, {}))
            if int(r["step"]) > step:
                step, metrics = int(r["step"]), {}
            metrics[r["metric"]] = float(r["value"])
            last[(r["model"], r["engine"])] = (step, metrics)
    zero = sum(m["k3"] == 0 and m["exact_frac"] == 1 for _, m in last.values())
    _in(row["value"], f"{zero} of {len(last)} arms")


def rounding_alone_removes_half(row):
    rows = _csv("results/vllm-cpu/aggregate/attribution.csv")
    none = {(r["model"], r["engine"]): float(r["value"]) for r in rows
            if r["source"] == "none" and r["metric"] == "k3"}
    alone = [(float(r["value"]) / none[(r["model"], r["engine"])], float(r["ci_low"])) for r in rows
             if r["source"] == "rounding" and r["mode"] == "alone" and r["metric"] == "k3_removed"]
    # "about half or more": a share of at least 0.4 of the arm's k3 (0.44-0.85 in the arms it counts)
    n = sum(share >= 0.4 and low > 0 for share, low in alone)
    _in(row["value"], f"{n} of {len(alone)} arms", "interval above 0")


def top_p(row):
    tp = next(e for e in _json("results/vllm-cpu/user_effects.json")["top_p_top_k"]
              if e["top_p"] == 0.9 and e["top_k"] == 0)
    _in(row["value"], f"{tp['trl_recompute']['is_ratio_mean']:.3f} vs {tp['vllm_processed']['is_ratio_mean']:.3f}")


def temperature(row):
    t = _json("results/vllm-cpu/user_effects.json")["temperature"]
    _in(row["value"], f"{t['trainer_T1']['k3'] / t['both_sides']['k3']:.0f}x")


def micro_batch(row):
    m = _json("results/vllm-cpu/user_effects.json")["micro_batch"]["mb1_vs_mb8_padded"]
    assert m["exact_frac"] == 1.0 and m["k3"] == 0.0 and m["max_abs_dlogp"] == 0.0, m
    _in(row["value"], "no bit")


def _k3_ratio(num: tuple[str, str], den: tuple[str, str], policies: tuple[str, ...] = ("",)) -> list[float]:
    """Per model of the vllm-cpu sweep: arm-median k3 of ``num`` over ``den``, each (model suffix, variant); the
    suffix ".vllm_cpu" is the same policy trained with the engine's attention. ``policies``: suffixes added to both."""
    k3 = arm_median_k3("vllm-cpu")
    models = sorted({m for m, _ in k3 if not m.endswith(".vllm_cpu")})
    return [k3[(m + p + num[0], num[1])] / k3[(m + p + den[0], den[1])] for p in policies for m in models]


def alignment_alone(row):
    r = _k3_ratio(("", "baseline"), ("", "full"))  # how many times lower: neither over alignment alone
    _in(row["value"], _range(min(r), max(r), ".1f") + "x")


def kernels_alone(row):
    r = _k3_ratio((".vllm_cpu", "baseline"), ("", "baseline"))
    _in(row["value"], _range(min(r), max(r), ".1f") + "x of neither")


def rope_alone_vllm_cpu(row):
    r = _k3_ratio(("", "rope"), ("", "baseline"), policies=("", ".vllm_cpu"))  # SDPA and engine attention alike
    _in(row["value"], _range(min(r), max(r), ".2f") + "x of baseline")


def _onpolicy_rows() -> list[dict]:
    out = []
    for line in _text("results/vllm-cpu/onpolicy.txt").splitlines():
        f = line.split()
        if len(f) >= 9 and f[1] in ("compiled", "eager") and "/" in f[4] and "/" in f[7]:
            ok, n = map(int, f[4].split("/"))
            exact, n_exact = map(int, f[7].split("/"))
            assert n_exact == n, line
            out.append({"model": f[0], "mode": f[1], "variant": f[2], "ok": ok, "n": n, "median": float(f[5]),
                        "max": float(f[6]), "exact": exact, "max_dlogp": float(f[8])})
    return out


def onpolicy_compiled(row):
    full = [r for r in _onpolicy_rows() if r["mode"] == "compiled" and r["variant"] == "full"]
    exact, n = sum(r["exact"] for r in full), sum(r["n"] for r in full)
    # the same from the sweep's per-step table: every `full` run with the engine's kernels, every token of every step
    frac = [v for (m, var, _), s in per_step("vllm-cpu", "mismatch/token/tokens_exact_frac").items()
            if m.endswith(".vllm_cpu") and var == "full" for v in s.values()]
    diff = [v for (m, var, _), s in per_step("vllm-cpu", "mismatch/token/logp_abs_diff_max").items()
            if m.endswith(".vllm_cpu") and var == "full" for v in s.values()]
    assert (sum(v == 1.0 for v in frac), len(frac)) == (exact, n)
    _in(row["value"], f"{exact} of {n} steps", f"largest difference {max(diff):g}")


def onpolicy_eager(row):
    full = [r for r in _onpolicy_rows() if r["mode"] == "eager" and r["variant"] == "full"]
    _in(row["value"], f"{sum(r['exact'] for r in full)} of {sum(r['n'] for r in full)} steps",
        f"largest difference {max(r['max_dlogp'] for r in full):g}")


def onpolicy_baseline(row):
    base = [r for r in _onpolicy_rows() if r["variant"] == "baseline"]
    assert all(r["ok"] == 0 for r in base)
    meds = [r["median"] for r in base]
    _in(row["value"], f"medians {_sci(min(meds))} to {_sci(max(meds))}")


def _heldout_learning(row, sweep: str):
    """Learning against the initial policy: each run's held-out reward before step 1 and after the last step."""
    runs = _csv(f"results/{sweep}/aggregate/run_status.csv")
    init = [float(r["heldout_initial"]) for r in runs]
    gains = [float(r["heldout_final"]) - float(r["heldout_initial"]) for r in runs]
    above = sum(float(r["heldout_final_ci_low"]) > float(r["heldout_initial"]) for r in runs)
    arms = defaultdict(list)  # an arm: a model entry and variant, its seeds pooled
    for r, g in zip(runs, gains):
        arms[(r["model"], r["variant"])].append(g)
    arm_gains = [st.mean(g) for g in arms.values()]
    assert max(init) <= 0.6, "every arm leaves headroom at the start"
    assert min(arm_gains) > 0, "every arm ends above its initial policy"
    _in(row["value"], f"initial {min(init):.2f}-{max(init):.2f}", _range(min(gains), max(gains), "+.2f", " to "),
        f"{above} of {len(runs)}")
    if len(arm_gains) < len(runs):  # several seeds: the arms' range too
        _in(row["value"], _range(min(arm_gains), max(arm_gains), "+.2f", " to "))


def smoke_learning(row):
    _heldout_learning(row, "smoke")


def vllm_cpu_learning(row):
    _heldout_learning(row, "vllm-cpu")


def smoke_k3_baseline_rope(row):
    per_model = defaultdict(list)
    for (m, v, _), steps in per_step("smoke", "mismatch/token/k3").items():
        if v in ("baseline", "rope"):
            per_model[(m, v)].append(st.median(steps.values()))
    meds = [st.mean(x) for x in per_model.values()]
    _in(row["value"], f"{_sci(min(meds))} to {_sci(max(meds))}")


def smoke_k3_full(row):
    runs = {k: s for k, s in per_step("smoke", "mismatch/token/k3").items() if k[1] == "full"}
    meds = [st.median(s.values()) for s in runs.values()]
    steps = [v for s in runs.values() for v in s.values()]
    above = [v for v in steps if v > 1e-10]
    _in(row["value"], f"{_sci(min(meds))} to {_sci(max(meds))}", f"{len(above)} of {len(steps)} steps",
        *([f"at most {_sci(max(above))}"] if above else []))


def smoke_probe(row):
    rows = [r for r in _csv("results/smoke/aggregate/probe.csv") if r["variant"] == "full" and r["level"] == "token"]
    k3 = {(r["model"], r["engine"]): float(r["value"]) for r in rows if r["metric"] == "mismatch_k3"}
    exact = {(r["model"], r["engine"]): float(r["value"]) for r in rows if r["metric"] == "tokens_exact_frac"}
    bitwise = [k for k in k3 if k3[k] == 0 and exact[k] == 1.0]
    others = sorted(set(k3) - set(bitwise))
    assert {e for _, e in k3} >= {"vllm-compiled", "vllm-eager"}
    _in(row["value"], "k3 0", f"{len(bitwise)} of {len(k3)} (model, engine) probes",
        *[f"{exact[k]:.3f} of tokens (k3 {_sci(k3[k])}" for k in others])


STRESS = "results/stress/aggregate/stress_runs.csv"
DOSES = ("auto", "fp8_e4m3", "fp8_e5m2")


def stress_dose(row):
    rows = _csv(STRESS)
    d = [st.mean(float(r["mismatch_token_logp_abs_diff_mean"]) for r in rows
                 if r["dose"] == dose and r["variant"] == "baseline") for dose in DOSES]
    _in(row["value"], f"{d[0]:.3f} (bf16), {d[1]:.3f} (e4m3), {d[2]:.3f} (e5m2)")


def stress_final_reward(row):
    rows = _csv(STRESS)
    parts = []
    for dose in DOSES:
        v = [float(r["reward_last"]) for r in rows if r["dose"] == dose]
        parts.append(f"{st.mean(v):.2f} ± {st.stdev(v) / math.sqrt(len(v)):.3f}")
    _in(row["value"], ", ".join(parts))


def stress_collapses(row):
    rows = _csv(STRESS)
    per = [sum(r["event"] == "1" for r in rows if r["dose"] == dose) for dose in DOSES]
    reward = sum(r["event"] == "1" and r["event_kind"] == "reward" for r in rows)
    assert reward == sum(per), "all reward collapses"
    _in(row["value"], f"{sum(per)} of {len(rows)} runs", f"({per[0]}, {per[1]}, {per[2]} of {len(rows) // 3} per dose)")


def stress_share(row):
    rows = [r for r in _csv("results/stress/aggregate/stress_gap.csv") if r["dose"] == "auto"]
    for r in rows:
        if r["variant"] not in ("baseline", "fp32"):
            _in(row["value"], f"`{r['variant']}` {float(r['share_closed']):.2f}")


def stress_no_gap(row):
    rows = {r["dose"]: r for r in _csv("results/stress/aggregate/stress_gap.csv") if r["variant"] == "baseline"}
    for dose, name in (("fp8_e4m3", "e4m3"), ("fp8_e5m2", "e5m2")):
        r = rows[dose]
        assert r["has_gap"] == "False"
        _in(row["value"], f"{float(r['gap']):.4f} ({float(r['gap_ci_low']):.4f}-{float(r['gap_ci_high']):.4f}) at {name}")


def stress_probe(row):
    k3 = {(r["model"], r["variant"]): float(r["value"]) for r in _csv("results/stress/aggregate/probe.csv")
          if r["metric"] == "mismatch_k3" and r["level"] == "token"}
    for suffix in ("", "-fp8e4m3", "-fp8e5m2"):
        m = f"stress-qwen3-untied{suffix}"
        _in(row["value"], f"{_sci(k3[(m, 'baseline')])} -> {_sci(k3[(m, 'full')])}")


def gpu_regions(row):
    rows = {(r["region"], r["comparison"]): r for r in _json("results/bench/gpu/gpu_check.json")["inductor"]}
    for region in ("rope q", "rope k"):
        assert rows[(region, "fused-vs-compiled")]["frac_bitwise_equal"] == 1.0
    silu = rows[("silu_and_mul", "fused-vs-compiled")]
    differ = round((1 - silu["frac_bitwise_equal"]) * silu["numel"])
    norms = {round(100 * rows[(r, "fused-vs-compiled")]["frac_bitwise_equal"], 4) for r in ("rms_norm", "add_rms_norm")}
    hf = [1 - r["frac_bitwise_equal"] for (reg, c), r in rows.items()
          if c == "hf-vs-compiled" and not reg.endswith("residual")]  # the stored residual equals both
    _in(row["value"], "RoPE q/k 100%", f"all but {differ} of {silu['numel'] / 1e6:.1f}M",
        *(f"{n}%" for n in norms), f"{100 * min(hf):.0f}-{100 * max(hf):.0f}%")


def gpu_qk_norm_rope(row):
    rows = {(r["region"], r["comparison"]): r for r in _json("results/bench/gpu/gpu_check.json")["inductor"]}
    q, k = rows[("qk_norm_rope q", "fused-vs-compiled")], rows[("qk_norm_rope k", "fused-vs-compiled")]
    _in(row["value"], f"{100 * min(q['frac_bitwise_equal'], k['frac_bitwise_equal']):.3f}%",
        f"up to {max(q['max_ulp'], k['max_ulp'])} ulp")


def gpu_piecewise(row):
    rows = {(r["arch"], r["variant"]): r for r in _json("results/bench/gpu/gpu_check.json")["piecewise"]}
    _in(row["value"], f"Qwen2 {100 * rows[('qwen2', 'full')]['frac_bitwise_equal']:.0f}% "
                      f"(baseline {100 * rows[('qwen2', 'baseline')]['frac_bitwise_equal']:.0f}%)",
        f"Qwen3 {100 * rows[('qwen3', 'full')]['frac_bitwise_equal']:.1f}% "
        f"(baseline {100 * rows[('qwen3', 'baseline')]['frac_bitwise_equal']:.0f}%)")


def kv_decode(row):
    text = _text("results/bench/kv_decode.txt")
    cases = re.findall(r"^(qwen\d)\s+(\S+)\s+(yes|no)\s+(\d+)\s+(\d+)\s+(\d+)$", text, re.M)
    assert len(cases) == 12, cases
    short = [c for c in cases if c[4] != c[3]]
    _in(row["value"], f"every token in {len(cases) - len(short)} of {len(cases)} cases",
        *(f"{c[4]}/{c[3]}" for c in short))


def hf_model_tests(row):
    text = _text("results/bench/hf_model_tests.txt")
    counts = set(re.findall(r"^qwen\d\s+(?:stock|full_\w+)\s+(\d+)\s+0\s+0\s+(\d+)$", text, re.M))
    assert len(counts) == 1, counts
    (passed, skipped), = counts
    failed = set(re.findall(r"^qwen\d\s+control_rejects_heads\s+\d+\s+(\d+)", text, re.M))
    _in(row["value"], f"{passed} passed, {skipped} skipped per architecture", f"fails {failed.pop()}")


def figures_files(row):
    text = _text("results/bench/workflow.txt")
    files, median = re.findall(r"^\w{7,}\s+(\d+)\s+([\d.]+)\s", text, re.M)[-1]
    committed = len([p for p in (ROOT / "figures").rglob("*") if p.is_file() and p.parent.name != "demo"
                     and p.suffix in (".png", ".pdf", ".csv", ".md")])
    assert int(files) == committed, f"the record drew {files} files, figures/ holds {committed}"
    _in(row["value"], f"{median} s median", f"{files} files")


def dose_probe(row):
    rows = _csv("results/dose/probe/dose_probe.csv")
    val = {(int(r["dose"]), r["variant"], r["metric"]): float(r["value"]) for r in rows}
    doses = sorted({d for d, _, _ in val}, reverse=True)
    assert all(val[(d, "full", "k3")] == 0 and val[(d, "full", "tokens_exact_frac")] == 1.0 for d in doses)
    base = [val[(d, "baseline", "k3")] for d in doses]
    assert base == sorted(base), "baseline's mismatch rises with the dose"
    _in(row["value"], "full k3 0", f"at {', '.join(map(str, doses[:-1]))} and {doses[-1]} bits",
        "baseline k3 " + ", ".join(_sci(b) for b in base))


def dose_anchor(row):
    """The real engine at the dose experiment's horizon: every arm's held-out reward, full + the engine's attention
    at the floor, no collapse."""
    runs = _csv("results/dose-anchor/aggregate/run_status.csv")
    init = {r["heldout_initial"] for r in runs}
    assert len(init) == 1, "one warm start, one engine, seeded requests: one initial reward"
    arms = defaultdict(list)
    for r in runs:
        arms[(r["attn"], r["variant"])].append(r)
    finals = [st.mean(float(r["heldout_final"]) for r in v) for v in arms.values()]
    gains = [st.mean(float(r["heldout_final"]) - float(r["heldout_initial"]) for r in v) for v in arms.values()]
    floor = [v for (m, var, _), s in per_step("dose-anchor", "mismatch/token/k3").items()
             if var == "full" and m.endswith(".vllm_cpu") for v in s.values()]
    collapsed = sum(bool(r["collapse_step"]) for r in runs)
    _in(row["value"], f"initial {float(init.pop()):.3f}", _range(min(finals), max(finals), ".3f", "-"),
        _range(min(gains), max(gains), "+.3f", " to "), f"at most {_sci(max(floor))} over {len(floor)} steps",
        f"{collapsed} of {len(runs)}")


def dose_outcome(row):
    """The pre-registered comparison, from the aggregate's gain and test tables (analysis/dose.py wrote them)."""
    gain = {(int(r["dose"]), r["variant"]): r for r in _csv("results/dose/aggregate/dose_gain.csv")}
    tests = _csv("results/dose/aggregate/dose_tests.csv")
    doses = sorted({d for d, _ in gain}, reverse=True)
    diffs = [f'{float(gain[(d, "full")]["diff_vs_baseline"]):+.3f}' for d in doses]
    welch = sorted((r for r in tests if r["test"] == "welch_full_vs_baseline"), key=lambda r: -float(r["dose"]))
    (inter,) = [r for r in tests if r["test"] == "interaction_grows_with_dose"]

    verdict = verdicts(pd.read_csv(ROOT / "results/dose/aggregate/dose_tests.csv"))
    assert sorted(verdict) == sorted({r["hypothesis"] for r in tests if r["hypothesis"].startswith("H")}) \
        == ["H1", "H2", "H3", "H4"]
    _in(row["value"], "full - baseline " + ", ".join(diffs) + " at " + "/".join(map(str, doses)) + " bits",
        "Holm p " + ", ".join(f'{float(r["p_holm"]):.2f}' for r in welch),
        f'interaction {float(inter["estimate"]):+.3f} per level (p {float(inter["p_value"]):.2f})',
        "none of H1-H4 supported" if not any(verdict.values()) else
        "supported: " + ", ".join(h for h, ok in verdict.items() if ok))


def dose_collapses(row):
    out = _csv("results/dose/aggregate/dose_outcome.csv")
    _in(row["value"], f'{sum(r["collapsed"] == "True" for r in out)} of {len(out)} runs')


CHECKS = {
    "the dose experiment's outcome": dose_outcome,
    "the dose experiment's collapse events": dose_collapses,
    "the dose experiment's probe": dose_probe,
    "the attribution waterfall against real vLLM-CPU ends at k3 = 0": attribution_ends_at_zero,
    "rounding (`full`) alone removes about half or more": rounding_alone_removes_half,
    "top-p 0.9 without renormalisation": top_p,
    "temperature 0.7 on the engine side only": temperature,
    "the trainer's micro-batch size": micro_batch,
    "alignment alone (`full`, sdpa) lowers": alignment_alone,
    "the engine's kernels alone (`baseline`, vllm_cpu": kernels_alone,
    "`full` + the engine's kernels: every token of every step bitwise against the compiled engine":
        onpolicy_compiled,
    "the same against the eager engine": onpolicy_eager,
    "`baseline` + the engine's kernels is above 1e-10": onpolicy_baseline,
    "learning in the vllm-cpu sweep": vllm_cpu_learning,
    "`rope` alone in that sweep": rope_alone_vllm_cpu,
    "a step above the floor, in an earlier pass": verbatim("8.6e-8", "5.3e-14"),
    "`full` with vLLM's attention equals the real engine's logprobs": verbatim("0"),
    "with stock kernels (sdpa) `full` is below `baseline`": verbatim("1.48", "2.89", "1.78", "3.25"),
    "RoPE alone against the real engine": verbatim("0.78", "1.12"),
    "with equal kernels `full` is bitwise on-policy": verbatim("1.000"),
    "Inductor's own norm reduction on Qwen3": verbatim("8.5e-6", "0.898"),
    "split-K GEMMs / SDPA decode / the stress setting": verbatim("1.7"),
    "RoPE alone in the probe": verbatim("0.68", "0.92", "0.74", "1.06"),
    "`full` matches the engine's KV-cache decode": kv_decode,
    "transformers' own common model tests": hf_model_tests,
    "Triton-compiled vLLM formulas equal the one-rounding regions": gpu_regions,
    "Qwen3's q/k-norm + RoPE in one Triton kernel": gpu_qk_norm_rope,
    "the piecewise-compiled engine against `full`": gpu_piecewise,
    "cost on the GPU, eager regions": verbatim("2.26", "1.65"),
    "cost on the GPU, compiled regions": verbatim("1.41", "1.14", "1.94", "1.40"),
    "forward+backward of `full` over `baseline`, eager regions": verbatim("1.058", "1.212"),
    "the same, compiled regions": verbatim("0.862", "0.848"),
    "a compiled aligned model over a compiled stock model": None,  # filled below from the record's own numbers
    "activation memory of `full` over `baseline`": verbatim("0.828", "0.892", "0.785", "0.845"),
    "GRPO step of `full` over `baseline`, emulated engine": verbatim("1.050", "1.160"),
    "a 4-step smoke run through the CLI": verbatim("14.5"),
    "GRPO step against the real engine, over `baseline` + SDPA": verbatim("0.972", "1.047", "1.028", "1.078", "1.005",
                                                                          "1.088", "1.092", "1.054"),
    "the checkpoint flush": verbatim("0.933", "0.479", "1.95"),
    "dry run of the paper sweep": None,  # filled below
    "`make figures` from a fresh tree": figures_files,
    "`make test`": verbatim("17.4", "23.4"),
    "`.ci/run` from a fresh clone with the five environments": verbatim("35 min 42 s"),
    "`make demo`": verbatim("5 min 53 s", "4 min 56 s"),
    "smoke: `baseline` and `rope` per-step k3": smoke_k3_baseline_rope,
    "smoke: `full` per-step k3": smoke_k3_full,
    "smoke: the probe, `full` bitwise on every token": smoke_probe,
    "smoke: every arm ends above its initial policy": smoke_learning,
    "the dose experiment's real-engine anchor": dose_anchor,
    "stress: the dose, mean \\|Δ logp\\| per token": stress_dose,
    "stress: final reward per dose": stress_final_reward,
    "stress: collapse events": stress_collapses,
    "stress: share of the bf16 gap closed": stress_share,
    "stress: no gap to close at the fp8 doses": stress_no_gap,
    "stress: probe at the warm-start weights": stress_probe,
    "mutation score over numerics/": verbatim("1866", "1948", "0.958"),
}


def _compile_record(row):
    text = _text("results/bench/compile.txt")
    ratios = {(a, arm.strip()): r for a, arm, r in
              re.findall(r"^(qwen\d)\s+(full/vllm-(?:cpu-)?compiled compiled)\s+[\d.]+\s+([\d.]+)", text, re.M)}
    assert len(ratios) == 4, ratios
    full = {(arch, arm.split("/")[1].split()[0]): r for (arch, arm), r in ratios.items()}
    _in(row["value"], f"{full['qwen2', 'vllm-compiled']} / {full['qwen2', 'vllm-cpu-compiled']} (Qwen2)",
        f"{full['qwen3', 'vllm-compiled']} / {full['qwen3', 'vllm-cpu-compiled']} (Qwen3)")
    cpu = re.search(r"^CPU: ([^,]+),", text, re.M)
    assert cpu and cpu.group(1) in row["line_text"], "the row names the record's CPU"


def _dry_runs(row):
    text = _text("results/bench/workflow.txt")
    runs = dict(re.findall(r"^(paper(?:\+ablations)?)\s+(\d+\s+[\d.]+)$", text, re.M))
    for name in ("paper", "paper+ablations"):
        jobs, secs = runs[name].split()
        _in(row["value"], f"{jobs} jobs in {secs} s")


CHECKS["a compiled aligned model over a compiled stock model"] = _compile_record
CHECKS["dry run of the paper sweep"] = _dry_runs

# rows whose artifact cannot give back the row's number, and why (checked: each still names a committed file)
NOT_RECOMPUTED: dict[str, str] = {
    # "claim prefix": "why its file cannot give its number back",
}


def _key(claim: str) -> str | None:
    keys = [k for k in CHECKS if claim.startswith(k)]
    assert len(keys) <= 1, f"{claim!r} matches several checks: {keys}"
    return keys[0] if keys else None


def results_rows() -> list[dict]:
    return [r for r in claim_rows() if r["paths"]]


def test_claims_md_has_results_backed_rows():
    rows = results_rows()
    assert len(rows) >= 40, len(rows)
    for r in rows:
        for p in r["paths"]:
            assert (ROOT / p).exists(), f"claims.md:{r['line']}: {p} does not exist"


@pytest.mark.parametrize("row", results_rows(), ids=lambda r: f"line{r['line']}")
def test_each_results_backed_row_is_recomputed_from_its_artifact(row):
    key = _key(row["claim"])
    if key is None:
        reason = next((v for k, v in NOT_RECOMPUTED.items() if row["claim"].startswith(k)), None)
        assert reason, (f"claims.md:{row['line']}: {row['claim'][:60]!r} points at {row['paths']} but nothing "
                        "recomputes it: add a check to tests/test_claims.py CHECKS (or a reason to NOT_RECOMPUTED)")
        return
    row["line_text"] = CLAIMS.read_text().splitlines()[row["line"] - 1]
    CHECKS[key](row)


def test_every_check_matches_a_row():
    claims = [r["claim"] for r in claim_rows()]
    unused = [k for k in [*CHECKS, *NOT_RECOMPUTED] if not any(c.startswith(k) for c in claims)]
    assert unused == [], f"checks for rows claims.md does not have: {unused}"


def test_a_stale_value_fails_its_check():
    # the recomputation is real: a row whose number does not match its file fails
    row = next(r for r in results_rows() if _key(r["claim"]) == "stress: final reward per dose")
    with pytest.raises(AssertionError):
        CHECKS[_key(row["claim"])]({**row, "value": row["value"].replace("0.015", "0.02")})
    row = next(r for r in results_rows() if _key(r["claim"]) == "`rope` alone in that sweep")
    with pytest.raises(AssertionError):
        CHECKS[_key(row["claim"])]({**row, "value": "0.49-1.08x of baseline k3"})


def test_a_results_backed_row_without_a_check_fails():
    row = {"line": 0, "claim": "a new claim nobody registered", "value": "1.0", "artifact": "`results/x.csv`",
           "paths": ["results/x.csv"]}
    with pytest.raises(AssertionError, match="nothing recomputes it"):
        test_each_results_backed_row_is_recomputed_from_its_artifact(row)
