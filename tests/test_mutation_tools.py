"""The second tier of ``make mutation`` (tools/mutation/recheck.py) names tests by path and node id, and maps every
mutant to a row by its name: a renamed test or a new mutated file must fail here, not silently shrink the recheck."""

import ast
import fnmatch
import tomllib
from pathlib import Path

import pytest

from tools.mutation import recheck

ROOT = Path(__file__).resolve().parents[1]


def _recheck():
    return recheck


def test_every_test_the_recheck_names_exists():
    for _, tests in _recheck().RECHECK:
        for t in tests:
            path, _, func = t.partition("::")
            assert (ROOT / path).is_file(), t
            if func:
                names = {n.name for n in ast.walk(ast.parse((ROOT / path).read_text())) if isinstance(n, ast.FunctionDef)}
                assert func.split("[")[0] in names, t


def test_every_mutated_module_has_a_recheck_row_and_rows_pick_their_own_tests():
    rc = _recheck()
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    files = [p for pat in cfg["only_mutate"] for p in ROOT.glob(pat) if p.suffix == ".py"]
    files = [p for p in files if not any(fnmatch.fnmatch(str(p.relative_to(ROOT)), d) for d in cfg["do_not_mutate"])]
    assert len(files) >= 5
    for p in files:
        module = ".".join(p.relative_to(ROOT / "src").with_suffix("").parts).removesuffix(".__init__")
        assert rc.selection_of(f"{module}.x_anything__mutmut_1") is not None, module
    sel = rc.selection_of
    assert sel("roundalign.numerics.patch.x__check_compile_options__mutmut_3") == [rc._WARNS]
    assert "tests/test_inductor.py" in sel("roundalign.numerics.regions.x__compiled_vjp__mutmut_1")
    assert "tests/test_inductor.py" not in sel("roundalign.numerics.regions.x_sum_sq_in_order__mutmut_1")
    assert "tests/test_checkpoints.py" in sel("roundalign.training.checkpoints.x_rotate__mutmut_9")


def test_the_recheck_refuses_to_start_without_mutmuts_pass(tmp_path, monkeypatch):
    rc = _recheck()
    monkeypatch.setattr(rc, "MUTANTS", tmp_path / "mutants")
    with pytest.raises(SystemExit, match="no mutants/src: run `make mutation`"):
        rc.main([])
