"""Tests for roundalign.metrics: hand-derived values, invariances, dtypes, validation."""

import math
from decimal import Decimal, getcontext

import pytest
import torch

from roundalign.metrics import (
    METRIC_NAMES_SEQUENCE,
    METRIC_NAMES_TOKEN,
    flatten_metrics,
    mismatch_metrics,
    verl_health_flags,
)

torch.set_num_threads(1)

LN2 = math.log(2.0)


def _log(vals, dtype=torch.float64):
    return torch.log(torch.tensor(vals, dtype=torch.float64)).to(dtype)


def _close(actual: torch.Tensor, expected: float, rel: float = 1e-12, abs_: float = 1e-15) -> None:
    assert actual.dtype == torch.float64 and actual.dim() == 0
    assert actual.item() == pytest.approx(expected, rel=rel, abs=abs_)


# ---------------------------------------------------------------- hand-derived values


def test_two_token_example_token_level():
    # train p = (0.5, 0.25), engine p = (0.25, 0.25)
    # delta = (ln 0.5 - ln 0.25, 0) = (ln2, 0);  rho = (2, 1)
    # |delta| mean = ln2/2, max = ln2;  rms = sqrt(ln2^2 / 2) = ln2/sqrt2;  signed mean = ln2/2
    # k1 = mean(-delta) = -ln2/2
    # k3 = mean(rho - 1 - delta) = ((2 - 1 - ln2) + (1 - 1 - 0)) / 2 = (1 - ln2)/2
    # chi2 = mean(rho^2) - 1 = (4 + 1)/2 - 1 = 1.5
    # rho min 1, max 2, mean 1.5; clip 1.5 -> band [2/3, 1.5], only rho=2 outside -> 0.5
    # ESS: w = (2/3, 1/3) -> 1 / (2 * (4/9 + 1/9)) = 9/10
    # ppl_train = exp(-(ln .5 + ln .25)/2) = exp(1.5 ln2) = 2^1.5; ppl_engine = exp(2 ln2) = 4
    # exact: token 2 (ln .25 == ln .25) only -> 0.5
    train = _log([[0.5, 0.25]])
    engine = _log([[0.25, 0.25]])
    mask = torch.tensor([[True, True]])
    tok = mismatch_metrics(train, engine, mask, is_clip=1.5)["token"]
    _close(tok["logp_abs_diff_mean"], LN2 / 2)
    _close(tok["logp_abs_diff_max"], LN2)
    _close(tok["logp_diff_rms"], LN2 / math.sqrt(2))
    _close(tok["logp_diff_mean"], LN2 / 2)
    _close(tok["mismatch_k1"], -LN2 / 2)
    _close(tok["mismatch_k3"], (2 - 1 - LN2) / 2)
    _close(tok["mismatch_chi2"], (4 + 1) / 2 - 1)
    _close(tok["is_ratio_min"], 1.0)
    _close(tok["is_ratio_max"], 2.0)
    _close(tok["is_ratio_mean"], 1.5)
    _close(tok["is_ratio_outside_frac"], 0.5)
    _close(tok["ess_frac"], 0.9)
    _close(tok["ppl_train"], 2**1.5)
    _close(tok["ppl_engine"], 4.0)
    _close(tok["tokens_exact_frac"], 0.5)
    _close(tok["num_tokens"], 2.0)
    assert "k3_over_entropy" not in tok
    # default clip 2.0: band [0.5, 2] is closed, rho = 2 is inside.
    assert mismatch_metrics(train, engine, mask)["token"]["is_ratio_outside_frac"].item() == 0.0


