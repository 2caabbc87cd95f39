"""roundalign.analysis.aggregate on small synthetic result trees written into tmp_path (no training)."""

import json
import math
import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch

torch.set_num_threads(1)  # roundalign imports torch; keep CPU tests single-threaded

from roundalign.analysis.aggregate import (ATTRIBUTION_COLUMNS, PROBE_COLUMNS, PROBE_LAYERS_COLUMNS, RUN_STATUS_COLUMNS,
                                           RUNS_COLUMNS, aggregate, collect)
from roundalign.cli import main


def write_run(root: Path, model: str, variant: str, seed: int, records: list[dict], *, status="done",
              collapse=None, reward_collapse=None, run_json: dict | None = None, raw_metrics: str | None = None):
    d = root / "runs" / model / variant / f"seed{seed}"
    d.mkdir(parents=True, exist_ok=True)
    text = raw_metrics if raw_metrics is not None else "".join(json.dumps(r) + "\n" for r in records)
    (d / "metrics.jsonl").write_text(text)
    rec = {"status": status, "last_step": max((r["step"] for r in records), default=0), "collapse": collapse,
           "reward_collapse": reward_collapse, "wall_time_s": 12.5, "variant": variant, "seed": seed,
           "model": f"/work/models/tiny/{model}/policy", "config": {"learning_rate": 1e-3},
           "versions": {"torch": "2.13.0", "transformers": "5.17.0", "trl": "1.16.0"}, "git_sha": "abc123",
           "gpu_name": "H200", "device": "cuda"}
    if run_json is not None:
        rec.update(run_json)
    (d / "run.json").write_text(json.dumps(rec))
    return d


def write_probe(root: Path, model: str, engine: str, rows: list[tuple], layer_rows: list[tuple]):
    d = root / "probe" / model
    d.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows, columns=list(PROBE_COLUMNS[1:])).to_csv(d / f"{engine}.csv", index=False)
    pd.DataFrame(layer_rows, columns=list(PROBE_LAYERS_COLUMNS[1:])).to_csv(d / f"{engine}_layers.csv", index=False)
    (d / f"{engine}.json").write_text("{}")


def steps(n: int, **metrics) -> list[dict]:
    """n records; each metric is a function of the step."""
    return [{"step": s, **{k.replace("__", "/"): f(s) for k, f in metrics.items()}} for s in range(1, n + 1)]


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "smoke"
    # 3 steps x 2 metrics = 6 rows
    write_run(root, "m1", "baseline", 0, steps(3, reward__mean=lambda s: s / 10, k3=lambda s: 1e-4 * s))
    # collapsed at step 2: 2 steps x 2 metrics = 4 rows, one of them null (kept as NaN)
    write_run(root, "m1", "full", 1, [{"step": 1, "reward/mean": 0.5, "optim/grad_norm": 1.0},
                                      {"step": 2, "reward/mean": 0.25, "optim/grad_norm": None}],
              status="collapsed", collapse={"step": 2, "reason": "non-finite optim/grad_norm=nan"},
              reward_collapse={"step": 2, "reason": "rolling mean fell"},
              run_json={"cpu_kernels": {"model": "AMD EPYC 9004", "torch_capability": "AVX512",
                                        "isa": ["avx512f", "avx512_bf16"]},
                        "config": {"attn": "vllm_cpu", "model": "work/models/tiny/m0/policy"}})
    write_probe(root, "m1", "vllm-compiled",
                [("policy", "vllm-compiled", "full", "token", "mismatch_k3", 0.0),
                 ("policy", "vllm-compiled", "baseline", "token", "mismatch_k3", 2.5e-4)],
                [("policy", "vllm-compiled", "baseline", 1, "hidden_rel_err_rms", 0.02),
                 ("policy", "vllm-compiled", "baseline", 0, "hidden_rel_err_rms", 0.01)])
    return root


