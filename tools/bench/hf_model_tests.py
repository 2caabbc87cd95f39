"""transformers' own common model tests with the alignment injected: counts and differences from stock.

    python -m tools.bench.hf_model_tests --out results/bench/hf_model_tests.txt      # ~6 min on 2 cores

Runs ``tests/hf_common/qwen_suite.py``: ``ModelTesterMixin`` from the released transformers 5.17.0 sdist (fetched
and cached on first use, sha256-checked; nothing of it is committed) on tiny Qwen2 and Qwen3 models, with every
model the tests build left stock or aligned (``full`` for four engine/kernel choices), then three negative
controls (``full`` plus a deliberate bug) to show what these tests can and cannot tell from stock.
``tests/test_hf_model_tests.py`` reruns the first part in ``make test`` and checks its count table against the
record this writes.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "hf_common"))
sys.path.insert(0, str(ROOT / "src"))

import harness  # noqa: E402
import sdist  # noqa: E402

from roundalign.envinfo import environment_info  # noqa: E402
from roundalign.io import atomic_write_text  # noqa: E402

# what covers, in our own suite, what transformers' tests cannot see
OWN_TESTS = {
    "control_bf16_in_fp32": "tests/test_patch.py::test_fp32_model_every_variant_is_bitwise_noop",
    "control_stale_attn_config": "tests/test_patch.py::test_attention_switch_after_alignment_takes_effect_as_on_stock",
}


def _differences_text(diffs: dict, limit: int = 6) -> list[str]:
    lines = []
    for (arch, alignment), rows in diffs.items():
        if not rows:
            lines.append(f"  {arch:6} {alignment:30} none")
            continue
        lines.append(f"  {arch:6} {alignment:30} {len(rows)} tests differ, e.g.:")
        lines += [f"      {t}: stock {a}, here {b}" for t, a, b in rows[:limit]]
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "results" / "bench" / "hf_model_tests.txt")
    p.add_argument("--no-controls", action="store_true", help="skip the three negative controls (~3 min)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        main_run = harness.run(Path(tmp) / "main")
        ctrl_run = None if args.no_controls else harness.run(Path(tmp) / "controls", alignments=tuple(harness.CONTROLS))
    env = environment_info()
    lines = [
        "transformers' own common model tests (ModelTesterMixin, v5.17.0 sdist) on Qwen2/Qwen3, stock and with "
        "roundalign.apply_alignment injected",
        "=" * 110,
        f"git {env['git_sha']}, torch {env['versions']['torch']}, transformers {env['versions']['transformers']}, "
        "python " + env["python"] + ", 1 torch thread",
        f"test file: {sdist.SDIST_NAME} (sha256 {sdist.SDIST_SHA256}), its tests/test_modeling_common.py unmodified",
        "the sdist lacks tests/models, tests/causal_lm_tester.py, tests/generation and tests/exporters, so:",
        "  - the model tester is our own (tests/hf_common/qwen_suite.py: QwenTester, tiny fp32 configs, 2 layers,",
        "    hidden 32, all five Qwen classes: Model, ForCausalLM, ForSequenceClassification, ForTokenClassification,",
        "    ForQuestionAnswering);",
        "  - ExportTesterMixin and GenerationTesterMixin are empty stand-ins (tests/hf_common/sdist.py): no torch.export",
        "    and no generate() test ran; one test of ours per class (test_roundalign_injection) checks that every class",
        "    was built with the intended alignment.",
        "injection: each Qwen model class's __init__ is wrapped; when the outermost construction returns (direct,",
        "from_pretrained, from_config) apply_alignment(model, variant, engine, kernels=...) is applied.",
        "",
        f"ALIGNMENTS (per-test outcomes from junit XML; {main_run['seconds']:.0f} s wall, one process per arch)",
        harness.counts_table(main_run["outcomes"]),
        "",
        "TESTS WHOSE OUTCOME DIFFERS FROM STOCK",
        *_differences_text(harness.differences(main_run["outcomes"])),
        "",
        "pytest's own summary lines (subtests counted separately):",
        *[f"  {arch}: {line}" for arch, line in main_run["summaries"].items()],
    ]
    if ctrl_run is not None:
        outcomes = dict(ctrl_run["outcomes"])
        outcomes.update({k: v for k, v in main_run["outcomes"].items() if k[1] == "stock"})
        diffs = harness.differences(outcomes)
        lines += ["", f"NEGATIVE CONTROLS ({ctrl_run['seconds']:.0f} s wall): full plus a deliberate bug",
                  *[f"  {name}: {text}" for name, text in harness.CONTROLS.items()],
                  harness.counts_table(outcomes), "", "differences from stock:", *_differences_text(diffs), ""]
        for name in harness.CONTROLS:
            caught = [arch for (arch, a), rows in diffs.items() if a == name and rows]
            verdict = f"DETECTED ({', '.join(caught)})" if caught else "NOT detected by these tests"
            lines.append(f"  {name}: {verdict}" + ("" if caught or name not in OWN_TESTS
                                                   else f"; covered by {OWN_TESTS[name]}"))
        lines += ["  These tests check structure and self-consistency (a model against itself after save/load,",
                  "  eager against sdpa, batched against single): they compare no model with stock, so an alignment",
                  "  that changes values consistently passes them. They do catch what breaks the API."]
    atomic_write_text(args.out, "\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
