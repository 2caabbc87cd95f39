"""The rounding dose (numerics/dose.py): the rounding itself against independent references (float64 arithmetic,
torch's own bf16 and fp8 casts), its placement in the engine and the trainer, and on-policy-ness of `full` under it."""

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from conftest import random_qwen
from scipy import stats

from roundalign import apply_alignment
from roundalign.analysis.dose import dose_probe_table, gain_table, hypothesis_tests, outcome_table, verdicts
from roundalign.engine import Engine
from roundalign.numerics.dose import apply_dose, dose_of, remove_dose, round_mantissa, round_mantissa_st
from tools.cluster import dose_chunks as dc

torch.set_num_threads(1)


def reference_round(x: float, bits: int) -> float:
    """Round to nearest even at ``bits`` explicit mantissa bits, in float64 arithmetic (independent of the bit
    trick): x = f * 2^e with 0.5 <= |f| < 1, so the kept significand is f * 2^(bits + 1), an integer after rounding;
    Python's round() rounds halves to even."""
    if x == 0 or not math.isfinite(x):
        return x
    f, e = math.frexp(x)
    q = round(f * 2 ** (bits + 1)) * 2.0 ** (e - bits - 1)
    return q if abs(q) < 2.0 ** 128 else math.copysign(math.inf, q)  # past fp32's range: infinity


def random_values(n=20000, seed=0):
    g = torch.Generator().manual_seed(seed)
    # normal fp32 values over a wide exponent range, both signs
    mant = torch.rand(n, generator=g) + 1.0
    exp = torch.randint(-100, 100, (n,), generator=g).float()
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    return (sign * mant * torch.exp2(exp)).float()


@pytest.mark.parametrize("bits", range(1, 8))
def test_round_mantissa_equals_float64_rounding(bits):
    x = random_values()
    got = round_mantissa(x, bits)
    want = torch.tensor([reference_round(v, bits) for v in x.tolist()], dtype=torch.float32)
    assert torch.equal(got, want)
    # bf16 inputs round the same way and stay bf16
    xb = x.bfloat16()
    got_b = round_mantissa(xb, bits)
    assert got_b.dtype == torch.bfloat16
    want_b = torch.tensor([reference_round(v, bits) for v in xb.float().tolist()], dtype=torch.float32)
    assert torch.equal(got_b.float(), want_b)


@pytest.mark.parametrize("bits", [1, 3, 5])
def test_ties_go_to_even(bits):
    # exactly half an ulp (at `bits`) above a value whose last kept bit is even, and above one whose bit is odd
    ulp = 2.0 ** -bits
    even, odd = 1.0, 1.0 + ulp
    x = torch.tensor([even + ulp / 2, odd + ulp / 2, -(even + ulp / 2), -(odd + ulp / 2)])
    assert round_mantissa(x, bits).tolist() == [even, odd + ulp, -even, -(odd + ulp)]


def test_seven_bits_is_torchs_bf16_rounding():
    x = random_values(seed=1)
    assert torch.equal(round_mantissa(x, 7), x.bfloat16().float())
    xb = x.bfloat16()
    assert round_mantissa(xb, 7) is xb  # no dose: the very tensor


@pytest.mark.parametrize("bits,fp8,lo,hi", [(3, torch.float8_e4m3fn, 2.0 ** -6, 448.0),
                                            (2, torch.float8_e5m2, 2.0 ** -14, 57344.0)])
def test_fp8_mantissas_equal_torchs_fp8_casts_in_their_normal_range(bits, fp8, lo, hi):
    # 3 bits is fp8 e4m3's mantissa, 2 bits e5m2's: within those formats' normal range, the dose rounds as a cast does
    x = random_values(seed=2)
    x = x[(x.abs() >= lo) & (x.abs() <= hi * 0.99)]
    assert x.numel() > 500
    assert torch.equal(round_mantissa(x, bits), x.to(fp8).float())


def test_specials_and_overflow():
    x = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 3.3895313892515355e38])  # the last: bf16's largest
    out = round_mantissa(x.bfloat16(), 3).float()
    assert out[0] == 0 and out[1] == 0 and math.copysign(1, out[1].item()) == -1
    assert out[2] == math.inf and out[3] == -math.inf and math.isnan(out[4])
    assert out[5] == math.inf  # 1.1111111b x 2^127 rounds up past the largest finite value


def test_bad_bits_are_named():
    for bad in (0, 8, 3.0, True):
        with pytest.raises(ValueError, match="integer from 1 to 7"):
            round_mantissa(torch.ones(2), bad)


