"""The package's import graph has no circle: every module-level and function-level import between roundalign's
modules, read from the source (``from pkg import mod`` counts as an import of ``pkg.mod``, not of the package it
sits in, whose ``__init__`` runs first either way), and the role packages import only downwards."""

import re
import tomllib
from pathlib import Path

from tools.docs_gen.layout import circles as _cycles, import_graph, layers


def test_no_import_circle():
    graph = import_graph()
    assert "roundalign.probes.probe_real" in graph and "roundalign.probes.probe" in graph["roundalign.probes.probe_real"]
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# The role packages, lowest first: a role may import only roles on a lower floor (and itself). Shared utilities
# are the ground floor; the command line sits on top. docs/layout.md walks through the same floors.
FLOORS = {
    "io": 0, "envinfo": 0, "gpuinfo": 0, "metrics": 0, "tasks": 0,
    "numerics": 1,
    "roundalign": 2, "bridge": 2,
    "engine": 3,
    "models": 4, "settings": 4,
    "training": 5,
    "probes": 6, "analysis": 6, "verify": 6,  # a probe scores as training does (trl_bridge)
    "integrations": 6,  # the user-facing TRL and verl entry points sit on the runner's TRL bridge
    "cli": 7,
    "__main__": 8,
}


def _role(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else parts[-1]


def test_layers_count_the_longest_import_chain_with_a_circle_as_one_node():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"b", "d"}, "d": set(), "e": set()}
    assert layers(graph) == {"a": 3, "b": 2, "c": 2, "d": 1, "e": 1}


def test_roles_import_only_downwards():
    graph = import_graph()
    roles = {_role(m) for m in graph}
    assert roles == set(FLOORS), f"a module outside the known roles: {sorted(roles ^ set(FLOORS))}"
    upward = sorted(
        f"{a} -> {b}"
        for a, targets in graph.items()
        for b in targets
        if _role(a) != _role(b) and FLOORS[_role(b)] >= FLOORS[_role(a)]
    )
    assert upward == [], "imports that point up or sideways across roles:\n" + "\n".join(upward)


def test_the_floor_check_sees_an_upward_import():
    # numerics importing training would be an upward import; the check must name it
    graph = {"roundalign.numerics.patch": {"roundalign.training.train"}, "roundalign.training.train": set()}
    assert [f"{a} -> {b}" for a, t in graph.items() for b in t if FLOORS[_role(b)] >= FLOORS[_role(a)]]


# An import inside a function is allowed for an optional dependency or to keep a heavy one off a light path, and
# says which (ruff's PLC0415, on in pyproject.toml, finds the others): "# noqa: PLC0415 -- optional: <package>" or
# "# noqa: PLC0415 -- lazy: <why>".
_NOQA = re.compile(r"#\s*noqa:[A-Z0-9, ]*PLC0415")
_REASONED = re.compile(r"#\s*noqa:[A-Z0-9, ]*PLC0415[A-Z0-9, ]*\s+--\s+(optional|lazy):\s+\S")


def _unreasoned_lazy_imports(paths) -> list[str]:
    bad = []
    for path in paths:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if _NOQA.search(line) and not _REASONED.search(line):
                bad.append(f"{path}:{i}: {line.strip()}")
    return bad


def test_every_import_left_in_a_function_says_why():
    root = Path(__file__).resolve().parents[1]
    paths = [p for d in ("src", "tools", "tests") for p in (root / d).rglob("*.py")]
    assert len(paths) > 150
    assert _unreasoned_lazy_imports(paths) == []
    # and PLC0415 is one of ruff's rules here, so that an unmarked one fails `make lint`
    assert "PLC0415" in tomllib.loads((root / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]["select"]


def test_the_reason_check_sees_a_bare_noqa(tmp_path):
    f = tmp_path / "m.py"
    rule = "PLC" + "0415"  # split, so that the scan of this file does not read these lines
    f.write_text(f"def f():\n    import json  # noqa: {rule}\n    import os  # noqa: {rule} -- lazy: startup\n"
                 f"    import re  # noqa: {rule} -- because\n    import io  # noqa: F401, {rule}\n")
    assert [b.split(": ", 1)[0] for b in _unreasoned_lazy_imports([f])] == [f"{f}:2", f"{f}:4", f"{f}:5"]
