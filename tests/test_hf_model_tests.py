"""transformers' own common model tests (v5.17.0 sdist) pass with `full` injected exactly where they pass on stock.

tests/hf_common/ holds our injection harness and model tester; transformers' test_modeling_common.py comes from
the released sdist at test time (downloaded once, sha256-checked, cached under ~/.cache/roundalign). The record
results/bench/hf_model_tests.txt (tools/bench/hf_model_tests.py) also holds negative controls: which deliberate
bugs these tests can and cannot tell from stock.
"""

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "hf_common"))

import harness  # noqa: E402

pytestmark = pytest.mark.slow
RECORD = ROOT / "results" / "bench" / "hf_model_tests.txt"
# a few tests that build every head class: enough for the control, cheap to run
CONTROL_SELECT = "test_save_load or test_attention_outputs or test_training or test_roundalign_injection"


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    return harness.run(tmp_path_factory.mktemp("hf_common"))


def test_every_alignment_passes_exactly_where_stock_passes(suite):
    diffs = harness.differences(suite["outcomes"])
    assert set(diffs) == {(a, al) for a in harness.ARCHS for al in harness.ALIGNMENTS if al != "stock"}
    for key, rows in diffs.items():
        assert rows == [], f"{key}: outcome differs from stock: {rows}"


def test_the_run_is_not_vacuous(suite):
    """Every class ran the same ~150 tests, 100+ of them passed, our injection check passed in each, and the
    bf16/fp16 eager-vs-sdpa tests (the aligned regions' low-precision code paths) ran and passed."""
    for (arch, alignment), tests in suite["outcomes"].items():
        c = harness.counts(tests)
        assert c["passed"] >= 100 and len(tests) >= 140, (arch, alignment, c)
        assert tests["test_roundalign_injection"] == "passed", (arch, alignment)
        low = [t for t in tests if re.match(r"test_eager_matches_sdpa_inference_\d+_(bf16|fp16)", t)]
        assert len(low) >= 16 and all(tests[t] == "passed" for t in low), (arch, alignment, low)


def test_a_broken_alignment_is_caught(tmp_path):
    """Negative control: `full` with the head classes refused (how apply_alignment behaved before it supported
    them) must change outcomes, or the comparison above could not fail."""
    run = harness.run(tmp_path, archs=("qwen2",), alignments=("stock", "control_rejects_heads"),
                      select=CONTROL_SELECT)
    rows = harness.differences(run["outcomes"])[("qwen2", "control_rejects_heads")]
    changed = {t for t, a, b in rows if a == "passed" and b == "failed"}
    assert {"test_save_load", "test_attention_outputs", "test_training"} <= changed, rows
    assert run["outcomes"][("qwen2", "control_rejects_heads")]["test_roundalign_injection"] == "failed"


def test_committed_record_has_these_counts(suite):
    """results/bench/hf_model_tests.txt (tools/bench/hf_model_tests.py) shows the counts this run measured."""
    record = RECORD.read_text()
    for row in harness.counts_table(suite["outcomes"]).splitlines():
        assert row in record, f"{RECORD.name} lacks {row!r}: rerun python -m tools.bench.hf_model_tests"