def test_straight_through_gradient():
    x = torch.randn(64, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(64, dtype=torch.bfloat16)
    y = round_mantissa_st(x, 3)
    assert torch.equal(y, round_mantissa(x.detach(), 3))
    y.backward(g)
    assert torch.equal(x.grad, g)


def prompts(lengths, vocab=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def exact_fraction(model, samples):
    exact = n = 0
    for s in samples:
        ids = torch.tensor(s.prompt_ids + s.completion_ids).unsqueeze(0)
        with torch.no_grad():
            lg = model(input_ids=ids).logits[0, len(s.prompt_ids) - 1:-1]
        lp = torch.log_softmax(lg.float(), -1).gather(-1, torch.tensor(s.completion_ids)[:, None])[:, 0]
        exact += int((lp == s.logprobs).sum())
        n += len(s.completion_ids)
    return exact / n


@pytest.mark.parametrize("engine", ["vllm-eager", "vllm-cpu-eager"])
def test_full_stays_on_policy_under_the_dose_and_baseline_does_not(arch, engine):
    # The engine rounds the dose by its own code (engine/model.py), the trainer by hooks and the aligned attention
    # (numerics/dose.py): every sampled token's logprob equal is a check of the trainer's wiring against the engine's
    model = random_qwen(arch, tie=False)
    batch = prompts([7, 7, 12])
    for bits in (3, 5):
        eng = Engine(model, engine=engine, attn="eager", gemm="same", dose_bits=bits)
        samples = eng.generate(batch, max_new_tokens=10, seed=1)
        apply_alignment(model, "full", engine)
        apply_dose(model, bits, "full")
        assert dose_of(model) == bits
        # teacher-forced, one prefill on both sides: every logit bitwise (the placement of every rounding agrees)
        for s in samples:
            ids = torch.tensor(s.prompt_ids + s.completion_ids)[None]
            with torch.no_grad():
                assert torch.equal(model(input_ids=ids).logits, eng.model.forward(ids, eng.model.new_cache()))
        # the engine's own KV-cache decode: bitwise on every token but one, Qwen2 on the CPU eager engine at 5 bits,
        # where its prefill is bitwise (above): a decode row's native RMSNorm (vllm_native, its mean over one row)
        # against the trainer's full-sequence rows, which the undosed engine's logprobs do not show
        floor = 0.96 if (arch, engine) == ("qwen2", "vllm-cpu-eager") else 1.0
        assert exact_fraction(model, samples) >= floor
        apply_alignment(model, "full", engine)  # re-aligning removes the dose: full without it is off-policy
        assert dose_of(model) == 7
        assert exact_fraction(model, samples) < 0.5
        apply_alignment(model, "baseline")
        assert exact_fraction(model, samples) < 0.5
        # rope aligns the RoPE path only: the norms and SwiGLU still round otherwise
        apply_alignment(model, "rope", engine)
        apply_dose(model, bits, "rope")
        assert exact_fraction(model, samples) < 0.5
    apply_alignment(model, "baseline")


def test_a_dose_moves_the_engine_and_seven_bits_is_no_dose(arch):
    model = random_qwen(arch, tie=False)
    batch = prompts([9, 9])
    ids = torch.tensor(batch)
    logits = {}
    for bits in (7, 5, 3):
        eng = Engine(model, engine="vllm-eager", dose_bits=bits)
        logits[bits] = eng.model.forward(ids, eng.model.new_cache())
    stock = Engine(model, engine="vllm-eager").model
    assert torch.equal(logits[7], stock.forward(ids, stock.new_cache()))
    d5 = (logits[5].float() - logits[7].float()).abs().mean()
    d3 = (logits[3].float() - logits[7].float()).abs().mean()
    assert 0 < d5 < d3


def test_the_dosed_trainer_trains(arch):
    model = random_qwen(arch, tie=False)
    apply_alignment(model, "full", "vllm-eager")
    apply_dose(model, 3, "full")
    ids = torch.tensor(prompts([12]))
    model(input_ids=ids).logits.float().logsumexp(-1).sum().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g.float()).all() for g in grads)
    assert sum(float(g.float().abs().sum()) for g in grads) > 0


