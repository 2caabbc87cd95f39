"""tools/gpu_check.py's part selection and part (h) where verl is absent (this environment): ``--parts h`` runs part
(h) alone, which reports one skip line naming the environment script in both records, and a bad ``--parts`` names
the letter and the valid ones. Part (h) itself runs verl 0.9.1's actor (``tests/verl_cpu/verl_actor.py``) in
``.venv-verl`` (``python -m tools.gpu_check --device cpu --tiny --parts h``) and, on a GPU, ``--parts h`` alone."""

import importlib.util
import json

import pytest

from tools import gpu_check


@pytest.mark.skipif(importlib.util.find_spec("verl") is not None,
                    reason="verl is importable here: --parts h runs the real part (h)")
def test_parts_h_without_verl_reports_only_the_skip_naming_the_env_script(tmp_path, monkeypatch):
    # main() points Inductor's and Triton's caches at a fresh directory; monkeypatch restores the session's
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    assert gpu_check.main(["--device", "cpu", "--tiny", "--parts", "h", "--out", str(tmp_path)]) == 0

    record = json.loads((tmp_path / "gpu_check.json").read_text())
    reason = "verl 0.9.1 is not importable here: tools/envs/verl_env.sh .venv-verl builds an environment with it"
    assert record["verl"] == [{"skipped": reason + " (docs/verl.md)"}]
    assert record["meta"]["parts"] == "h"
    # nothing else ran: every other part's rows are empty and only part (h) was timed
    assert [k for k in ("inductor", "bench", "piecewise", "training", "flash") if record[k]] == []
    assert record["attribution"] == {}
    assert sorted(k for k in record["meta"] if k.endswith("_check_s") or k == "bench_s") == ["verl_check_s"]
    md = (tmp_path / "gpu_check.md").read_text()
    assert f"## (h) verl 0.9.1's actor with roundalign.integrations.verl\n\nskipped: {reason}" in md
    assert "## (a)" not in md


def test_skip_flags_drop_parts_from_the_selection(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    assert gpu_check.main(["--device", "cpu", "--tiny", "--parts", "h", "--skip-verl", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    assert record["meta"]["parts"] == "" and record["verl"] == []


@pytest.mark.parametrize("parts, culprit", [("hd", "unknown part d"), ("x9", "unknown part 9, x"), ("", "no part")])
def test_a_bad_parts_value_names_the_culprit_and_the_valid_letters(parts, culprit, capsys):
    with pytest.raises(SystemExit) as exc:
        gpu_check.parse_args(["--parts", parts])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"--parts={parts!r}: {culprit}; expected letters from abcefgh ((d) is the report, always written)" in err
