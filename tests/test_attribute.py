"""roundalign attribute against the emulated engine (roundalign.probes.attribute): the waterfall ends at k3 = 0
bitwise once every source is equalized, each source's negative control (its equalization undone while its step is
still taken) stops it there, the engine's replayed decode gives back its sampling logprobs bit for bit, the table's
shares add up, and bad input is refused before any work. The real engine: tests/vllm_cpu/test_attribute_real.py."""

import csv
import json
import subprocess
import sys

import pytest
import torch

from roundalign.engine import Engine
from roundalign.models.load import load_model
from roundalign.models.tiny import make_tiny
from roundalign.probes import attribute as A, attribution_stats

torch.set_num_threads(1)

# An engine in which every source the emulated backend has is present: the one-graph compiled engine, split-K GEMMs,
# an fp8 KV cache, eager attention for prefill and sdpa for decode steps, sampling at T = 0.7; the trainer scores
# with sdpa in micro-batches of 3, its LM head in fp32 (TRL's cast_lm_head_to_fp32)
EVERYTHING = dict(engine="vllm-compiled", backend="emulated", engine_gemm="splitk", kv_cache_dtype="fp8_e4m3",
                  engine_attn="eager", engine_attn_decode="sdpa", trainer_lm_head_fp32=True, temperature=0.7,
                  micro_batch=3, num_prompts=6,
                  max_new_tokens=12, num_resamples=200)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny("qwen3", tmp_path_factory.mktemp("attr") / "m", hidden=32, layers=2, tie=False))


def _run(model_dir, out, **over):
    cfg = A.AttributeConfig(model=model_dir, **{**EVERYTHING, **over})
    rows = A.run_attribute(cfg, out, log=lambda *_: None)
    return {(r["step"], r["source"], r["mode"], r["metric"]): r["value"] for r in rows}, rows


def _final(table, metric):
    last = max(step for step, _, mode, _ in table if mode == "cumulative")
    return next(v for (s, _, mode, m), v in table.items() if s == last and mode == "cumulative" and m == metric)


