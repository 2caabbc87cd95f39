"""roundalign.analysis.plots on a small synthetic aggregate written into tmp_path (no training).

The aggregate: models m1, m2; variants baseline, full; seeds 0, 1; 20 steps, except m1/baseline/seed1,
which collapsed at step 15. Values are simple functions of the step so summaries can be checked by hand:
reward/mean = step/20 + 0.01*seed; k3 = 1e-4*step for baseline and exactly 0 for full.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import seaborn as sns
import torch
from matplotlib.figure import Figure
from matplotlib.transforms import Bbox

torch.set_num_threads(1)  # roundalign imports torch; keep CPU tests single-threaded

from roundalign.analysis.aggregate import ATTRIBUTION_COLUMNS, RUN_STATUS_COLUMNS, Aggregate, write_aggregate
from roundalign.analysis.plots import (CAPTIONS, FIGURES, OPTIONAL_FIGURES, _grid, _logaxis, _save, _steps, _style,
                                       dose, make_all, make_sweeps, stress)
from roundalign.analysis.plots._tables import Tables, load_table
from roundalign.analysis.plots.fig_attn import arm_table, plot_attn
from roundalign.analysis.plots.fig_attribution import draw_waterfall, plot_attribution, share
from roundalign.analysis.plots.fig_is_ratio import plot_is_ratio
from roundalign.analysis.plots.fig_k3 import plot_k3
from roundalign.analysis.plots.fig_probe import plot_probe
from roundalign.analysis.plots.summary import final_mean, learning
from roundalign.cli import main
from roundalign.training.config import TRAIN_VARIANTS

ROOT = Path(__file__).resolve().parents[1]
STEPS = 20
COLLAPSE_STEP = 15
IMAGE_STEMS = ["fig_reward", "fig_k3", "fig_is_ratio", "fig_logp_diff", "fig_probe", "fig_attn"]


def _tables(with_is_ratio=True, with_probe=True) -> Aggregate:
    rows, status = [], []
    for model in ("m1", "m2"):
        for variant in ("baseline", "full"):
            for seed in (0, 1):
                collapsed = (model, variant, seed) == ("m1", "baseline", 1)
                last = COLLAPSE_STEP if collapsed else STEPS
                st = "collapsed" if collapsed else "done"
                for step in range(1, last + 1):
                    mism = 0.0 if variant == "full" else 1e-4 * step
                    metrics = {"reward/mean": step / STEPS + 0.01 * seed, "mismatch/token/k3": mism,
                               "mismatch/token/logp_abs_diff_mean": mism, "mismatch/token/logp_abs_diff_max": 10 * mism}
                    if with_is_ratio:
                        metrics.update({"mismatch/token/is_ratio_min": 1 - mism, "mismatch/token/is_ratio_mean": 1.0,
                                        "mismatch/token/is_ratio_max": 1 + 2 * mism})
                    rows += [("syn", model, variant, seed, step, k, v, st) for k, v in sorted(metrics.items())]
                status.append(dict(zip(RUN_STATUS_COLUMNS, (
                    "syn", model, variant, seed, st, last, COLLAPSE_STEP if collapsed else None,
                    "non-finite optim/loss=nan" if collapsed else None, None, 10.0, "abc", "2.13.0", "5.17.0",
                    "1.16.0", None))))
    probe, layers = [], []
    for model in ("m1", "m2") if with_probe else ():
        for variant, k3, exact in (("baseline", 2e-4, 0.25), ("full", 0.0, 1.0)):
            probe += [("syn", model, "vllm-compiled", variant, "token", "mismatch_k3", k3),
                      ("syn", model, "vllm-compiled", variant, "token", "tokens_exact_frac", exact)]
            layers += [("syn", model, "vllm-compiled", variant, layer, "hidden_rel_err_rms",
                        0.0 if variant == "full" else 1e-3 * (layer + 1)) for layer in range(3)]
    return Aggregate(
        runs=pd.DataFrame(rows, columns=["sweep", "model", "variant", "seed", "step", "metric", "value", "status"]),
        run_status=pd.DataFrame(status, columns=list(RUN_STATUS_COLUMNS)),
        probe=pd.DataFrame(probe, columns=["sweep", "model", "engine", "variant", "level", "metric", "value"]),
        probe_layers=pd.DataFrame(layers, columns=["sweep", "model", "engine", "variant", "layer", "metric", "value"]))


@pytest.fixture(scope="module")
def agg_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("syn") / "aggregate"
    write_aggregate(_tables(), d)
    return d


@pytest.fixture(scope="module")
def rendered(agg_dir, tmp_path_factory):
    """Every figure made twice, into two directories (png and pdf)."""
    outs = [tmp_path_factory.mktemp(f"fig{i}") for i in range(2)]
    for out in outs:
        make_all(agg_dir, out, formats=("png", "pdf"), log=lambda _: None)
    return outs


def test_every_expected_file_and_nothing_else(rendered):
    expected = {f"{stem}.{ext}" for stem in IMAGE_STEMS for ext in ("png", "pdf")} | {"summary.csv", "summary.md"}
    assert {p.name for p in rendered[0].iterdir()} == expected
    assert (rendered[0] / "fig_k3.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (rendered[0] / "fig_k3.pdf").read_bytes()[:5] == b"%PDF-"
    assert b"CreationDate" not in (rendered[0] / "fig_k3.pdf").read_bytes()


def test_rerun_is_byte_identical(rendered):
    for path in sorted(rendered[0].iterdir()):
        assert path.read_bytes() == (rendered[1] / path.name).read_bytes(), path.name


def test_byte_identical_in_a_fresh_process_with_another_hash_seed(agg_dir, rendered, tmp_path):
    # a Snakemake rerun is a new process: set iteration order (hash seed) must not leak into the bytes
    code = ("import sys; from roundalign.analysis.plots import make_all; "
            "make_all(sys.argv[1], sys.argv[2], formats=('png', 'pdf'), figures=['fig_k3', 'fig_probe'])")
    env = {**os.environ, "PYTHONHASHSEED": "12345", "ROUNDALIGN_THREADS": "1"}
    subprocess.run([sys.executable, "-c", code, str(agg_dir), str(tmp_path)], check=True, env=env,
                   capture_output=True)
    for name in ("fig_k3.png", "fig_k3.pdf", "fig_probe.png", "fig_probe.pdf"):
        assert (tmp_path / name).read_bytes() == (rendered[0] / name).read_bytes(), name


def test_final_mean_takes_the_last_tenth_at_least_one():
    s = pd.Series(np.arange(1.0, 13.0), index=range(1, 13))
    assert final_mean(s) == 11.5  # 12 steps -> ceil(1.2) = 2 -> mean(11, 12)
    assert final_mean(s.iloc[:5]) == 5.0  # 5 steps -> ceil(0.5) = 1 -> the last one
    assert final_mean(pd.Series([1.0, np.nan], index=[1, 2])) == 1.0  # non-finite steps are not counted
    assert np.isnan(final_mean(pd.Series([], dtype=float)))


def test_bootstrap_band_matches_seaborn_and_contains_the_mean():
    values = [0.0, 1.0, 2.0, 7.0]
    df = pd.DataFrame({"step": [1] * 4 + [2], "value": values + [5.0]})
    stats = _steps.mean_and_ci(df, n_boot=4000, seed=0)
    one, single = stats.iloc[0], stats.iloc[1]
    assert one["mean"] == 2.5 and one["lo"] <= 2.5 <= one["hi"] and 0.0 <= one["lo"] and one["hi"] <= 7.0
    boots = sns.algorithms.bootstrap(np.array(values), func=np.mean, n_boot=4000, seed=0)
    lo, hi = np.percentile(boots, [2.5, 97.5])  # seaborn's errorbar=("ci", 95)
    assert one["lo"] == pytest.approx(lo, abs=0.15) and one["hi"] == pytest.approx(hi, abs=0.15)
    assert single["mean"] == 5.0 and np.isnan(single["lo"]) and single["num_seeds"] == 1  # one seed: no band
    assert _steps.mean_and_ci(df, n_boot=4000, seed=0).equals(stats)  # seeded


def test_summary_hand_checked(rendered):
    table = pd.read_csv(rendered[0] / "summary.csv")
    assert list(zip(table["model"], table["variant"])) == [("m1", "baseline"), ("m1", "full"), ("m2", "baseline"),
                                                          ("m2", "full")]
    row = table.iloc[0]  # m1 baseline: seed 0 done (20 steps), seed 1 collapsed at 15
    # seed 0: last ceil(0.1*20) = 2 steps: (19/20 + 20/20)/2 = 0.975
    # seed 1: last ceil(0.1*15) = 2 steps: (14/20 + 15/20)/2 + 0.01 = 0.735  -> mean 0.855
    assert row["final_reward"] == pytest.approx(0.855)
    assert row["peak_k3"] == pytest.approx((20e-4 + 15e-4) / 2)  # max k3 per seed, then mean
    assert (row["num_seeds"], row["num_done"], row["num_collapsed"]) == (2, 1, 1)
    assert row["collapse_steps"] == "15 (seed 1)"
    m2 = table.iloc[2]  # (0.975 + 0.985) / 2
    assert m2["final_reward"] == pytest.approx(0.98) and m2["num_collapsed"] == 0
    assert table.iloc[1]["peak_k3"] == 0.0  # full: bitwise-equal throughout

    md = (rendered[0] / "summary.md").read_text()
    assert "| m1 | baseline | 2 | 1 | 1 | 15 (seed 1) | 0 | 0.855 | 1.750e-03 |" in md
    assert "| m1 | full | 2 | 2 | 0 | - | 0 | 0.980 | 0.000e+00 |" in md


def test_collapse_marked_on_the_collapsed_runs_curve(agg_dir):
    runs, status = load_table(agg_dir, "runs"), load_table(agg_dir, "run_status")
    fig, axes = plot_k3(runs, status)
    assert [ax.get_title() for ax in axes] == ["m1", "m2"]
    marks = [line for line in axes[0].get_lines() if line.get_gid() == "collapse"]
    assert len(marks) == 1 and marks[0].get_marker() == "x"
    assert list(marks[0].get_xdata()) == [COLLAPSE_STEP]
    assert marks[0].get_ydata()[0] == pytest.approx(1e-4 * COLLAPSE_STEP)  # the run's k3 at its collapse step
    labels = [t.get_text() for t in axes[0].texts if t.get_gid() == "collapse_label"]
    assert labels == ["baseline s1 collapsed @ 15"]
    assert not [line for line in axes[1].get_lines() if line.get_gid() == "collapse"]
    assert "collapse step" in [t.get_text() for t in fig.legends[0].get_texts()]


def test_exact_zeros_drawn_at_a_labelled_floor(agg_dir):
    fig, axes = plot_k3(load_table(agg_dir, "runs"), load_table(agg_dir, "run_status"))
    ax = axes[0]
    assert ax.get_yscale() == "log"
    floor = [line for line in ax.get_lines() if line.get_gid() == "zero_floor"]
    assert len(floor) == 1 and floor[0].get_ydata()[0] == pytest.approx(1e-5)  # a decade below 1e-4
    assert _logaxis.ZERO_LABEL in [t.get_text() for t in ax.texts]
    assert ax.get_ylabel() == "k3 KL estimate (nats / token)" and ax.get_xlabel() == "optimizer step"

    fig, axes = plot_probe(load_table(agg_dir, "probe"), load_table(agg_dir, "probe_layers"))
    zero_bars = [p for p in axes["k3"].patches if p.get_gid() == "zero_bar"]
    assert len(zero_bars) == 2  # full, for m1 and m2
    assert [t.get_text() for t in axes["k3"].texts] == [_logaxis.ZERO_LABEL] * 2
    assert len(axes["layers"]) == 2


def _no_data_texts(fig):
    return [t.get_text() for ax in fig.axes for t in ax.texts if t.get_gid() == "no_data"]


def test_missing_metrics_render_a_no_data_note(tmp_path, capsys):
    t = _tables(with_is_ratio=False, with_probe=False)
    fig, axes = plot_is_ratio(t.runs)
    assert _no_data_texts(fig) and "no data" in _no_data_texts(fig)[0]
    fig, _ = plot_probe(t.probe, t.probe_layers)
    assert len(_no_data_texts(fig)) == 3  # k3 bars, exact-token bars, layer curves
    write_aggregate(t, tmp_path / "agg")
    paths = make_all(tmp_path / "agg", tmp_path / "fig", formats=("png",), log=print)
    assert {p.name for p in paths} >= {"fig_is_ratio.png", "fig_probe.png"}
    assert "[plot] wrote" in capsys.readouterr().out


def test_bytes_do_not_depend_on_which_formats_were_saved_first(tmp_path):
    # guards against a second constrained-layout pass moving the axes slightly (panels with "no data" notes)
    write_aggregate(_tables(with_is_ratio=False, with_probe=False), tmp_path / "agg")
    make_all(tmp_path / "agg", tmp_path / "a", formats=("png", "pdf"), figures=["fig_is_ratio"], log=lambda _: None)
    make_all(tmp_path / "agg", tmp_path / "b", formats=("pdf",), figures=["fig_is_ratio"], log=lambda _: None)
    assert (tmp_path / "a" / "fig_is_ratio.pdf").read_bytes() == (tmp_path / "b" / "fig_is_ratio.pdf").read_bytes()


def test_empty_aggregate_still_renders(tmp_path):
    empty = _tables(with_probe=False)
    empty = Aggregate(empty.runs.iloc[:0], empty.run_status.iloc[:0], empty.probe, empty.probe_layers)
    write_aggregate(empty, tmp_path / "agg")
    paths = make_all(tmp_path / "agg", tmp_path / "fig", formats=("png",), log=lambda _: None)
    assert len(paths) == len(IMAGE_STEMS) + 2
    assert "no data" in (tmp_path / "fig" / "summary.md").read_text()


def test_missing_aggregate_dir_is_named(tmp_path, capsys):
    missing = tmp_path / "no_such_aggregate"
    with pytest.raises(FileNotFoundError, match="no_such_aggregate"):
        make_all(missing, tmp_path / "fig")
    assert main(["plot", "--aggregate", str(missing), "--out", str(tmp_path / "fig")]) == 2
    assert "no_such_aggregate" in capsys.readouterr().err
    assert main(["plot", "--aggregate", str(missing), "--out", str(tmp_path / "f"), "--formats", "gif"]) == 2


def test_cli_plot_selected_figures(agg_dir, tmp_path, capsys):
    out = tmp_path / "fig"
    assert main(["plot", "--aggregate", str(agg_dir), "--out", str(out), "--formats", "png",
                 "--figures", "fig_reward,summary"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["fig_reward.png", "summary.csv", "summary.md"]
    assert "[plot] wrote 3 files" in capsys.readouterr().out


def test_captions_cover_every_output_stem():
    assert set(CAPTIONS) == set(FIGURES) == set(IMAGE_STEMS) | set(OPTIONAL_FIGURES) | {"summary"}
    assert all(len(c) > 100 and "\n" not in c for c in CAPTIONS.values())


# -- uncertainty and readability ---------------------------------------------------------------------------------

def _layers_frame(rows):
    return pd.DataFrame([("syn", m, "vllm-eager", v, layer, "hidden_rel_err_rms", x) for m, v, layer, x in rows],
                        columns=["sweep", "model", "engine", "variant", "layer", "metric", "value"])


def test_fig_probe_draws_the_bitwise_marker_for_an_all_zero_full_line_in_every_panel():
    # m2 is the committed smoke sweep's tiny-qwen3-untied/vllm-eager case: swiglu equals baseline at every layer,
    # and full is exactly 0 at every layer
    rows = []
    for model in ("m1", "m2"):
        for layer in range(2):
            base = 6e-3 + 1e-3 * layer
            rows += [(model, "baseline", layer, base), (model, "full", layer, 0.0),
                     (model, "swiglu", layer, base if model == "m2" else base * 0.9)]
    probe = pd.DataFrame(columns=["sweep", "model", "engine", "variant", "level", "metric", "value"])
    fig, axes = plot_probe(probe, _layers_frame(rows))
    assert [ax.get_title() for ax in axes["layers"]] == ["m1", "m2"]
    for ax in axes["layers"]:
        floor = [line for line in ax.get_lines() if line.get_gid() == "zero_floor"]
        assert len(floor) == 1 and floor[0].get_ydata()[0] == pytest.approx(1e-4)  # a decade below 6e-3
        assert _logaxis.ZERO_LABEL in [t.get_text() for t in ax.texts]
        full = [line for line in ax.get_lines() if line.get_gid() == "layers:full"]
        assert len(full) == 1 and list(full[0].get_ydata()) == pytest.approx([1e-4, 1e-4])  # on the floor
    m1, m2 = axes["layers"]
    assert [line.get_gid() for line in m1.get_lines() if line.get_gid().startswith("same:")] == []
    # the twin is drawn dashed over baseline (both colours show) and named
    twin = [line for line in m2.get_lines() if line.get_gid() == "same:swiglu"]
    assert len(twin) == 1 and twin[0].get_linestyle() != "-"
    assert [t.get_text() for t in m2.texts if t.get_gid() == "same_note"] == ["swiglu = baseline (every layer)"]


def test_fig_probe_exact_fraction_has_wilson_intervals_and_shows_zeros(agg_dir):
    probe = load_table(agg_dir, "probe")
    n_tokens = probe[probe["metric"] == "tokens_exact_frac"].assign(metric="num_tokens", value=32.0)
    probe = pd.concat([probe, n_tokens], ignore_index=True)
    fig, axes = plot_probe(probe, load_table(agg_dir, "probe_layers"))
    bars = [c for c in axes["tokens_exact_frac"].collections if c.get_gid() == "wilson"]
    assert len(bars) == 4  # baseline and full for m1 and m2
    # baseline: 0.25 of 32 tokens = 8 -> Wilson 95% [0.132, 0.420]
    seg = bars[0].get_segments()[0]
    assert seg[0][1] == pytest.approx(0.1319, abs=1e-3) and seg[1][1] == pytest.approx(0.4204, abs=1e-3)
    zero = probe.assign(value=probe["value"].where(probe["metric"] != "tokens_exact_frac", 0.0))
    fig, axes = plot_probe(zero, load_table(agg_dir, "probe_layers"))
    ax = axes["tokens_exact_frac"]
    assert len([line for line in ax.get_lines() if line.get_gid() == "zero_frac"]) == 4  # a dash per 0 bar
    assert [t.get_gid() for t in ax.texts] == ["all_zero"] and ax.get_xticklabels()  # group labels kept


def test_subtitle_says_when_a_line_is_a_single_run(agg_dir):
    runs = load_table(agg_dir, "runs")
    assert _steps.seeds_subtitle(runs) == "lines: mean over seeds; bands: 95% bootstrap CI over seeds"
    one = runs[runs["seed"] == 0]
    assert _steps.seeds_subtitle(one) == "one seed per variant: each line is a single run (no interval over seeds)"
    fig, axes = plot_k3(one)
    assert "single run" in fig.get_suptitle() and not [p for p in axes[0].patches if p.get_gid() == "ci:baseline"]
    fig, axes = plot_k3(runs)
    assert [p.get_gid() for p in axes[0].patches if p.get_gid() == "ci:baseline"] == ["ci:baseline"]


def test_band_is_one_polygon_per_finite_run():
    ax = Figure().subplots()
    x = np.arange(6.0)
    lo = np.array([0.0, 1.0, np.nan, 1.0, 2.0, 3.0])
    patches = _steps.band(ax, x, lo, lo + 1)  # NaN at x = 2 splits the band, as fill_between would
    assert [len(p.get_xy()) for p in patches] == [5, 7]  # 2 and 3 points, there and back, closed
    (step,) = _steps.band(ax, [0.0, 10.0, 20.0], [0.2, 0.5, 0.5], [0.9, 0.9, 0.9], step="post")
    assert step.get_xy()[:4, 0].tolist() == [0.0, 10.0, 10.0, 20.0]  # holds each value until the next x
    assert ax.dataLim.x1 == 20.0 and ax.dataLim.y1 == 3.0 + 1  # counted by autoscaling


def test_style_and_palette_are_seaborns_and_every_variant_has_its_own_colour():
    expected = {**sns.axes_style("whitegrid"), **sns.plotting_context("paper")}
    expected.pop("image.cmap")  # "rocket": registered only by an imported seaborn; no figure draws an image
    assert _style._SEABORN_WHITEGRID_PAPER == expected
    assert _style.COLORBLIND[:10] == sns.color_palette("colorblind", 10).as_hex()
    pal = _style.palette(TRAIN_VARIANTS)
    assert set(pal) == set(_style.VARIANT_COLORS) and set(pal.values()) <= set(_style.COLORBLIND)
    assert len(set(pal.values())) == len(TRAIN_VARIANTS) == 11  # guards against fp32 wrapping onto baseline's blue
    # the stress sweep's nine variants: none of the colours that make two pinks and an orange/tan/yellow trio there
    stress = ["baseline", "rope", "full", "tis", "mis", "fp16", "fp32-head", "full+fp32-head", "fp32"]
    light_pink, tan, yellow = "#fbafe4", "#ca9161", "#ece133"
    assert not {pal[v] for v in stress} & {light_pink, tan, yellow}
    assert pal["full"] == "#cc78bc" and pal["rope"] == "#de8f05"  # full and rope keep their colours everywhere


def test_log_labels_are_plain_text():
    assert _logaxis.plain_log_label(r"$\mathdefault{10^{-14}}$") == "10⁻¹⁴"
    assert _logaxis.plain_log_label(r"$\mathdefault{6\times10^{-2}}$") == "6×10⁻²"
    assert _logaxis.plain_log_label("0.5") == "0.5"


def test_cli_plot_draws_several_sweeps_in_one_process_without_torch(agg_dir, tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["plot", "--aggregate", str(agg_dir), str(agg_dir), "--out", str(a), str(b), "--formats", "png",
                 "--figures", "summary"]) == 0
    assert (a / "summary.csv").read_bytes() == (b / "summary.csv").read_bytes()
    assert main(["plot", "--aggregate", str(agg_dir), str(agg_dir), "--out", str(a)]) == 2
    assert "one output directory per aggregate directory" in capsys.readouterr().err
    # the figure verbs parse without make_parser(), whose roundalign.models.tiny import pulls in torch (~3 s a process)
    code = ("import sys; from roundalign import cli; cli.make_figure_parser().parse_args(['plot', '--aggregate', 'x', "
            "'--out', 'y', '--stress']); import roundalign.analysis.plots, roundalign.analysis.plots.stress; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "False"


def test_parallel_rebuild_writes_the_serial_bytes_and_paths(agg_dir, rendered, tmp_path, capsys):
    # make figures shares the figures out among forked workers (one per core): each figure is still drawn by one
    # process from the same tables, so the files and the returned order must be the serial run's
    a, b = tmp_path / "a", tmp_path / "b"
    serial = make_sweeps([(agg_dir, tmp_path / "s")], formats=("png", "pdf"), log=lambda _: None)
    paths = make_sweeps([(agg_dir, a), (agg_dir, b)], formats=("png", "pdf"), jobs=2, log=lambda _: None)
    assert [p.name for p in paths] == [p.name for p in serial] * 2
    assert [p.parent for p in paths] == [a] * len(serial) + [b] * len(serial)
    for out in (a, b):
        for path in sorted(rendered[0].iterdir()):
            assert (out / path.name).read_bytes() == path.read_bytes(), (out, path.name)
    with pytest.raises(ValueError, match="jobs must be >= 1"):
        make_sweeps([(agg_dir, a)], jobs=0)
    assert main(["plot", "--aggregate", str(agg_dir), "--out", str(tmp_path / "c"), "--jobs", "2",
                 "--figures", "fig_k3,summary", "--formats", "png"]) == 0
    assert (tmp_path / "c" / "fig_k3.png").read_bytes() == (rendered[0] / "fig_k3.png").read_bytes()
    assert "(2 processes)" in capsys.readouterr().out


GRID_STEMS = ["fig_reward", "fig_k3", "fig_is_ratio", "fig_logp_diff"]


@pytest.mark.parametrize("source", ["synthetic", "stress", "vllm-cpu"])
def test_grid_figures_keep_every_label_inside_the_figure_and_off_the_other_panels(agg_dir, source, tmp_path):
    # The step figures use fixed margins (GRID_MARGINS_IN), not constrained layout: matplotlib's own measure of
    # each panel with its tick labels, axis labels and title must stay inside the figure and off its neighbours,
    # the legend and the figure title, on the synthetic tables and on committed sweeps (long log tick labels,
    # nine variants in the legend).
    agg = Tables(agg_dir if source == "synthetic" else ROOT / "results" / source / "aggregate")
    figs = {}
    real_save = _save.save
    try:
        _save.save = lambda fig, out_dir, stem, formats: figs.setdefault(stem, fig) and real_save(fig, out_dir, stem,
                                                                                             formats)
        for stem in GRID_STEMS:
            FIGURES[stem].make(agg, tmp_path, ("png",))
    finally:
        _save.save = real_save
    assert set(figs) == set(GRID_STEMS)
    for stem, fig in figs.items():
        with _style.style():
            r = fig._get_renderer()
            page = Bbox.from_bounds(0, 0, fig.bbox.width, fig.bbox.height).expanded(1.0, 1.0)
            panels = [ax.get_tightbbox(r) for ax in fig.axes]
            others = [("legend", leg.get_window_extent(r)) for leg in fig.legends]
            others.append(("title", fig._suptitle.get_window_extent(r)))
        for i, box in enumerate(panels):
            assert page.containsx(box.x0) and page.containsx(box.x1) and page.containsy(box.y0) \
                and page.containsy(box.y1), (stem, i, box, page)
            for j, other in enumerate(panels[i + 1:], i + 1):
                assert not box.shrunk(0.999, 0.999).overlaps(other), (stem, "panels", i, j)
            for name, other in others:
                assert not box.overlaps(other), (stem, name, i, box, other)


def test_learning_gain_and_its_interval_over_seeds_and_steps():
    # constant windows: only the seeds vary, so the resampled gains are the means of 2 picks from {0.3, 0.2}
    runs = [(np.full(10, 0.2), np.full(10, 0.5)), (np.full(10, 0.4), np.full(10, 0.6))]
    got = learning(runs)
    assert got["first_reward"] == pytest.approx(0.3) and got["last_reward"] == pytest.approx(0.55)
    assert got["reward_gain"] == pytest.approx(0.25)
    assert (got["gain_lo"], got["gain_hi"]) == (pytest.approx(0.2), pytest.approx(0.3))
    # one seed: the interval is that of the steps; a first window of half 0s and half 1s against a last of 1s
    one = learning([(np.array([0.0] * 5 + [1.0] * 5), np.ones(10))])
    assert one["reward_gain"] == pytest.approx(0.5) and 0 < one["gain_lo"] < 0.5 < one["gain_hi"] <= 1.0
    # no learning: the interval straddles 0
    flat = learning([(np.array([0.0, 1.0] * 5), np.array([1.0, 0.0] * 5))])
    assert flat["reward_gain"] == 0 and flat["gain_lo"] < 0 < flat["gain_hi"]
    assert np.isnan(learning([])["reward_gain"])


def test_attention_figure_pairs_the_arms_of_one_policy():
    rows, status = [], []
    # policy p trained twice: as model p (sdpa) and as model p.vllm_cpu (the engine's attention); k3 per step
    k3 = {("p", "baseline"): [4e-4, 2e-4, 3e-4], ("p", "full"): [1e-5, 3e-5, 2e-5],
          ("p.vllm_cpu", "baseline"): [1e-4, 1e-4, 5e-4], ("p.vllm_cpu", "full"): [0.0, 0.0, 1e-13]}
    for (model, variant), vals in k3.items():
        for step, v in enumerate(vals, 1):
            rows.append(("s", model, variant, 0, step, "mismatch/token/k3", v, "done"))
        status.append({"sweep": "s", "model": model, "variant": variant, "seed": 0, "status": "done",
                       "attn": "vllm_cpu" if "." in model else "sdpa", "policy": "p"})
    runs = pd.DataFrame(rows, columns=["sweep", "model", "variant", "seed", "step", "metric", "value", "status"])
    arms = arm_table(runs, pd.DataFrame(status))
    got = {(r.variant, r.attn): r.k3 for r in arms.itertuples()}
    assert got == {("baseline", "sdpa"): 3e-4, ("full", "sdpa"): 2e-5, ("baseline", "vllm_cpu"): 1e-4,
                   ("full", "vllm_cpu"): 0.0}  # medians over steps
    fig, axes = plot_attn(runs, pd.DataFrame(status))
    assert [ax.get_title() for ax in axes] == ["p"]  # one panel: the two entries share their policy
    bars = {p.get_gid(): p.get_height() for p in axes[0].patches if p.get_gid()}
    assert bars["bar:baseline:sdpa"] == pytest.approx(3e-4) and bars["bar:full:sdpa"] == pytest.approx(2e-5)
    # the exact zero (every seed 0), drawn to the floor as a hatched bar marked "0", not a bar of a value: the floor
    # is a decade below the decade of the smallest positive median (2e-5)
    assert bars["zero_bar:full:vllm_cpu"] == pytest.approx(1e-6) and "bar:full:vllm_cpu" not in bars
    zero = next(p for p in axes[0].patches if p.get_gid() == "zero_bar:full:vllm_cpu")
    assert zero.get_hatch() == "///" and "0" in [t.get_text() for t in axes[0].texts]
    # an aggregate without those columns: one attention, "(not recorded)", the model as policy
    old = arm_table(runs, pd.DataFrame(status).drop(columns=["attn", "policy"]))
    assert set(old["attn"]) == {"(not recorded)"} and set(old["policy"]) == {"p", "p.vllm_cpu"}


def test_fig_probe_with_many_model_engine_groups_names_each_model_once_and_engines_short():
    # the committed vllm-cpu sweep: 4 models x 6 engine comparisons = 24 groups; upright "model\nengine" labels
    # are too small to read there
    engines = ["vllm-cpu-compiled", "vllm-cpu-compiled_emulated", "vllm-cpu-compiled_teacher_forced",
               "vllm-cpu-eager", "vllm-cpu-eager_emulated", "vllm-cpu-eager_teacher_forced"]
    models = ["cpu-a", "cpu-b", "cpu-c", "cpu-d"]
    rows = [("s", m, e, v, "token", metric, value) for m in models for e in engines for v in ("baseline", "full")
            for metric, value in (("mismatch_k3", 1e-4), ("tokens_exact_frac", 0.5), ("num_tokens", 100))]
    probe = pd.DataFrame(rows, columns=["sweep", "model", "engine", "variant", "level", "metric", "value"])
    fig, axes = plot_probe(probe, _layers_frame([]))
    for ax in (axes["k3"], axes["tokens_exact_frac"]):
        labels = [t.get_text() for t in ax.get_xticklabels()]
        assert labels[:3] == ["compiled", "compiled (vs emulated)", "compiled (prefill)"] and len(labels) == 24
        assert all(t.get_rotation() == 30 for t in ax.get_xticklabels())
        assert ax.get_title().endswith("(engines vllm-cpu-*)")
        (models_axis,) = [c for c in ax.child_axes if c.get_gid() == "model_axis"]
        assert [t.get_text() for t in models_axis.get_xticklabels()] == models
        assert list(models_axis.get_xticks()) == [2.5, 8.5, 14.5, 20.5]
        assert len([line for line in ax.get_lines() if line.get_gid() == "model_sep"]) == 3


def test_fig_probe_layer_panels_have_a_labelled_tick_above_their_data():
    # guards against per-layer values (6e-3..1e-2, as in the committed smoke fig_probe) above the panels' top tick
    rows = [(m, v, layer, x * (layer + 1)) for m, x in (("m1", 6e-3), ("m2", 1.1e-2))
            for v in ("baseline", "rope") for layer in range(2)]
    probe = pd.DataFrame(columns=["sweep", "model", "engine", "variant", "level", "metric", "value"])
    fig, axes = plot_probe(probe, _layers_frame(rows))
    for ax, top in zip(axes["layers"], (1.2e-2, 2.2e-2)):
        lo, hi = ax.get_ylim()
        ticks = [t for t in ax.get_yticks() if lo <= t <= hi]
        assert max(ticks) >= top and hi >= top, (ticks, hi)


# -- fig_attribution (roundalign attribute's tables, concatenated by the aggregate) --------------------------------

def _attribution_frame() -> pd.DataFrame:
    """m1 against e1 and e2, m2 against e1 only: k3 2e-4 at step 0, unchanged by sampling, halved by batching, an
    exact 0 after rounding; alone, rounding leaves 5e-5 with an interval down to a few ulps."""
    for model, engine in (("m1", "e1"), ("m1", "e2"), ("m2", "e1")):
        rows = []
        k3 = [("none", 2e-4), ("sampling", 2e-4), ("batching", 1e-4), ("rounding", 0.0)]
        for step, (source, v) in enumerate(k3):
            rows.append((step, source, "cumulative", "k3", v, v / 2, v * 2))
            if step:
                removed = k3[step - 1][1] - v
                rows.append((step, source, "cumulative", "k3_removed", removed, removed / 2, removed * 2))
        for step, (source, v) in enumerate([("sampling", 2e-4), ("batching", 1e-4), ("rounding", 5e-5)], 1):
            rows.append((step, source, "alone", "k3", v, 1e-14 if source == "rounding" else v / 2, v * 2))
        yield from (("syn", model, engine, *r) for r in rows)


def _attribution_aggregate(path: Path) -> Path:
    t = _tables()
    t.attribution = pd.DataFrame(list(_attribution_frame()), columns=list(ATTRIBUTION_COLUMNS))
    write_aggregate(t, path)
    return path


def test_fig_attribution_is_drawn_where_the_aggregate_has_attribution_and_rebuilds_byte_identically(tmp_path):
    agg = _attribution_aggregate(tmp_path / "agg")
    a = make_all(agg, tmp_path / "a", formats=("png", "pdf"), log=lambda _: None)
    b = make_all(agg, tmp_path / "b", formats=("png", "pdf"), figures=["fig_attribution"], log=lambda _: None)
    assert {p.name for p in a} == {f"{stem}.{ext}" for stem in IMAGE_STEMS + ["fig_attribution"]
                                   for ext in ("png", "pdf")} | {"summary.csv", "summary.md"}
    assert [p.name for p in b] == ["fig_attribution.png", "fig_attribution.pdf"]
    for p in b:
        assert p.read_bytes() == (tmp_path / "a" / p.name).read_bytes(), p.name
    assert (tmp_path / "a" / "fig_attribution.png").stat().st_size > 20_000


def test_fig_attribution_asked_for_without_its_table_names_it(agg_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="attribution.csv"):
        make_all(agg_dir, tmp_path, formats=("png",), figures=["fig_attribution"], log=lambda _: None)


def test_fig_attribution_panels_per_model_and_engine_with_exact_zeros_on_the_floor(tmp_path):
    table = load_table(_attribution_aggregate(tmp_path / "agg"), "attribution")
    fig, axes = plot_attribution(table)
    assert axes.shape == (2, 2)  # models in rows, engines in columns
    assert [ax.get_title() for ax in axes.ravel()] == ["m1: e1", "m1: e2", "m2: e1", "m2: e2"]
    assert _no_data_texts(fig) == ["no attribution of\nm2 against e2"]
    ax = axes[0, 0]
    assert ax.get_yscale() == "log"
    floor = [line for line in ax.get_lines() if line.get_gid() == "zero_floor"]
    # a decade below the smallest positive k3 (5e-5), not below the rounding interval's 1e-14
    assert len(floor) == 1 and floor[0].get_ydata()[0] == pytest.approx(1e-6)
    assert _logaxis.ZERO_LABEL in [t.get_text() for t in ax.texts]
    cumulative = next(c for c in ax.containers if c.lines[0].get_gid() == "cumulative")
    assert list(cumulative.lines[0].get_ydata()) == pytest.approx([2e-4, 2e-4, 1e-4, 1e-6])  # the 0 on the floor
    alone = next(c for c in ax.containers if c.lines[0].get_gid() == "alone")
    assert list(alone.lines[0].get_ydata()) == pytest.approx([2e-4, 1e-4, 5e-5])
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    assert ticks == ["none", "+sampling\n0", "+batching\n50%", "+rounding\n50%"]  # "0": exactly nothing removed
    # one y range for every panel, from below the floor to above the largest interval end (4e-4)
    limits = [ax.get_ylim() for ax in axes.ravel() if ax.get_yscale() == "log"]
    assert len(limits) == 3 and limits == [pytest.approx((1e-6 / 3, 8e-4))] * 3
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["cumulative: sources equalized so far",
                                                                  "this source alone"]


def test_fig_attribution_step_shares_tell_exactly_nothing_from_almost_nothing():
    assert [share(r, 1e-4) for r in (0.0, -0.0, 1e-10, -4e-7, 5e-5, -3e-5, 1.03e-4, float("nan"))] == [
        "0", "0", "~0%", "~0%", "50%", "-30%", "103%", "?"]


def test_fig_attribution_keeps_its_labels_apart(tmp_path):
    # panel titles, two-line step labels, the legend below and the two-line title: nothing overlaps
    fig, axes = plot_attribution(load_table(_attribution_aggregate(tmp_path / "agg"), "attribution"))
    _save.save(fig, tmp_path, "f", ("png",))  # lays the figure out
    with _style.style():
        r = fig._get_renderer()
        page = Bbox.from_bounds(0, 0, fig.bbox.width, fig.bbox.height)
        panels = [ax.get_tightbbox(r) for ax in fig.axes]
        others = [fig.legends[0].get_window_extent(r), fig._suptitle.get_window_extent(r)]
    for i, box in enumerate(panels):
        assert page.expanded(1.01, 1.01).contains(box.x0, box.y0) and page.expanded(1.01, 1.01).contains(box.x1, box.y1)
        assert not any(box.shrunk(0.999, 0.999).overlaps(o) for o in panels[i + 1:] + others), i


def test_the_commands_waterfall_is_one_png(tmp_path):
    rows = [dict(zip(["step", "source", "mode", "metric", "value", "ci_low", "ci_high"], r[3:]))
            for r in _attribution_frame() if r[1:3] == ("m1", "e1")]
    path = draw_waterfall(rows, tmp_path / "waterfall.png", title="m1: e1 (emulated)")
    again = draw_waterfall(rows, tmp_path / "again.png", title="m1: e1 (emulated)")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.read_bytes() == again.read_bytes()


def _assert_laid_out_apart(name, fig, extra=()):
    # Lay the figure out as _save.save does, then matplotlib's own measure of each panel (tick labels, axis labels,
    # title) must stay inside the figure and off the other panels, the legends, the figure's title and y label.
    with _style.style():
        _grid.layout_of(fig)(fig)
        r = fig._get_renderer()
        page = Bbox.from_bounds(0, 0, fig.bbox.width, fig.bbox.height).expanded(1.01, 1.01)
        panels = [ax.get_tightbbox(r) for ax in fig.axes]
        others = [("legend", leg.get_window_extent(r)) for leg in fig.legends]
        others += [(what, t.get_window_extent(r)) for what, t in (("title", fig._suptitle),
                                                                  ("y label", fig._supylabel), *extra) if t is not None]
    for i, box in enumerate(panels):
        assert page.contains(box.x0, box.y0) and page.contains(box.x1, box.y1), (name, i, box, page)
        for j, other in enumerate(panels[i + 1:], i + 1):
            assert not box.shrunk(0.99, 0.99).overlaps(other), (name, "panels", i, j)
        for what, other in others:
            assert not box.overlaps(other), (name, what, i, box, other)


@pytest.mark.parametrize("source", ["stress", "dose"])
def test_stress_and_dose_figures_keep_every_label_inside_the_figure_and_apart(source):
    # the stress figures and dose_gain have fixed margins (_grid.set_margins), not constrained layout: they must fit
    # the committed sweeps (nine variants with long names, three or four doses, log tick labels)
    agg = Tables(ROOT / "results" / source / "aggregate")
    runs = agg["stress_runs"]
    figs = {"survival": stress.plot_survival(agg["stress_survival"], runs)[0],
            "mismatch": stress.plot_per_step(agg["runs"], runs, stress.MISMATCH, "mean |delta logp| per token (nats)",
                                             log=True, title="t")[0],
            "reward": stress.plot_per_step(agg["runs"], runs, stress.REWARD, "reward (mean over completions)",
                                           log=False, title="t")[0],
            "dose": stress.plot_dose(runs)[0], "gap": stress.plot_gap(agg["stress_gap"], runs)[0]}
    if agg.has("dose_outcome"):
        figs["dose_gain"] = dose.plot_gain(agg["dose_outcome"])[0]
    for name, fig in figs.items():
        _assert_laid_out_apart(name, fig)


@pytest.mark.parametrize("source", ["synthetic", "dose-anchor", "smoke", "vllm-cpu"])
def test_fig_probe_keeps_every_label_inside_the_figure_and_apart(agg_dir, source):
    # fig_probe's fixed layout measures only the depth of its bar panels' slanted labels: one or two lines per
    # group, side by side or (vllm-cpu: 24 groups) stacked with a two-level axis
    agg = Tables(agg_dir if source == "synthetic" else ROOT / "results" / source / "aggregate")
    fig, _ = plot_probe(agg["probe"], agg["probe_layers"])
    _assert_laid_out_apart(source, fig, [("layers title", t) for t in fig.texts])
