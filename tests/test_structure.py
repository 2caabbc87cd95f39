"""The package's import graph has no circle: every module-level and function-level import between roundalign's
modules, read from the source (``from pkg import mod`` counts as an import of ``pkg.mod``, not of the package it
sits in, whose ``__init__`` runs first either way), and the role packages import only downwards."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "roundalign"


def _module(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    mods = {_module(p): p for p in SRC.rglob("*.py")}
    graph = {m: set() for m in mods}
    for m, p in mods.items():
        pkg = m if p.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                # ``from pkg import mod`` imports pkg.mod; ``from pkg import name`` imports pkg
                names = [f"{target}.{a.name}" if f"{target}.{a.name}" in mods else target for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            graph[m] |= {n for n in names if n in mods and n != m}
    return graph


def _cycles(graph):
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


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