def test_sequence_level_sums_per_sequence():
    # B=2, T=3. Row 0: all three tokens masked, train == engine = ln .5 -> deltas (0, 0, 0).
    # Row 1: first two masked, train ln .5, engine ln .25 -> deltas (ln2, ln2); the third
    # position is masked out and holds large garbage that must not be read.
    # Tokens (N=5): delta = (0, 0, 0, ln2, ln2), rho = (1, 1, 1, 2, 2)
    #   |d| mean = 2ln2/5, max ln2, rms = sqrt(2 ln2^2 / 5) = ln2 sqrt(.4), mean 2ln2/5, k1 -2ln2/5
    #   k3 = 2 (2 - 1 - ln2) / 5, chi2 = (3 + 4 + 4)/5 - 1 = 6/5, rho min 1 max 2 mean 7/5
    #   ESS = (sum rho)^2 / (N sum rho^2) = 49 / (5 * 11) = 49/55
    #   ppl_train = exp(ln2) = 2; ppl_engine = exp((3 ln2 + 4 ln2)/5) = 2^(7/5); exact 3/5
    # Sequences (S=2): delta_seq = (0, 2 ln2), rho_seq = (1, 4)
    #   |d| mean ln2, max 2ln2, rms = sqrt(4 ln2^2 / 2) = ln2 sqrt2, mean ln2, k1 -ln2
    #   k3 = (0 + (4 - 1 - 2 ln2)) / 2, chi2 = (1 + 16)/2 - 1 = 7.5, rho min 1 max 4 mean 2.5
    #   clip 2 -> band [.5, 2]: 4 outside -> 0.5;  ESS = (1 + 4)^2 / (2 (1 + 16)) = 25/34
    #   per-seq mean logp: train (-ln2, -ln2) -> ppl 2; engine (-ln2, -2ln2) -> ppl 2^1.5
    #   exact sequences: row 0 only -> 0.5
    train = _log([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]])
    engine = _log([[0.5, 0.5, 0.5], [0.25, 0.25, 0.5]])
    train[1, 2] = -1e4
    engine[1, 2] = 3e3
    mask = torch.tensor([[True, True, True], [True, True, False]])
    out = mismatch_metrics(train, engine, mask, is_clip=2.0)
    tok, seq = out["token"], out["sequence"]

    _close(tok["logp_abs_diff_mean"], 2 * LN2 / 5)
    _close(tok["logp_abs_diff_max"], LN2)
    _close(tok["logp_diff_rms"], LN2 * math.sqrt(0.4))
    _close(tok["logp_diff_mean"], 2 * LN2 / 5)
    _close(tok["mismatch_k1"], -2 * LN2 / 5)
    _close(tok["mismatch_k3"], 2 * (1 - LN2) / 5)
    _close(tok["mismatch_chi2"], 6 / 5)
    _close(tok["is_ratio_min"], 1.0)
    _close(tok["is_ratio_max"], 2.0)
    _close(tok["is_ratio_mean"], 7 / 5)
    _close(tok["is_ratio_outside_frac"], 0.0)
    _close(tok["ess_frac"], 49 / 55)
    _close(tok["ppl_train"], 2.0)
    _close(tok["ppl_engine"], 2 ** (7 / 5))
    _close(tok["tokens_exact_frac"], 3 / 5)
    _close(tok["num_tokens"], 5.0)

    _close(seq["logp_abs_diff_mean"], LN2)
    _close(seq["logp_abs_diff_max"], 2 * LN2)
    _close(seq["logp_diff_rms"], LN2 * math.sqrt(2))
    _close(seq["logp_diff_mean"], LN2)
    _close(seq["mismatch_k1"], -LN2)
    _close(seq["mismatch_k3"], (4 - 1 - 2 * LN2) / 2)
    _close(seq["mismatch_chi2"], 7.5)
    _close(seq["is_ratio_min"], 1.0)
    _close(seq["is_ratio_max"], 4.0)
    _close(seq["is_ratio_mean"], 2.5)
    _close(seq["is_ratio_outside_frac"], 0.5)
    _close(seq["ess_frac"], 25 / 34)
    _close(seq["ppl_train"], 2.0)
    _close(seq["ppl_engine"], 2**1.5)
    _close(seq["seqs_exact_frac"], 0.5)
    _close(seq["num_seqs"], 2.0)