def test_hand_checked_tables(tree, capsys):
    out = tree / "aggregate"
    aggregate(tree, out)
    runs = pd.read_csv(out / "runs.csv")
    assert tuple(runs.columns) == RUNS_COLUMNS
    assert len(runs) == 3 * 2 + 2 * 2
    assert set(runs["sweep"]) == {"smoke"}  # the results root's name
    # sorted by model, variant, seed, step, metric
    assert list(runs["variant"]) == ["baseline"] * 6 + ["full"] * 4
    base = runs[runs["variant"] == "baseline"]
    assert list(base["metric"][:2]) == ["k3", "reward/mean"]
    assert base[(base["step"] == 3) & (base["metric"] == "reward/mean")]["value"].item() == pytest.approx(0.3)
    assert set(base["status"]) == {"done"}
    full = runs[runs["variant"] == "full"]
    assert set(full["status"]) == {"collapsed"} and set(full["seed"]) == {1}
    assert math.isnan(full[(full["step"] == 2) & (full["metric"] == "optim/grad_norm")]["value"].item())

    status = pd.read_csv(out / "run_status.csv")
    assert tuple(status.columns) == RUN_STATUS_COLUMNS
    assert len(status) == 2
    row = status[status["variant"] == "full"].iloc[0]
    assert (row["status"], row["collapse_step"], row["reward_collapse_step"]) == ("collapsed", 2, 2)
    assert row["collapse_reason"] == "non-finite optim/grad_norm=nan"
    assert (row["torch_version"], row["trl_version"], row["gpu_name"]) == ("2.13.0", "1.16.0", "H200")
    assert pd.isna(status[status["variant"] == "baseline"]["collapse_step"].item())
    # the CPU-kernel record survives the aggregate (the stress sweep commits nothing else), and is absent where
    # the run.json has none
    assert json.loads(row["cpu_kernels"]) == {"model": "AMD EPYC 9004", "torch_capability": "AVX512",
                                              "isa": ["avx512f", "avx512_bf16"]}
    assert pd.isna(status[status["variant"] == "baseline"]["cpu_kernels"].item())
    # the trainer's attention and the policy trained (a base: entry shares its base's directory), where recorded
    assert (row["attn"], row["policy"]) == ("vllm_cpu", "m0")
    assert pd.isna(status[status["variant"] == "baseline"]["attn"].item())

    probe = pd.read_csv(out / "probe.csv")
    assert tuple(probe.columns) == PROBE_COLUMNS
    # the path's model wins over the probe's own label ("policy"); sorted by variant
    assert list(probe["model"]) == ["m1", "m1"] and list(probe["variant"]) == ["baseline", "full"]
    assert list(probe["value"]) == [2.5e-4, 0.0]
    layers = pd.read_csv(out / "probe_layers.csv")
    assert tuple(layers.columns) == PROBE_LAYERS_COLUMNS and list(layers["layer"]) == [0, 1]

    printed = capsys.readouterr()
    assert "2 runs" in printed.out and "0 skipped" in printed.out and "10 run rows" in printed.out
    assert printed.err == ""  # nothing skipped, nothing disagreeing


def test_floats_written_round_trip(tmp_path):
    values = [0.1, 1e-300, 1 / 3, 123456789.125, 2.0, float("inf")]
    write_run(tmp_path, "m", "baseline", 0, [{"step": i, "x": v} for i, v in enumerate(values)])
    aggregate(tmp_path, tmp_path / "agg", log=lambda _: None)
    text = (tmp_path / "agg" / "runs.csv").read_text().splitlines()
    # repr: the shortest text that reads back to the same float
    assert [line.split(",")[6] for line in text[1:]] == ["0.1", "1e-300", "0.3333333333333333", "123456789.125",
                                                         "2.0", "inf"]
    assert list(pd.read_csv(tmp_path / "agg" / "runs.csv")["value"]) == values