def test_bad_doses_are_refused_by_name():
    model = random_qwen("qwen2", tie=False)
    with pytest.raises(ValueError, match="vllm-eager, vllm-cpu-eager only, not 'vllm-compiled'"):
        Engine(model, engine="vllm-compiled", dose_bits=3)
    apply_alignment(model, "full", "vllm-compiled")
    with pytest.raises(ValueError, match="vllm-eager, vllm-cpu-eager only"):
        apply_dose(model, 3, "full")
    apply_alignment(model, "rope", "vllm-eager")
    with pytest.raises(ValueError, match="aligned as 'rope'"):
        apply_dose(model, 3, "full")
    with pytest.raises(ValueError, match="unknown alignment variant 'tis'"):
        apply_dose(model, 3, "tis")
    apply_alignment(model, "baseline")
    assert apply_dose(model, 3, "baseline") is model and dose_of(model) == 7  # baseline rounds nothing
    remove_dose(model)


# -- the experiment's tables (analysis/dose.py) -------------------------------------------------------------------

def test_outcome_and_gain_tables_against_a_hand_count():
    keys = [("m", "baseline", 0), ("m", "baseline", 1), ("m", "full", 0), ("m", "full", 1),
            ("m2", "baseline", 0), ("m2", "full", 0), ("m2", "full", 1)]
    status = pd.DataFrame([{"model": m, "variant": v, "seed": s, "status": "done",
                            "heldout_initial": 0.3 if m == "m" else 0.2,
                            "heldout_final": [0.5, 0.7, 0.6, 0.8, 0.25, 0.6, np.nan][i]} for i, (m, v, s) in
                           enumerate(keys)])
    stress = pd.DataFrame([{"model": m, "variant": v, "seed": s, "dose": 7 if m == "m" else 2,
                            "event": int(i == 4), "event_kind": "reward" if i == 4 else "",
                            "event_step": 40 if i == 4 else np.nan} for i, (m, v, s) in enumerate(keys)])
    out = outcome_table(status, stress)
    assert list(out["dose"]) == [7, 7, 7, 7, 2, 2, 2]
    row = out[(out["dose"] == 2) & (out["variant"] == "baseline")].iloc[0]
    assert row["gain"] == pytest.approx(0.05) and row["collapsed"] and row["collapse_step"] == 40
    assert out["gain"].isna().sum() == 1  # a run without a final evaluation has no gain
    g = gain_table(out, num_resamples=4000).set_index(["dose", "variant"])
    assert g.loc[(7, "baseline"), "gain_mean"] == pytest.approx(0.3)  # (0.2 + 0.4) / 2
    assert g.loc[(7, "full"), "diff_vs_baseline"] == pytest.approx(0.4 - 0.3)  # full: (0.3 + 0.5) / 2
    assert g.loc[(2, "full"), "num_runs"] == 2 and g.loc[(2, "full"), "gain_mean"] == pytest.approx(0.4)
    assert g.loc[(2, "baseline"), "collapses"] == 1 and g.loc[(2, "full"), "collapses"] == 0
    # two seeds of gains {0.2, 0.4}: bootstrap means take only the values 0.2, 0.3, 0.4
    assert g.loc[(7, "baseline"), "gain_ci_low"] == pytest.approx(0.2)
    assert g.loc[(7, "baseline"), "gain_ci_high"] == pytest.approx(0.4)
    assert np.isnan(g.loc[(7, "baseline"), "diff_vs_baseline"])


def test_dose_probe_table_reads_each_probes_dose(tmp_path):
    paths = []
    for bits, k3 in ((7, 1e-4), (3, 2e-2)):
        p = tmp_path / f"p{bits}.csv"
        pd.DataFrame([{"model": "x", "engine": "vllm-eager", "variant": v, "level": lvl, "metric": m, "value": val}
                      for v, scale in (("baseline", 1.0), ("full", 0.0))
                      for lvl in ("token", "seq")
                      for m, val in (("mismatch_k3", k3 * scale), ("logp_abs_diff_mean", 0.1 * scale),
                                     ("tokens_exact_frac", 1 - scale), ("chi2", 5.0))]).to_csv(p, index=False)
        p.with_suffix(".json").write_text(json.dumps({"config": {"dose_bits": bits}}))
        paths.append(p)
    t = dose_probe_table(paths)
    assert list(t.columns) == ["dose", "variant", "metric", "value"] and len(t) == 2 * 2 * 3
    assert t[(t.dose == 3) & (t.variant == "baseline") & (t.metric == "k3")]["value"].item() == 2e-2
    assert t[(t.dose == 7) & (t.variant == "full") & (t.metric == "tokens_exact_frac")]["value"].item() == 1.0
    with pytest.raises(ValueError, match="one probe per dose"):
        dose_probe_table(paths + paths[:1])