def test_sequences_without_tokens_are_excluded():
    train = _log([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]])
    engine = _log([[0.5, 0.5, 0.5], [0.25, 0.25, 0.5]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    ref = flatten_metrics(mismatch_metrics(train, engine, mask))
    # Add a third row with no completion token and wild values: nothing may change.
    train3 = torch.cat([train, torch.tensor([[-7e3, 5.0, float("nan")]], dtype=torch.float64)])
    engine3 = torch.cat([engine, torch.tensor([[4e3, float("-inf"), 1.0]], dtype=torch.float64)])
    mask3 = torch.cat([mask, torch.zeros(1, 3, dtype=torch.bool)])
    got = flatten_metrics(mismatch_metrics(train3, engine3, mask3))
    assert got == ref
    assert got["sequence/num_seqs"] == 2.0


def test_identical_inputs_are_exactly_zero_mismatch():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        logp = (-5 * torch.rand(3, 7, generator=g)).to(dtype)
        mask = torch.rand(3, 7, generator=g) < 0.7
        mask[0, 0] = True
        out = mismatch_metrics(logp, logp.clone(), mask, entropy=torch.ones(3, 7))
        for level in ("token", "sequence"):
            m = out[level]
            for k in ("mismatch_k1", "mismatch_k3", "mismatch_chi2", "logp_abs_diff_max", "logp_diff_rms"):
                assert m[k].item() == 0.0, (dtype, level, k)
            for k in ("is_ratio_min", "is_ratio_mean", "is_ratio_max", "ess_frac"):
                assert m[k].item() == 1.0, (dtype, level, k)
            assert m["is_ratio_outside_frac"].item() == 0.0
        assert out["token"]["tokens_exact_frac"].item() == 1.0
        assert out["sequence"]["seqs_exact_frac"].item() == 1.0
        assert out["token"]["k3_over_entropy"].item() == 0.0


def test_masked_out_tokens_do_not_affect_results():
    g = torch.Generator().manual_seed(1)
    train = -3 * torch.rand(4, 6, generator=g)
    engine = train + 0.1 * torch.randn(4, 6, generator=g)
    mask = torch.rand(4, 6, generator=g) < 0.6
    mask[:, 0] = True
    ent = torch.rand(4, 6, generator=g) + 0.5
    ref = flatten_metrics(mismatch_metrics(train, engine, mask, entropy=ent))
    t2, e2, ent2 = train.clone(), engine.clone(), ent.clone()
    t2[~mask] = -1e4
    e2[~mask] = 2e4
    ent2[~mask] = 1e6
    got = flatten_metrics(mismatch_metrics(t2, e2, mask, entropy=ent2))
    assert got == ref


def test_entropy_ratio_and_flatten():
    # Same two tokens as the first test: k3 = (1 - ln2)/2; entropy mean over masked = (1 + 3)/2 = 2
    # (the masked-out 100.0 is ignored) -> k3_over_entropy = (1 - ln2)/4.
    train = _log([[0.5, 0.25, 0.5]], torch.float32)
    engine = _log([[0.25, 0.25, 0.5]], torch.float32)
    mask = torch.tensor([[True, True, False]])
    ent = torch.tensor([[1.0, 3.0, 100.0]])
    out = mismatch_metrics(train, engine, mask, entropy=ent)
    assert out["token"]["k3_over_entropy"].item() == pytest.approx(
        out["token"]["mismatch_k3"].item() / 2, rel=1e-15
    )
    assert out["token"]["k3_over_entropy"].item() == pytest.approx((1 - LN2) / 4, rel=1e-6)  # fp32 inputs

    flat = flatten_metrics(out)
    assert list(flat) == [f"token/{k}" for k in METRIC_NAMES_TOKEN] + [
        f"sequence/{k}" for k in METRIC_NAMES_SEQUENCE
    ]
    assert all(type(v) is float for v in flat.values())
    assert flat["token/mismatch_k3"] == out["token"]["mismatch_k3"].item()
    # Without entropy the optional key is simply absent; order of the rest is unchanged.
    flat2 = flatten_metrics(mismatch_metrics(train, engine, mask))
    assert list(flat2) == [k for k in flat if k != "token/k3_over_entropy"]


# ---------------------------------------------------------------- dtypes and precision


def test_bf16_one_ulp_apart_is_not_exact():
    train = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.bfloat16)
    # Bump the bit pattern of the middle value by one: -2.0 -> -2.015625 (bf16 ulp at 2 is 2^-6).
    engine = train.clone()
    bits = engine.view(torch.int16)
    bits[0, 1] += 1
    assert engine[0, 1].item() == -2.015625
    mask = torch.ones(1, 3, dtype=torch.bool)
    out = mismatch_metrics(train, engine, mask)
    _close(out["token"]["tokens_exact_frac"], 2 / 3)
    _close(out["sequence"]["seqs_exact_frac"], 0.0)
    _close(out["token"]["logp_abs_diff_max"], 2.0**-6)  # delta = -2 + 2.015625, exact in float64


def _k3_exact(d: float) -> float:
    """exp(d) - 1 - d for a float64 d, via its Taylor series in 50-digit Decimal arithmetic."""
    getcontext().prec = 50
    x = Decimal(d)
    return float(sum(x**n / math.factorial(n) for n in range(2, 14)))


@pytest.mark.parametrize("engine_value, rel", [(-1.0001, 1e-11), (-1.00001, 1e-10)])
def test_tiny_fp32_delta_k3_is_accurate(engine_value, rel):
    # delta ~ 1e-4 (resp. 1e-5) between fp32 inputs: k3 ~ delta^2/2 ~ 5e-9 (5e-11). The fp32 values
    # widened to float64 give the exact delta; the true k3 comes from a high-precision series.
    # expm1(d) - d in float64 is good to ~2 eps64 / d (~4e-12, 4e-11); exp(d) - 1 - d in float64 is
    # off by ~3e-10 (1e-6) relative, and in fp32 it is pure rounding noise.
    train = torch.tensor([[-1.0]], dtype=torch.float32)
    engine = torch.tensor([[engine_value]], dtype=torch.float32)
    d = float(train) - float(engine)
    expected = _k3_exact(d)
    k3 = mismatch_metrics(train, engine, torch.ones(1, 1, dtype=torch.bool))["token"]["mismatch_k3"]
    assert k3.item() == pytest.approx(expected, rel=rel, abs=0)
    assert (math.exp(d) - 1 - d) != pytest.approx(expected, rel=rel, abs=0)  # the naive float64 formula
    d32 = train - engine
    naive32 = (torch.exp(d32) - 1 - d32).item()
    assert abs(naive32 - expected) > 0.1 * expected  # why the module works in float64


def test_large_sequence_log_ratios_do_not_break_ess():
    # Row 0: 400 tokens each with delta = 2 -> delta_seq = 800, rho_seq = e^800 overflows float64.
    # Row 1: 400 exact tokens -> delta_seq = 0. ESS = (sum rho)^2 / (N sum rho^2); dividing rho by
    # its max gives (1 + e^-800)^2 / (2 (1 + e^-1600)) = 1/2 exactly in float64.
    # Tokens: 400 with rho = e^2, 400 with rho = 1 -> ESS = (e^2 + 1)^2 / (2 (e^4 + 1)).
    train = torch.zeros(2, 400, dtype=torch.float64)
    engine = torch.zeros(2, 400, dtype=torch.float64)
    engine[0] = -2.0
    out = mismatch_metrics(train, engine, torch.ones(2, 400, dtype=torch.bool))
    e2 = math.exp(2.0)
    _close(out["token"]["ess_frac"], (e2 + 1) ** 2 / (2 * (e2 * e2 + 1)))
    assert out["sequence"]["ess_frac"].item() == 0.5
    _close(out["sequence"]["logp_abs_diff_max"], 800.0)
    assert math.isinf(out["sequence"]["is_ratio_max"].item())  # the true ratio overflows; reported as inf


def _reference(train, engine, mask, entropy, is_clip):
    """Slow, obviously-correct Python reference (float64 via Python floats, fsum for sums)."""
    B, T = mask.shape
    tl, el, ml = train.tolist(), engine.tolist(), mask.tolist()  # tolist widens exactly
    en = entropy.tolist()

    def stats(ds):
        n = len(ds)
        rho = [math.exp(x) for x in ds]
        w = [r / math.fsum(rho) for r in rho]
        return {
            "logp_abs_diff_mean": math.fsum(abs(x) for x in ds) / n,
            "logp_abs_diff_max": max(abs(x) for x in ds),
            "logp_diff_rms": math.sqrt(math.fsum(x * x for x in ds) / n),
            "logp_diff_mean": math.fsum(ds) / n,
            "mismatch_k1": math.fsum(-x for x in ds) / n,
            "mismatch_k3": math.fsum(math.expm1(x) - x for x in ds) / n,
            "mismatch_chi2": math.fsum(math.expm1(2 * x) for x in ds) / n,
            "is_ratio_min": min(rho),
            "is_ratio_mean": math.fsum(rho) / n,
            "is_ratio_max": max(rho),
            "is_ratio_outside_frac": sum(1 for r in rho if r < 1 / is_clip or r > is_clip) / n,
            "ess_frac": 1.0 / (n * math.fsum(x * x for x in w)),
        }

    toks, seqs = [], []
    for b in range(B):
        idx = [t for t in range(T) if ml[b][t]]
        for t in idx:
            toks.append((tl[b][t], el[b][t], en[b][t]))
        if idx:
            seqs.append([(tl[b][t], el[b][t]) for t in idx])

    tok = stats([a - b for a, b, _ in toks])
    ratios = [math.exp(a - b) for a, b, _ in toks]
    mean_ratio = math.fsum(ratios) / len(ratios)
    tok["is_ratio_std"] = math.sqrt(math.fsum((r - mean_ratio) ** 2 for r in ratios) / len(ratios))
    tok["token_mult_prob_error"] = math.fsum(math.exp(abs(a - b)) for a, b, _ in toks) / len(toks)
    tok["ppl_train"] = math.exp(-math.fsum(a for a, _, _ in toks) / len(toks))
    tok["ppl_engine"] = math.exp(-math.fsum(b for _, b, _ in toks) / len(toks))
    tok["tokens_exact_frac"] = sum(1 for a, b, _ in toks if a == b) / len(toks)
    tok["k3_over_entropy"] = tok["mismatch_k3"] / (math.fsum(h for _, _, h in toks) / len(toks))
    tok["num_tokens"] = float(len(toks))

    seq = stats([math.fsum(a - b for a, b in s) for s in seqs])
    seq["ppl_train"] = math.exp(-math.fsum(math.fsum(a for a, _ in s) / len(s) for s in seqs) / len(seqs))
    seq["ppl_engine"] = math.exp(-math.fsum(math.fsum(b for _, b in s) / len(s) for s in seqs) / len(seqs))
    seq["seqs_exact_frac"] = sum(1 for s in seqs if all(a == b for a, b in s)) / len(seqs)
    seq["num_seqs"] = float(len(seqs))
    return {"token": tok, "sequence": seq}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_naive_reference(dtype):
    g = torch.Generator().manual_seed({torch.float32: 10, torch.bfloat16: 11, torch.float16: 12}[dtype])
    B, T = 5, 11
    train = (-4 * torch.rand(B, T, generator=g)).to(dtype)
    engine = (train.float() + 0.05 * torch.randn(B, T, generator=g)).to(dtype)
    same = torch.rand(B, T, generator=g) < 0.3
    engine[same] = train[same]  # some bitwise-equal tokens
    engine[1] = train[1]  # and a fully exact sequence
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[1, :4] = True
    mask[3] = False  # a sequence with no completion token
    ent = torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    is_clip = 1.03  # narrow, so the outside fraction is neither 0 nor 1

    out = mismatch_metrics(train, engine, mask, entropy=ent.to(dtype), is_clip=is_clip)
    ref = _reference(train, engine, mask, ent.to(dtype), is_clip)
    for level in ("token", "sequence"):
        assert set(out[level]) == set(ref[level])
        for k, v in ref[level].items():
            got = out[level][k]
            assert got.dtype == torch.float64 and got.dim() == 0
            assert got.item() == pytest.approx(v, rel=1e-12, abs=0), (level, k)
    # The random draw really exercises the interesting branches.
    assert 0 < ref["token"]["tokens_exact_frac"] < 1
    assert 0 < ref["sequence"]["seqs_exact_frac"] < 1
    assert 0 < ref["token"]["is_ratio_outside_frac"] < 1
    assert ref["sequence"]["num_seqs"] == B - 1


def test_result_structure_and_no_grad():
    train = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    engine = torch.tensor([[-1.5, -2.0]])
    out = mismatch_metrics(train, engine, torch.tensor([[True, True]]))
    assert tuple(out) == ("token", "sequence")
    assert tuple(out["token"]) == tuple(k for k in METRIC_NAMES_TOKEN if k != "k3_over_entropy")
    assert tuple(out["sequence"]) == METRIC_NAMES_SEQUENCE
    for m in out.values():
        for v in m.values():
            assert isinstance(v, torch.Tensor) and v.dtype == torch.float64 and v.dim() == 0
            assert not v.requires_grad


# ---------------------------------------------------------------- validation


def test_shape_mismatch_names_shapes():
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(2, 4\)"):
        mismatch_metrics(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"mask=\(3, 2\)"):
        mismatch_metrics(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(3, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"entropy=\(2, 2\)"):
        mismatch_metrics(
            torch.zeros(2, 3),
            torch.zeros(2, 3),
            torch.ones(2, 3, dtype=torch.bool),
            entropy=torch.zeros(2, 2),
        )
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        mismatch_metrics(torch.zeros(3), torch.zeros(3), torch.ones(3, dtype=torch.bool))


def test_mask_must_be_bool():
    with pytest.raises(ValueError, match="bool"):
        mismatch_metrics(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="bool"):
        mismatch_metrics(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.long))


def test_logp_must_be_float():
    with pytest.raises(ValueError, match="floating"):
        mismatch_metrics(
            torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
        )


def test_empty_mask_rejected():
    with pytest.raises(ValueError, match="no tokens"):
        mismatch_metrics(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.bool))