def _bad_tree(root: Path) -> list[str]:
    """A good run plus one bad file of each kind; returns the bad paths."""
    write_run(root, "m1", "baseline", 0, steps(3, reward__mean=lambda s: s / 10))
    good = "".join(json.dumps(r) + "\n" for r in steps(3, reward__mean=lambda s: s / 10))
    trunc = write_run(root, "m1", "rope", 0, [], raw_metrics=good + '{"step": 4, "reward/me')  # killed mid-write
    nojson = write_run(root, "m1", "full", 0, steps(2, reward__mean=lambda s: 0.0))
    (nojson / "run.json").unlink()
    write_probe(root, "m1", "vllm-compiled", [("m1", "vllm-compiled", "full", "token", "mismatch_k3", 0.0)], [])
    wrong = root / "probe" / "m1" / "vllm-eager.csv"
    wrong.write_text("model,engine,variant,metric,value\nm1,vllm-eager,full,mismatch_k3,0.0\n")  # no level
    return [str(trunc / "metrics.jsonl"), str(nojson / "run.json"), str(wrong)]


def test_lenient_skips_and_warns_once_listing_every_bad_file(tmp_path, capsys):
    bad = _bad_tree(tmp_path / "r")
    agg = aggregate(tmp_path / "r", tmp_path / "agg")
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "skipped 3 bad file(s)" in err
    for path in bad:
        assert path in err
    assert "line 4: truncated JSON" in err and "missing" in err and "missing level" in err
    # only the good run and the good probe file are in the tables
    status = pd.read_csv(tmp_path / "agg" / "run_status.csv")
    assert list(status["variant"]) == ["baseline"]
    assert set(pd.read_csv(tmp_path / "agg" / "runs.csv")["variant"]) == {"baseline"}
    assert set(pd.read_csv(tmp_path / "agg" / "probe.csv")["engine"]) == {"vllm-compiled"}
    assert [p for p, _ in agg.skipped] == sorted(bad)


def test_strict_fails_naming_every_bad_file(tmp_path, capsys):
    bad = _bad_tree(tmp_path / "r")
    with pytest.raises(ValueError) as exc:
        aggregate(tmp_path / "r", tmp_path / "agg", strict=True)
    for path in bad:
        assert path in str(exc.value)
    assert not (tmp_path / "agg").exists()  # nothing written
    # the CLI: exit 2, every bad file on stderr
    assert main(["aggregate", "--results", str(tmp_path / "r"), "--out", str(tmp_path / "agg"), "--strict"]) == 2
    err = capsys.readouterr().err
    assert "roundalign aggregate: error:" in err and all(path in err for path in bad)


@pytest.mark.parametrize("text, reason", [
    ('{"step": 1, "x": 1}\nnot json\n{"step": 3}\n', "line 2: invalid JSON"),
    ('{"step": 1}\n{"step": 1}\n', "step 1 logged twice"),
    ('{"x": 1}\n', "non-integer 'step'"),
    ('{"step": 1, "phase": "train"}\n', "non-numeric value for phase"),
    ('[1, 2]\n', "expected a JSON object"),
])
def test_each_kind_of_corrupt_metrics_is_named(tmp_path, text, reason):
    write_run(tmp_path, "m", "baseline", 0, [], raw_metrics=text)
    agg = collect(tmp_path)
    assert len(agg.skipped) == 1 and reason in agg.skipped[0][1]


def test_both_bad_files_of_one_run_are_named(tmp_path):
    d = write_run(tmp_path, "m", "baseline", 0, [], raw_metrics="{oops\n")
    (d / "run.json").write_text("{")
    agg = collect(tmp_path)
    assert [Path(p).name for p, _ in agg.skipped] == ["metrics.jsonl", "run.json"]


def test_preempted_kept_and_path_disagreement_warned(tmp_path, capsys):
    write_run(tmp_path, "m1", "rope", 2, steps(2, x=lambda s: 1.0), status="preempted",
              run_json={"variant": "full", "seed": 2, "model": "Org/other"})
    aggregate(tmp_path, tmp_path / "agg", log=lambda _: None)
    status = pd.read_csv(tmp_path / "agg" / "run_status.csv")
    assert (status["variant"].item(), status["status"].item()) == ("rope", "preempted")  # the path wins
    err = capsys.readouterr().err
    assert "variant='full', model='Org/other' disagree" in err  # seed agrees, so it is not named