def test_the_chunks_cover_every_run_of_the_config_once_and_pack_refuses_an_unfinished_chunk(tmp_path, monkeypatch):
    cfg = yaml.safe_load(open("configs/dose.yaml"))
    n_chunks = -(-len(cfg["seeds"]) // dc.CHUNK_SEEDS)
    every = [t for k in range(n_chunks) for t in dc.targets(k)]
    assert len(every) == len(set(every)) == len(cfg["models"]) * len(cfg["variants"]) * len(cfg["seeds"])
    with pytest.raises(SystemExit, match="does not exist"):
        dc.chunk_seeds(n_chunks)
    monkeypatch.setattr(dc, "ROOT", tmp_path)  # an empty tree: nothing of chunk 0 has run
    with pytest.raises(SystemExit, match=r"40 of 40 runs are missing or unfinished"):
        dc.pack(0)


def test_the_preregistered_tests_against_scipy_and_hand_counts():
    rng = np.random.default_rng(1)
    rows = []
    for dose, k in ((7, 0), (4, 1), (3, 2), (2, 3)):
        for v, effect in (("baseline", -0.05 * k), ("rope", -0.02 * k), ("full", 0.0), ("tis", -0.05 * k)):
            for s in range(8):
                rows.append({"dose": dose, "variant": v, "seed": s, "gain": 0.4 + effect + rng.normal(0, 0.02),
                             "collapsed": v == "baseline" and s < k * 2})
    out = pd.DataFrame(rows)
    t = hypothesis_tests(out).set_index(["test", "dose"], drop=False)
    # Welch's test, as scipy computes it, then Holm over the three doses
    a = out[(out.variant == "full") & (out.dose == 2)].gain
    b = out[(out.variant == "baseline") & (out.dose == 2)].gain
    w = t.loc[("welch_full_vs_baseline", 2)]
    assert w["p_value"] == pytest.approx(stats.ttest_ind(a, b, equal_var=False).pvalue)
    assert w["estimate"] == pytest.approx(a.mean() - b.mean()) and w["ci_low"] < w["estimate"] < w["ci_high"]
    ps = sorted(t[t.test == "welch_full_vs_baseline"]["p_value"])
    holm = t[t.test == "welch_full_vs_baseline"]["p_holm"]
    # Holm: the sorted p-values times 3, 2, 1, made monotone, capped at 1
    assert sorted(holm) == pytest.approx(list(np.minimum(1, np.maximum.accumulate([p * (3 - i) for i, p in enumerate(ps)]))))
    # the interaction: full's advantage grows by 0.05 per dose step (the simulated effect)
    inter = t[t.test == "interaction_grows_with_dose"].iloc[0]
    assert inter["estimate"] == pytest.approx(0.05, abs=0.01) and inter["significant"]
    assert t[t.test == "baseline_slope_falls"].iloc[0]["estimate"] == pytest.approx(-0.05, abs=0.01)
    # collapses: baseline 0, 2, 4, 6 of 8 over the doses, full none
    trend = t[t.test == "collapse_trend_baseline"].iloc[0]
    assert trend["estimate"] == 12 and trend["significant"]
    assert t[t.test == "collapse_trend_full"].iloc[0]["p_value"] == 1.0
    v = verdicts(hypothesis_tests(out))
    assert v == {"H1": True, "H2": True, "H3": True, "H4": True}
    # the null: every arm alike, no collapse
    out["gain"] = 0.4 + rng.normal(0, 0.02, len(out))
    out["collapsed"] = False
    assert verdicts(hypothesis_tests(out))["H1"] is False
    assert verdicts(hypothesis_tests(out))["H4"] is False


def test_no_dose_leaves_an_fp32_engine_unrounded():
    # 7 bits is "no dose" in any dtype: an fp32 engine (the fp32 floor of the stress experiment) must not be rounded to
    # bf16's mantissa at the regions. Reference: the stock HF model in fp32, which the fp32 engine matches to fp32
    # noise (measured 1.2e-6 here; rounding the regions to 7 bits made it 1.3e-2)
    model = random_qwen("qwen3", tie=False).float()
    model.config._attn_implementation = "eager"
    ids = torch.tensor(prompts([9]))
    eng = Engine(model, engine="vllm-eager", attn="eager").model
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    assert (eng.forward(ids, eng.new_cache()) - ref).abs().max() < 1e-5
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = torch.randn(64, dtype=dtype)
        assert round_mantissa_st(x, 7) is x