@pytest.mark.parametrize("clip", [0.5, float("inf"), float("nan"), "2"])
def test_bad_is_clip_rejected(clip):
    with pytest.raises(ValueError, match="is_clip"):
        mismatch_metrics(
            torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), is_clip=clip
        )


def test_health_flag_any_raises_on_chi2_alone():
    """Token deltas of +-0.75 violate verl's chi2 check (mean(rho^2) - 1 = 1.35 > 1) and no other: IS mean 1.29,
    std 0.82, ESS 0.71, k1 0. ``any`` must still be raised (guards against a mutation that leaves chi2 out of it)."""
    delta = torch.tensor([[0.75, -0.75] * 8], dtype=torch.float64)
    engine = torch.full_like(delta, -1.0)
    tok = mismatch_metrics(engine + delta, engine, torch.ones_like(delta, dtype=torch.bool))["token"]
    flags = {k: float(v) for k, v in verl_health_flags(tok).items()}
    assert flags == {"is_mean": 0.0, "ess": 0.0, "is_std": 0.0, "kl": 0.0, "chi2": 1.0, "any": 1.0}, flags
    assert float(tok["mismatch_chi2"]) == pytest.approx(math.cosh(1.5) - 1)


# --------------------------------------------------------------------------------------------------------------
# exact behaviours at the edges: each verl flag alone and its strict threshold; the validation messages