def test_reruns_and_file_order_give_identical_bytes(tmp_path):
    def build(root, order):
        for variant in order:
            write_run(root, "m1", variant, 0, steps(4, reward__mean=lambda s: s / 7, k3=lambda s: s * 1.1e-5))
        write_probe(root, "m1", "e", [("m1", "e", v, "token", "mismatch_k3", 1 / 3) for v in reversed(order)], [])

    build(tmp_path / "a", ["baseline", "rope", "full"])
    build(tmp_path / "b", ["full", "baseline", "rope"])
    aggregate(tmp_path / "a", tmp_path / "out1", sweep="s", log=lambda _: None)
    aggregate(tmp_path / "a", tmp_path / "out2", sweep="s", log=lambda _: None)
    aggregate(tmp_path / "b", tmp_path / "out3", sweep="s", log=lambda _: None)
    for name in ("runs.csv", "run_status.csv", "probe.csv", "probe_layers.csv"):
        first = (tmp_path / "out1" / name).read_bytes()
        assert first == (tmp_path / "out2" / name).read_bytes() == (tmp_path / "out3" / name).read_bytes(), name


def test_missing_root_and_empty_root(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        collect(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="runs"):
        collect(tmp_path)
    assert main(["aggregate", "--results", str(tmp_path / "nope"), "--out", str(tmp_path / "a")]) == 2


def test_probe_only_sweep_writes_empty_run_tables(tmp_path):
    write_probe(tmp_path, "m1", "e", [("m1", "e", "full", "token", "mismatch_k3", 0.0)], [])
    aggregate(tmp_path, tmp_path / "agg", log=lambda _: None)
    assert (tmp_path / "agg" / "runs.csv").read_text() == ",".join(RUNS_COLUMNS) + "\n"
    assert len(pd.read_csv(tmp_path / "agg" / "probe.csv")) == 1


def test_metrics_option_keeps_only_those_keys_and_names_unknown_ones(tree, capsys):
    out = tree / "aggregate"
    aggregate(tree, out, metrics=("reward/mean",))
    runs = pd.read_csv(out / "runs.csv")
    assert set(runs["metric"]) == {"reward/mean"} and len(runs) == 3 + 2
    assert pd.read_csv(out / "run_status.csv").shape[0] == 2  # per-run tables are not filtered
    before = (out / "runs.csv").read_bytes()
    with pytest.raises(ValueError, match=r"logged reward/mean_typo; logged keys: k3, optim/grad_norm, reward/mean"):
        aggregate(tree, out, metrics=("reward/mean", "reward/mean_typo"))
    assert (out / "runs.csv").read_bytes() == before  # nothing written on the error
    # the CLI spelling
    assert main(["aggregate", "--results", str(tree), "--out", str(out), "--metrics", "k3,reward/mean"]) == 0
    assert set(pd.read_csv(out / "runs.csv")["metric"]) == {"k3", "reward/mean"}


def test_a_real_engine_probes_layer_table_is_named_for_the_emulated_engine_it_compares(tmp_path):
    # probe --backend vllm: <engine>_layers.csv is the trainer vs the EMULATED engine; the real engine's own layers
    # come as <engine>_teacher_forced_layers.csv. An emulated-backend probe keeps the plain engine name.
    layer = [("m1", "e", "full", 0, "hidden_rel_err_rms", 0.0)]
    write_probe(tmp_path, "m1", "e", [("m1", "e", "full", "token", "mismatch_k3", 0.0)], layer)
    write_probe(tmp_path, "m2", "e", [("m2", "e", "full", "token", "mismatch_k3", 0.0)], layer)
    (tmp_path / "probe/m2/e.json").write_text(json.dumps({"backend": "vllm"}))
    pd.DataFrame(layer, columns=list(PROBE_LAYERS_COLUMNS[1:])).to_csv(tmp_path / "probe/m2/e_teacher_forced_layers.csv",
                                                                       index=False)
    # eager mode also writes the emulated engine against the real one per layer: no variant, no aggregate table
    pd.DataFrame([("m2", "e", "sdpa", 0, "hidden_rel_err_rms", 0.0)],
                 columns=["model", "engine", "emulated_attn", "layer", "metric", "value"]).to_csv(
        tmp_path / "probe/m2/e_engine_layers.csv", index=False)
    agg = collect(tmp_path)
    # the tables' own engine column says "e": no disagreement, and nothing skipped
    assert agg.warnings == [] and agg.skipped == []
    aggregate(tmp_path, tmp_path / "agg", log=lambda _: None)
    layers = pd.read_csv(tmp_path / "agg" / "probe_layers.csv")
    assert sorted(zip(layers["model"], layers["engine"])) == [("m1", "e"), ("m2", "e_emulated"),
                                                              ("m2", "e_teacher_forced")]
    assert set(pd.read_csv(tmp_path / "agg" / "probe.csv")["engine"]) == {"e"}


# ----------------------------------------------------------------------------------------- attribution

ATTRIBUTION_FILE_COLUMNS = ["step", "source", "mode", "metric", "value", "ci_low", "ci_high"]


def write_attribution(root: Path, model: str, engine: str, rows: list[tuple] | None = None, text: str | None = None):
    """``roundalign attribute``'s attribution.csv of one model and engine (its rows as the command orders them)."""
    d = root / "attribution" / model / engine
    d.mkdir(parents=True, exist_ok=True)
    if text is not None:
        (d / "attribution.csv").write_text(text)
    else:
        pd.DataFrame(rows, columns=ATTRIBUTION_FILE_COLUMNS).to_csv(d / "attribution.csv", index=False)
    (d / "attribution.json").write_text("{}")
    return d / "attribution.csv"


def attribution_rows(k3_none: float, k3_last: float) -> list[tuple]:
    # the command's order: step 0, then the cumulative steps, then the alone ones (not sorted by step)
    return [(0, "none", "cumulative", "k3", k3_none, k3_none / 2, k3_none * 2),
            (1, "sampling", "cumulative", "k3", k3_none, k3_none / 2, k3_none * 2),
            (1, "sampling", "cumulative", "k3_removed", 0.0, -1e-5, 1e-5),
            (2, "rounding", "cumulative", "k3", k3_last, 0.0, k3_last * 3),
            (2, "rounding", "cumulative", "k3_removed", k3_none - k3_last, 1 / 3, 0.5),
            (1, "sampling", "alone", "k3", k3_none, k3_none / 2, k3_none * 2),
            (2, "rounding", "alone", "k3", 1e-300, 0.0, float("nan"))]


def test_attribution_tables_are_concatenated_with_model_and_engine_columns(tree, capsys):
    write_attribution(tree, "m2", "vllm-eager", attribution_rows(3e-4, 0.0))
    write_attribution(tree, "m1", "vllm-eager", attribution_rows(2e-4, 1e-6))
    write_attribution(tree, "m1", "vllm-compiled", attribution_rows(1e-4, 0.0))
    out = tree / "aggregate"
    agg = aggregate(tree, out)
    assert "3 attributions" in capsys.readouterr().out
    text = (out / "attribution.csv").read_text().splitlines()
    assert text[0] == ",".join(ATTRIBUTION_COLUMNS)
    table = pd.read_csv(out / "attribution.csv")
    assert len(table) == 3 * 7 and set(table["sweep"]) == {"smoke"}
    # models and engines sorted, each attribution's rows in the order the command wrote them (a stable sort)
    assert list(table[["model", "engine"]].drop_duplicates().itertuples(index=False, name=None)) == [
        ("m1", "vllm-compiled"), ("m1", "vllm-eager"), ("m2", "vllm-eager")]
    first = table[(table["model"] == "m1") & (table["engine"] == "vllm-compiled")]
    assert list(first["step"]) == [0, 1, 1, 2, 2, 1, 2] and list(first["mode"][-2:]) == ["alone", "alone"]
    # the numbers as written: repr floats, exact zeros as 0.0, NaN as an empty field
    assert "smoke,m1,vllm-compiled,2,rounding,cumulative,k3,0.0,0.0,0.0" in text
    assert "smoke,m1,vllm-compiled,2,rounding,cumulative,k3_removed,0.0001,0.3333333333333333,0.5" in text
    assert "smoke,m1,vllm-compiled,2,rounding,alone,k3,1e-300,0.0," in text
    assert agg.attribution is not None and list(agg.attribution.columns) == list(ATTRIBUTION_COLUMNS)
    # the general tables are not touched by it
    assert not (set(pd.read_csv(out / "probe.csv")["model"]) & {"m2"})


def test_attribution_rebuilds_byte_identically_whatever_the_file_order(tmp_path):
    def build(root, order):
        write_run(root, "m1", "baseline", 0, steps(2, k3=lambda s: s * 1e-5))
        for model, engine in order:
            write_attribution(root, model, engine, attribution_rows(1 / 7, 1 / 9))

    pairs = [("m1", "e1"), ("m1", "e2"), ("m2", "e1")]
    build(tmp_path / "a", pairs)
    build(tmp_path / "b", list(reversed(pairs)))
    aggregate(tmp_path / "a", tmp_path / "out1", sweep="s", log=lambda _: None)
    aggregate(tmp_path / "a", tmp_path / "out2", sweep="s", log=lambda _: None)
    aggregate(tmp_path / "b", tmp_path / "out3", sweep="s", log=lambda _: None)
    first = (tmp_path / "out1" / "attribution.csv").read_bytes()
    assert first == (tmp_path / "out2" / "attribution.csv").read_bytes() == \
        (tmp_path / "out3" / "attribution.csv").read_bytes()


def test_no_attribution_no_table_and_a_stale_one_is_removed(tree, capsys):
    out = tree / "aggregate"
    agg = aggregate(tree, out, log=lambda _: None)
    assert agg.attribution is None and not (out / "attribution.csv").exists()
    # an earlier aggregate's table, whose attributions are gone, does not outlive them
    write_attribution(tree, "m1", "vllm-eager", attribution_rows(2e-4, 0.0))
    aggregate(tree, out, log=lambda _: None)
    assert (out / "attribution.csv").is_file()

    shutil.rmtree(tree / "attribution")
    aggregate(tree, out, log=lambda _: None)
    assert not (out / "attribution.csv").exists()
    assert (out / "runs.csv").is_file()


@pytest.mark.parametrize("text,reason", [
    ("step,source,mode,metric,value\n0,none,cumulative,k3,1.0\n", "wrong columns: missing ci_low, ci_high"),
    ("step,source,mode,metric,value,ci_low,ci_high\n0,none,cumulative,k3,abc,0,1\n", "non-numeric value 'abc'"),
    ("step,source,mode,metric,value,ci_low,ci_high\nx,none,cumulative,k3,1,0,1\n", "non-integer 'step'"),
])
def test_a_bad_attribution_table_is_named_and_skipped(tree, text, reason, capsys):
    bad = write_attribution(tree, "m1", "vllm-eager", text=text)
    write_attribution(tree, "m1", "vllm-compiled", attribution_rows(2e-4, 0.0))
    agg = aggregate(tree, tree / "aggregate", log=lambda _: None)
    assert agg.skipped == [(str(bad), next(r for p, r in agg.skipped))] and reason in agg.skipped[0][1]
    assert set(agg.attribution["engine"]) == {"vllm-compiled"}
    assert str(bad) in capsys.readouterr().err
    with pytest.raises(ValueError, match="attribution.csv"):
        aggregate(tree, tree / "aggregate2", strict=True, log=lambda _: None)
