"""The import structure of ``src/roundalign`` in numbers, for docs/layout.md: modules, role packages, imports between
modules, import layers and import circles, read from the source with ``ast`` (nothing is imported or run).

    python -m tools.docs_gen.layout                 # this checkout
    python -m tools.docs_gen.layout --src OTHER/src/roundalign   # another tree (an older commit's, from git archive)

Modules are the ``.py`` files of the package. An import is an edge between two of them (``from pkg import mod``
counts as an import of ``pkg.mod``; ``from pkg import name`` as one of ``pkg``), at module level or inside a
function. Layers: the length of the longest import chain below a module, plus one (a module importing nothing of the
package is on layer 1), over the graph with each circle counted as one node; the number of layers is the highest.
tests/test_structure.py holds the roles' floors and the absence of circles to the same graph.
"""

from __future__ import annotations

import argparse
import ast
import sys
from functools import cache
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "roundalign"


def _module(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    """Every module of the package -> the package's modules it imports (module level or in a function)."""
    mods = {_module(p, src): p for p in src.rglob("*.py")}
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
                names = [f"{target}.{a.name}" if f"{target}.{a.name}" in mods else target for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            graph[m] |= {n for n in names if n in mods and n != m}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: strongly connected sets of two modules or more (Tarjan), each sorted."""
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
    return sorted(out)


def layers(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each module's layer: 1 + the longest import chain below it, a circle counted as one node."""
    comp = {m: m for m in graph}
    for c in circles(graph):
        for m in c:
            comp[m] = c[0]
    cgraph: dict[str, set[str]] = {}
    for a, targets in graph.items():
        cgraph.setdefault(comp[a], set()).update(comp[b] for b in targets if comp[b] != comp[a])

    @cache
    def depth(node: str) -> int:
        return 1 + max((depth(b) for b in cgraph.get(node, ())), default=0)

    return {m: depth(comp[m]) for m in graph}


def summary(src: Path = SRC) -> dict:
    graph = import_graph(src)
    roles = {m.split(".")[1] if m.count(".") >= 2 else m.split(".")[-1] for m in graph}
    return {"modules": len(graph), "role packages and top-level modules": len(roles),
            "imports": sum(len(t) for t in graph.values()), "layers": max(layers(graph).values()),
            "circles": len(circles(graph))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", type=Path, default=SRC, help="the package directory (default %(default)s)")
    args = ap.parse_args(argv)
    if not (args.src / "__init__.py").is_file():
        print(f"--src {args.src}: no package there (no __init__.py)", file=sys.stderr)
        return 2
    for key, value in summary(args.src).items():
        print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
