"""The package's import graph has no circle: every module-level and function-level import between roundalign's
modules, read from the source (``from pkg import mod`` counts as an import of ``pkg.mod``, not of the package it
sits in, whose ``__init__`` runs first either way), and the role packages import only downwards."""

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