F64 = torch.float64


def _token(**kw):
    base = {"is_ratio_mean": 1.0, "ess_frac": 1.0, "is_ratio_std": 0.0, "mismatch_k1": 0.0, "mismatch_chi2": 0.0}
    return {k: torch.tensor(v, dtype=F64) for k, v in {**base, **kw}.items()}


@pytest.mark.parametrize("kw,flag", [
    ({"is_ratio_mean": 0.49}, "is_mean"), ({"is_ratio_mean": 2.01}, "is_mean"), ({"ess_frac": 0.29}, "ess"),
    ({"is_ratio_std": 1.01}, "is_std"), ({"mismatch_k1": -0.11}, "kl"), ({"mismatch_k1": 0.11}, "kl"),
    ({"mismatch_chi2": 1.01}, "chi2"),
    # each threshold itself is healthy (verl warns strictly beyond it)
    ({"is_ratio_mean": 0.5}, None), ({"is_ratio_mean": 2.0}, None), ({"ess_frac": 0.3}, None),
    ({"is_ratio_std": 1.0}, None), ({"mismatch_k1": -0.1}, None), ({"mismatch_chi2": 1.0}, None)])
def test_each_verl_flag_alone_sets_any_and_thresholds_are_strict(kw, flag):
    flags = verl_health_flags(_token(**kw))
    assert all(v.dtype == F64 for v in flags.values())
    want = {k: float(k == flag) for k in ("is_mean", "ess", "is_std", "kl", "chi2")}
    assert {k: float(v) for k, v in flags.items()} == {**want, "any": float(flag is not None)}