@pytest.fixture(scope="module")
def everything(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("everything")
    return out, *_run(model_dir, out)


def test_every_source_equalized_ends_at_zero_bitwise(everything):
    out, table, rows = everything
    assert table[(0, "none", "cumulative", "k3")] > 1e-5  # there was something to remove
    assert _final(table, "k3") == 0.0 and _final(table, "exact_frac") == 1.0
    assert _final(table, "is_ratio_mean") == 1.0 and _final(table, "is_ratio_max") == 1.0
    order = [s for (step, s, mode, m) in sorted(table) if mode == "cumulative" and m == "k3" and step > 0]
    assert order == list(A.SOURCES)  # every source present, in the documented order
    meta = json.loads((out / "attribution.json").read_text())
    assert all(v["present"] for v in meta["sources"].values()) and meta["undone"] == []
    assert meta["engine_settings"]["attn_decode"] == "sdpa" and meta["num_sequences"] == 6


def test_the_table_is_long_form_and_the_cumulative_shares_add_up(everything):
    out, table, rows = everything
    with open(out / "attribution.csv") as f:
        read = list(csv.DictReader(f))
    assert list(read[0]) == ["step", "source", "mode", "metric", "value", "ci_low", "ci_high"] and len(read) == len(rows)
    assert {r["metric"] for r in read} == {*attribution_stats.METRICS, "k3_removed"}
    removed = sum(v for (s, _, mode, m), v in table.items() if mode == "cumulative" and m == "k3_removed")
    assert removed == pytest.approx(table[(0, "none", "cumulative", "k3")], rel=1e-9)
    for r in rows:  # every value sits in its interval (a point estimate of resampled means: not a strict rule, but
        # with 200 resamples over 6 prompts a value outside its own 95% interval would mean a pairing bug)
        if r["metric"] in ("k3", "abs_dlogp"):
            assert r["ci_low"] <= r["value"] + 1e-18 and r["value"] <= r["ci_high"] + 1e-18, r


@pytest.mark.parametrize("source", A.SOURCES)
def test_negative_control_undoing_a_source_stops_its_step_removing_its_share(everything, model_dir, tmp_path,
                                                                             source):
    # the step is still taken and labelled, but its equalization is skipped: it must then remove exactly nothing,
    # where with it in place it removes something, and the waterfall does not end bitwise
    _, table, _ = everything
    step = A.SOURCES.index(source) + 1
    # with its equalization, the source removes something alone (against nothing equalized); cumulatively too,
    # except batching: once positions start at 0, padding changes no bit here (masked keys get weight exactly 0)
    assert table[(step, source, "alone", "k3_removed")] != 0.0, source
    assert (table[(step, source, "cumulative", "k3_removed")] != 0.0) == (source != "batching"), source
    undone, _ = _run(model_dir, tmp_path, undo=(source,), num_resamples=20)
    for mode in ("cumulative", "alone"):
        assert undone[(step, source, mode, "k3_removed")] == 0.0, (source, mode)
    if source not in ("positions", "batching"):  # each of these two makes the other's end state bitwise here
        assert _final(undone, "exact_frac") < 1.0 and _final(undone, "k3") > 0.0, source


def test_the_engine_replays_its_own_samples_bit_for_bit(model_dir):
    model = load_model(model_dir)
    for kw in ({}, {"attn_decode": "sdpa", "gemm": "splitk", "kv_cache_dtype": "fp8_e4m3"}):
        engine = Engine(model, engine="vllm-compiled", **kw)
        prompts = [[1, 2, 3], [4, 5, 6], [7, 8]]  # two prompt-length groups
        samples = engine.generate(prompts, max_new_tokens=9, temperature=0.8, seed=3, eos_token_id=2)
        replay = engine.score(prompts, [s.completion_ids for s in samples], temperature=0.8, decode=True)
        for s, r in zip(samples, replay):
            assert torch.equal(s.logprobs, r)
        prefill = engine.score(prompts, [s.completion_ids for s in samples], temperature=0.8, decode=False)
        same = all(torch.equal(s.logprobs, p) for s, p in zip(samples, prefill))
        assert same == (not kw)  # decode with another attention kernel than prefill: the decode source


def test_absent_sources_are_named_with_the_reason(model_dir, tmp_path):
    table, _ = _run(model_dir, tmp_path, engine_gemm="same", kv_cache_dtype="auto", engine_attn="sdpa",
                    engine_attn_decode=None, trainer_attn="sdpa", trainer_lm_head_fp32=False, num_resamples=20)
    meta = json.loads((tmp_path / "attribution.json").read_text())
    why = {s: v["why_absent"] for s, v in meta["sources"].items()}
    assert "--engine-gemm same" in why["gemm"] and "kv_cache_dtype auto" in why["kv_cache"]
    assert "already runs the engine's attention (sdpa)" in why["attention"]
    assert "already runs in the engine's precision (bf16)" in why["lm_head"]
    assert {s for (_, s, _, _) in table} == {"none", "sampling", "decode", "positions", "batching", "rounding"}
    assert _final(table, "k3") == 0.0


@pytest.mark.parametrize("args,culprit", [
    (["--backend", "emulated", "--engine", "vllm-turbo"], "vllm-turbo"),
    (["--backend", "emulated", "--sources", "rounding,magic"], "magic"),
    (["--backend", "emulated", "--top-p", "0.9"], "top_p=0.9 is not used"),
    (["--backend", "gpu"], "gpu"),
])
def test_bad_input_is_refused_before_any_work(tmp_path, args, culprit):
    res = subprocess.run([sys.executable, "-m", "roundalign", "attribute", "--model", str(tmp_path / "nowhere"),
                          "--out", str(tmp_path / "o"), *args], capture_output=True, text=True)
    assert res.returncode != 0 and culprit in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not (tmp_path / "o").exists()
