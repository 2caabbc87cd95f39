"""The mismatch-stress experiment: its new metrics against independent formulas, the Kaplan-Meier estimator and
the share of gap against hand counts, the fp32-head arm, a reduced stress sweep end to end through train +
aggregate, the stress config's dry run, and config errors that name the valid choices."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from roundalign import metrics as M
from roundalign.analysis.aggregate import aggregate
from roundalign.analysis.plots import stress as stress_plots
from roundalign.analysis.plots.stress import SURVIVAL_ROW, plot_dose, plot_gap, plot_survival, wilson_interval
from roundalign.analysis.stress import (_frozen, derived_tables, gap_table, kaplan_meier, rewrite_derived_tables,
                                        survival_table, write_stress_tables)
from roundalign.engine import EngineModel, KVCache
from roundalign.io import atomic_write_csv
from roundalign.models.load import load_model
from roundalign.models.tiny import make_tiny
from roundalign.numerics import apply_alignment
from roundalign.tasks.digits import digits_reward, make_digits_problems
from roundalign.training.config import ConfigError, build_config
from roundalign.training.train import run_train

ROOT = Path(__file__).resolve().parents[1]
QUIET = {"log": lambda *a, **k: None}


# -- metrics ---------------------------------------------------------------------------------------------------

def test_token_mult_prob_error_and_ratio_std_match_independent_formulas():
    train = torch.tensor([[-1.0, -2.0, -0.5, 9.0]])
    engine = torch.tensor([[-1.5, -2.0, -0.25, 0.0]])
    mask = torch.tensor([[True, True, True, False]])
    tok = M.mismatch_metrics(train, engine, mask)["token"]
    # |delta| = 0.5, 0, 0.25 -> NeMo-RL's mean exp(|delta|) = (e^0.5 + 1 + e^0.25) / 3
    assert tok["token_mult_prob_error"].item() == pytest.approx((math.exp(0.5) + 1 + math.exp(0.25)) / 3, rel=1e-12)
    rho = [math.exp(0.5), 1.0, math.exp(-0.25)]
    mean = sum(rho) / 3
    assert tok["is_ratio_std"].item() == pytest.approx(math.sqrt(sum((r - mean) ** 2 for r in rho) / 3), rel=1e-12)
    # mean and RMS |delta logp| in nats (existing keys, reported by the stress tables)
    assert tok["logp_abs_diff_mean"].item() == pytest.approx(0.75 / 3)
    assert tok["logp_diff_rms"].item() == pytest.approx(math.sqrt((0.25 + 0 + 0.0625) / 3))
    # identical logprobs: exactly 1 and 0
    same = M.mismatch_metrics(train, train, mask)["token"]
    assert same["token_mult_prob_error"].item() == 1.0 and same["is_ratio_std"].item() == 0.0


def test_verl_health_flags_use_verls_thresholds():
    def flags(**kw):
        base = {"is_ratio_mean": 1.0, "ess_frac": 1.0, "is_ratio_std": 0.0, "mismatch_k1": 0.0, "mismatch_chi2": 0.0}
        base.update(kw)
        return {k: float(v) for k, v in M.verl_health_flags({k: torch.tensor(v, dtype=torch.float64)
                                                             for k, v in base.items()}).items()}

    assert flags()["any"] == 0.0
    assert flags(is_ratio_mean=0.49)["is_mean"] == 1.0 and flags(is_ratio_mean=2.01)["is_mean"] == 1.0
    assert flags(is_ratio_mean=0.5)["is_mean"] == 0.0 and flags(is_ratio_mean=2.0)["is_mean"] == 0.0
    assert flags(ess_frac=0.29)["ess"] == 1.0 and flags(ess_frac=0.3)["ess"] == 0.0
    assert flags(mismatch_k1=-0.11)["kl"] == 1.0 and flags(mismatch_k1=0.1)["kl"] == 0.0
    assert flags(mismatch_chi2=1.01)["chi2"] == 1.0 and flags(mismatch_chi2=1.0)["chi2"] == 0.0
    assert flags(is_ratio_std=1.5)["is_std"] == 1.0 and flags(is_ratio_std=1.5)["any"] == 1.0


# -- survival and share of gap ----------------------------------------------------------------------------------

def test_kaplan_meier_and_greenwood_match_a_hand_count():
    # 5 runs: events at 3, 3, 7; censored at 5 and 10.
    # t=3: n=5, d=2 -> S = 3/5; t=7: n=2 (5 and 3s gone), d=1 -> S = 3/5 * 1/2 = 0.3
    km = kaplan_meier([3, 3, 5, 7, 10], [1, 1, 0, 1, 0])
    assert km["time"].tolist() == [0.0, 3.0, 7.0]
    assert km["num_at_risk"].tolist() == [5, 5, 2] and km["num_events"].tolist() == [0, 2, 1]
    assert km["survival"].tolist() == pytest.approx([1.0, 0.6, 0.3])
    # Greenwood at t=7: 2/(5*3) + 1/(2*1) = 0.6333; log-log band around 0.3
    gw = 2 / 15 + 1 / 2
    se = math.sqrt(gw) / abs(math.log(0.3))
    z = 1.959963984540054
    assert km["ci_low"].iloc[2] == pytest.approx(0.3 ** math.exp(z * se))
    assert km["ci_high"].iloc[2] == pytest.approx(0.3 ** math.exp(-z * se))
    assert km["ci_low"].iloc[2] < 0.3 < km["ci_high"].iloc[2]
    # no events: one row, S = 1
    assert kaplan_meier([4, 5], [0, 0])["survival"].tolist() == [1.0]


def test_share_of_gap_closed_is_relative_to_baseline_and_the_fp32_floor():
    col = "mismatch_token_logp_abs_diff_mean"
    runs = pd.DataFrame({"base": "m", "dose": 16, "variant": ["baseline", "baseline", "full", "fp32", "rope"],
                         col: [0.010, 0.012, 0.005, 0.001, 0.013]})
    g = gap_table(runs, "mismatch/token/logp_abs_diff_mean").set_index("variant")["share_closed"]
    # delta_baseline = 0.011, floor 0.001: full (0.011-0.005)/0.010 = 0.6; rope (0.011-0.013)/0.010 = -0.2
    assert g["full"] == pytest.approx(0.6) and g["rope"] == pytest.approx(-0.2)
    assert g["baseline"] == 0.0 and g["fp32"] == pytest.approx(1.0)


GAP = "mismatch/token/logp_abs_diff_mean"
GAP_COL = "mismatch_token_logp_abs_diff_mean"


def _arms(**values):
    return pd.DataFrame([{"base": "m", "dose": "d", "variant": v, GAP_COL: x} for v, xs in values.items() for x in xs])


def test_gap_interval_reaching_zero_means_no_gap_to_close():
    # gap = mean(0.010, 0.014) - mean(0.009, 0.013) = 0.001 > 0, but the bootstrap means are baseline in
    # {0.010, 0.012, 0.014} and fp32 in {0.009, 0.011, 0.013}: resampled gaps run from -0.003 to 0.005, so the
    # interval holds 0 and the shares (0.001 in the denominator) are not reported
    g = gap_table(_arms(baseline=[0.010, 0.014], fp32=[0.009, 0.013], full=[0.0095, 0.0105]), GAP)
    assert g["gap"].iloc[0] == pytest.approx(0.001)
    assert g["gap_ci_low"].iloc[0] < 0 < g["gap_ci_high"].iloc[0]
    assert not g["has_gap"].any() and g["share_closed"].isna().all() and g["share_ci_low"].isna().all()
    # a negative gap (baseline below the floor) is no gap either
    g = gap_table(_arms(baseline=[0.010, 0.011, 0.012], fp32=[0.0115, 0.0125, 0.0135], full=[0.01]), GAP)
    assert g["gap"].iloc[0] == pytest.approx(-0.0015) and not g["has_gap"].any()


def test_gap_bootstrap_interval_holds_the_estimate_and_is_seeded():
    rng = np.random.default_rng(7)
    arms = _arms(baseline=0.010 + 0.001 * rng.standard_normal(5), fp32=1e-6 + 1e-7 * rng.standard_normal(5),
                 full=0.006 + 0.001 * rng.standard_normal(5), rope=0.011 + 0.002 * rng.standard_normal(5))
    g = gap_table(arms, GAP, num_resamples=500)
    assert g["has_gap"].all() and (g["gap_ci_low"] > 0).all() and (g["num_runs"] == 5).all()
    t = g.set_index("variant")
    for v in ("full", "rope"):
        assert t.loc[v, "share_ci_low"] <= t.loc[v, "share_closed"] <= t.loc[v, "share_ci_high"], v
        assert t.loc[v, "share_ci_high"] - t.loc[v, "share_ci_low"] > 0.01, v  # 5 noisy runs: a real interval
    # the anchors are exact in every resample: baseline closes 0, the floor all of the gap
    assert (t.loc["baseline", ["share_closed", "share_ci_low", "share_ci_high"]] == 0).all()
    assert t.loc["fp32", ["share_ci_low", "share_ci_high"]].tolist() == pytest.approx([1.0, 1.0])
    assert gap_table(arms, GAP, num_resamples=500).equals(g)  # default_rng(seed): identical run to run
    assert not gap_table(arms, GAP, num_resamples=500, seed=1).equals(g)


def test_derived_tables_rewritten_from_the_committed_runs_table(tmp_path):
    # stress_runs.csv holds floats as repr, so survival and gap recomputed from it are the aggregated ones
    runs = _arms(baseline=[0.0101, 0.0123, 0.0117], fp32=[1.3e-6, 1.1e-6, 0.9e-6], full=[0.0071, 0.0052, 0.0066])
    runs = runs.assign(time=[120, 40, 120, 120, 120, 120, 120, 120, 97], event=[0, 1, 0, 0, 0, 0, 0, 0, 1])
    atomic_write_csv(_frozen(runs), tmp_path / "stress_runs.csv")
    rewrite_derived_tables(tmp_path, **QUIET)
    for name, df in derived_tables(runs, GAP).items():
        expected = tmp_path / f"expected_{name}.csv"
        atomic_write_csv(_frozen(df), expected)
        assert (tmp_path / f"{name}.csv").read_bytes() == expected.read_bytes(), name


# -- stress figures ----------------------------------------------------------------------------------------------

def _stress_runs(events):
    """One row per run: 2 variants x 2 doses x 3 seeds, each run 120 steps long (the configured horizon) unless
    ``events`` gives it an event step (the run trains on, censored at 120 after its event as in the sweep)."""
    rows = []
    for dose in ("auto", "fp8_e4m3"):
        for variant in ("baseline", "fp32"):
            for seed in range(3):
                step = events.get((dose, variant, seed))
                rows.append({"sweep": "syn", "model": f"m-{dose}", "base": "m", "dose": dose, "variant": variant,
                             "seed": seed, "last_step": 120, "event": int(step is not None),
                             "event_kind": "reward" if step else "", "event_step": step or math.nan,
                             "time": step or 120, "reward_collapse_step": step or math.nan,
                             GAP_COL: (0.05 if dose == "fp8_e4m3" else 0.01 * (variant == "baseline")) + 1e-3 * seed,
                             "mismatch_token_k3": 1e-4, "mismatch_token_token_mult_prob_error": 1.0,
                             "verl_violation_frac": 0.0, "reward_first": 0.1, "reward_last": 0.2 + 0.01 * seed})
    return pd.DataFrame(rows)


def test_survival_rows_run_to_the_horizon_with_the_number_at_risk():
    runs = _stress_runs({("auto", "baseline", 0): 40, ("auto", "baseline", 1): 75})  # last event at 75
    fig, axes = plot_survival(survival_table(runs), runs)
    assert [ax.get_title() for ax in axes] == ["dose auto", "dose fp8_e4m3"]
    for ax in axes:
        assert ax.get_xlim()[1] >= 120  # the horizon every run lasted, not the last event (75)
        curves = [line for line in ax.get_lines() if line.get_gid() == "survival"]
        assert [c.get_xdata()[-1] for c in curves] == [120, 120]
        # one row per variant, offset: baseline's S = 1 sits at 1 + ROW, fp32's at ROW, so neither hides the other
        assert [c.get_ydata()[0] for c in curves] == pytest.approx([1 + SURVIVAL_ROW, SURVIVAL_ROW])
    assert [t.get_text() for t in axes[0].get_yticklabels()] == ["baseline", "fp32"]  # rows named once
    ax = axes[0]  # baseline, auto: 3 runs, events at 40 and 75 -> S = 2/3 then 1/3
    baseline = [line for line in ax.get_lines() if line.get_gid() == "survival"][0]
    assert list(baseline.get_ydata()[-2:]) == pytest.approx([1 + SURVIVAL_ROW / 3] * 2)
    at_risk = {t.get_position()[0]: t.get_text() for t in ax.texts
               if t.get_gid() == "at_risk" and t.get_position()[1] > 1}  # baseline's row
    assert at_risk == {0.0: "3", 30.0: "3", 60.0: "2", 90.0: "1", 120.0: "1"}  # time >= tick
    (events,) = [line for line in ax.get_lines() if line.get_gid() == "event"]
    assert list(events.get_xdata()) == [40.0, 75.0]
    assert [t.get_text() for t in ax.texts if t.get_gid() == "final"] == ["0.33"]
    # each row's own y scale, on the right: 0 at the row's base, 1 at its top (baseline's row is the upper one)
    (scale,) = [c for c in axes[-1].child_axes if c.get_gid() == "row_scale"]
    assert list(scale.get_yticks()) == pytest.approx([1, 1 + SURVIVAL_ROW, 0, SURVIVAL_ROW])
    assert [t.get_text() for t in scale.get_yticklabels()] == ["0", "1", "0", "1"]


def test_gap_figure_draws_a_note_where_there_is_no_gap_and_intervals_elsewhere():
    runs = _stress_runs({})
    runs = runs.assign(variant=runs["variant"].where(runs["seed"] != 2, "full"))  # a third arm: full
    gap = gap_table(runs, GAP, num_resamples=200)
    # auto: baseline 0.010-0.011 over fp32 0-0.001, a clear gap; fp8_e4m3: both arms 0.050-0.051, none
    assert gap.groupby("dose")["has_gap"].all().to_dict() == {"auto": True, "fp8_e4m3": False}
    fig, axes = plot_gap(gap, runs)
    auto, fp8 = axes
    assert [t.get_gid() for t in fp8.texts if t.get_gid() == "no_gap"] == ["no_gap"]
    assert not [c for c in fp8.collections if c.get_gid() == "share:full"]  # no ratio over a noise denominator
    assert not [t for t in auto.texts if t.get_gid() == "no_gap"]
    (bars,) = [c for c in auto.collections if c.get_gid() == "share:full"]
    (lo, hi) = bars.get_segments()[0][:, 1]
    share = gap.set_index(["dose", "variant"]).loc[("auto", "full"), "share_closed"]
    assert lo <= share <= hi


def test_dose_figure_has_a_categorical_dose_axis_and_no_line_across_doses():
    runs = _stress_runs({("fp8_e4m3", "fp32", 0): 30})
    fig, axes = plot_dose(runs)
    for ax in axes:
        assert [t.get_text() for t in ax.get_xticklabels()] == ["auto", "fp8_e4m3"]
        data = [line for line in ax.get_lines() if line.get_gid() != "dose_sep"]  # points and caps
        assert all(line.get_linestyle() == "None" for line in data)  # markers only: no line joins the doses
        bars = {c.get_gid(): c for c in ax.collections if (c.get_gid() or "").startswith("dose:")}
        assert sorted(bars) == ["dose:baseline", "dose:fp32"]
        assert [len(b.get_segments()) for b in bars.values()] == [2, 2]  # an interval at each dose
        points = [line for line in data if line.get_marker() == "o"]
        assert points and all(line.get_markerfacecolor() == "none" for line in points)  # intervals show through
    assert axes[0].get_yscale() == "log"
    # 0 of 3 and 1 of 3 runs with an event: Wilson 95% upper bound of 0/3 is z^2 / (3 + z^2) = 0.561
    assert wilson_interval(0, 3)[1] == pytest.approx(1.959963984540054 ** 2 / (3 + 1.959963984540054 ** 2))
    assert wilson_interval(0, 3)[0] == 0.0 and wilson_interval(3, 3)[1] == 1.0


# -- task --------------------------------------------------------------------------------------------------------

def test_digits_task_is_deterministic_with_varying_lengths_and_exact_grading():
    probs = make_digits_problems(50, seed=3, op="reverse", min_len=4, max_len=12, len_step=4)
    assert probs == make_digits_problems(50, seed=3, op="reverse", min_len=4, max_len=12, len_step=4)
    assert {len(p["answer"]) for p in probs} == {4, 8, 12}
    p = probs[0]
    assert p["answer"] == p["prompt"].split()[1].rstrip(":")[::-1]
    # exact: 1; 2 of 4 right then wrong: 0.5; one extra digit: 4/5; nothing: 0
    assert digits_reward([" 1234<eos>", " 1299", " 12345", "x"], ["1234"] * 4) == [1.0, 0.5, 0.8, 0.0]


# -- config errors -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("override, message", [
    ({"variant": "fp32head"}, "full+fp32-head"),
    ({"engine_attn_decode": "flash"}, "eager, sdpa"),
    ({"engine_norm_reduction": "triton"}, "opaque, inductor"),
    ({"task": "digits", "digits_op": "shuffle"}, "copy, reverse, sort"),
    ({"task": "digits", "digits_max_len": 40, "max_completion_length": 20}, "max_completion_length=20"),
    ({"grad_norm_collapse_factor": 0.5}, "must be 0 (off) or > 1"),
    ({"dtype": "fp32"}, "use variant fp32"),
])
def test_bad_stress_settings_name_the_valid_choices(override, message):
    with pytest.raises(ConfigError, match=None) as err:
        build_config(overrides={"model": "m", **override})
    assert message in str(err.value)


def test_fp32_variants_resolve_their_numerics():
    assert build_config(overrides={"model": "m", "variant": "fp32"}).dtype == "fp32"
    c = build_config(overrides={"model": "m", "variant": "full+fp32-head"})
    assert c.alignment == "full" and c.lm_head_fp32 and c.dtype == "bf16"
    c = build_config(overrides={"model": "m", "variant": "fp32-head"})
    assert c.alignment == "baseline" and c.lm_head_fp32


# -- fp32-head arm and the reduced sweep end to end ---------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    return str(make_tiny("qwen3", tmp_path_factory.mktemp("stress") / "q3", hidden=32, layers=2, heads=2,
                         kv_heads=1, tie=True, seed=0))


def test_fp32_head_logits_are_fp32_on_both_sides_and_equal_with_equal_kernels(tiny_qwen3):
    """The trainer side is TRL's own mechanism (GRPOTrainer.__init__ with cast_lm_head_to_fp32: lm_head.float(),
    an fp32 forward, the tied embedding's output cast back); the engine computes an fp32 GEMM of its fp32-cast
    hidden state. With full alignment and equal kernels (eager engine, same GEMMs) the logits are bitwise equal."""
    model = load_model(tiny_qwen3, dtype="bf16", attn="eager")
    apply_alignment(model, "full", "vllm-eager")
    # TRL 1.16's _cast_lm_head_to_fp32 (grpo_trainer.py), applied as the trainer applies it
    original = model.lm_head.weight.dtype
    lm_head = model.lm_head.float()
    model.lm_head = lm_head
    lm_head.forward = lambda h: torch.nn.functional.linear(h.to(torch.float32), lm_head.weight.to(torch.float32))
    model.model.embed_tokens.register_forward_hook(lambda m, a, out: out.to(original))
    engine = EngineModel(model, engine="vllm-eager", lm_head_fp32=True)
    ids = torch.tensor([[5, 17, 33, 2, 9, 100, 7]])
    with torch.no_grad():
        train_logits = model(ids).logits
    engine_logits = engine.forward(ids, KVCache(len(engine.layers)))
    assert train_logits.dtype == torch.float32 and engine_logits.dtype == torch.float32
    assert engine.lm_head.dtype == torch.float32 and engine.dtype == torch.bfloat16
    assert torch.equal(train_logits, engine_logits)


def test_reduced_stress_sweep_runs_end_to_end_and_writes_the_survival_table(tiny_qwen3, tmp_path):
    """1 model x 2 variants (baseline, full+fp32-head) + the fp32 floor, 2 steps, through run_train (the sweep's
    code path) with every engine option of configs/stress.yaml except the compiled engine (compiling takes
    minutes on 2 cores; the compiled path is what the pilot ran), then the stress tables."""
    root = tmp_path / "results/stressmini"
    settings = dict(model=tiny_qwen3, task="digits", digits_min_len=4, digits_max_len=8, digits_len_step=4,
                    max_completion_length=9, steps=2, prompts_per_step=2, num_generations=2, per_device_batch_size=4,
                    engine="vllm-eager", engine_gemm="splitk", splitk_chunk=8, engine_attn_decode="sdpa",
                    engine_kv_cache_dtype="fp8_e4m3",
                    reward_collapse_window=1, reward_collapse_patience=1, grad_norm_collapse_factor=10.0,
                    grad_norm_collapse_min_steps=1, checkpoint_every=100)
    for variant in ("baseline", "full+fp32-head", "fp32"):
        res = run_train(build_config(overrides={**settings, "variant": variant}),
                        root / f"runs/mini/{variant}/seed0", **QUIET)
        assert res.status == "done"
    run = json.loads((root / "runs/mini/full+fp32-head/seed0/run.json").read_text())
    assert "collapse_event" in run and "grad_norm_collapse" in run
    rec = json.loads((root / "runs/mini/baseline/seed0/metrics.jsonl").read_text().splitlines()[0])
    for key in ("mismatch/token/token_mult_prob_error", "mismatch/token/logp_diff_rms", "health/verl_any"):
        assert key in rec
    paths = write_stress_tables(root, root / "aggregate", "engine_kv_cache_dtype", **QUIET)
    surv = pd.read_csv(paths["stress_survival"])
    assert set(surv["variant"]) == {"baseline", "full+fp32-head", "fp32"} and (surv["dose"] == "fp8_e4m3").all()
    runs = pd.read_csv(paths["stress_runs"])
    assert len(runs) == 3 and runs["mismatch_token_token_mult_prob_error"].ge(1).all()
    gap = pd.read_csv(paths["stress_gap"]).set_index("variant")
    assert gap.loc["fp32", "delta"] < gap.loc["baseline", "delta"]
    # the five stress figures from those tables (and the general aggregate's), a categorical dose included
    aggregate(root, root / "aggregate", strict=True, **QUIET)
    made = stress_plots.make(root / "aggregate", tmp_path / "fig", formats=("png",))
    pngs = [p for p in made if p.suffix == ".png"]
    assert sorted(p.stem for p in pngs) == sorted(stress_plots.STEMS) and all(p.stat().st_size > 5000 for p in pngs)
    # the summary table restates the per-run table: one row per variant here, its mismatch the run's
    summary = pd.read_csv(tmp_path / "fig/stress_summary.csv").set_index("variant")
    assert summary["runs"].tolist() == [1, 1, 1] and (summary["dose"] == "fp8_e4m3").all()
    by_variant = runs.set_index("variant")
    assert summary.loc["baseline", "logp_abs_diff_mean"] == pytest.approx(
        by_variant.loc["baseline", "mismatch_token_logp_abs_diff_mean"], rel=1e-12)
    assert summary.loc["fp32", "share_closed"] == pytest.approx(1.0)
    assert "| fp8_e4m3 | baseline | 1 |" in (tmp_path / "fig/stress_summary.md").read_text()


def test_stress_config_dry_run_succeeds():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    res = subprocess.run([sys.executable, "-m", "snakemake", "-n", "-p", "--forceall", "--configfile",
                          "configs/stress.yaml"],
                         cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "stress_figures" in res.stdout and "train" in res.stdout
    # one probe per dose level (they share one policy), each with its dose's KV cache
    for dt in ("auto", "fp8_e4m3", "fp8_e5m2"):
        assert res.stdout.count(f"--kv-cache-dtype {dt} --splitk-chunk 16 --norm-reduction inductor") == 1, dt