def test_mismatch_metrics_errors_name_the_input_and_an_is_clip_of_one_is_allowed():
    t = torch.zeros(2, 3)
    m = torch.ones(2, 3, dtype=torch.bool)
    cases = [
        (([[0.0]], t, m), "train_logp must be a torch.Tensor, got list"),
        ((t, [[0.0]], m), "engine_logp must be a torch.Tensor, got list"),
        ((t, torch.zeros(2, 3, dtype=torch.int64), m), "engine_logp must be a floating-point tensor, got dtype torch.int64"),
        ((torch.zeros(2, 3, dtype=torch.int32), t, m), "train_logp must be a floating-point tensor, got dtype torch.int32"),
        ((t, t, m.float()), r"mask must be a torch.bool tensor \(True = completion token\), got torch.float32"),
        ((t, t, [[True]]), r"mask must be a torch.bool tensor \(True = completion token\), got list"),
        ((t, torch.zeros(2, 4), m), r"input shapes must all match \(B, T\): train_logp=\(2, 3\), engine_logp=\(2, 4\), "
                                    r"mask=\(2, 3\)$"),
        ((t, t, ~m), r"^mask selects no tokens: mismatch metrics need at least one completion token \(mask shape \(2, 3\)\)$"),
    ]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            mismatch_metrics(*args)
    with pytest.raises(ValueError, match=r"entropy must be a torch.Tensor, got str"):
        mismatch_metrics(t, t, m, entropy="high")
    with pytest.raises(ValueError, match=r"input shapes must all match \(B, T\): .*mask=\(2, 3\), entropy=\(3,\)$"):
        mismatch_metrics(t, t, m, entropy=torch.zeros(3))
    # is_clip = 1: the band is [1, 1]; a ratio of exactly 1 is inside it, any other ratio outside
    out = mismatch_metrics(t, torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.5, -0.5]]), m, is_clip=1.0)["token"]
    assert out["is_ratio_outside_frac"].item() == 2 / 6
