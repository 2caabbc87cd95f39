"""Every repository path that the README, docs/ and the code's comments and docstrings cite as evidence (a test, a
script, a module, a config, a doc page) exists: a citation of a file that was renamed or never written sends the
reader nowhere. Paths that are outputs (results/, figures/, work/), example arguments or other projects' files are
not citations of ours and are not checked."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CITED = re.compile(r"(?<![\w/.-])((?:tests|tools|src|configs|docs)/[\w./-]*\w)")
# files whose paths are another project's (transformers' test tree, verl's docs)
OTHER_PROJECTS = {"tools/bench/hf_model_tests.py", "tests/hf_common/sdist.py", "tests/hf_common/qwen_suite.py"}
EXTERNAL = {"docs/algo/rollout_corr.md"}  # volcengine/verl's, cited in metrics.py


def _sources():
    yield ROOT / "README.md"
    yield from sorted((ROOT / "docs").glob("*.md"))
    for folder in ("src", "tools", "tests", "workflow"):
        yield from sorted(p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".smk"))
    yield ROOT / "Snakefile"
    yield ROOT / "Makefile"
    yield from sorted((ROOT / "configs").glob("*.yaml"))


def test_every_cited_path_exists():
    missing = []
    for f in _sources():
        rel = f.relative_to(ROOT).as_posix()
        if rel in OTHER_PROJECTS:
            continue
        for n, line in enumerate(f.read_text().splitlines(), 1):
            for m in CITED.finditer(line):
                path = m.group(1).rstrip(".")
                if line[m.end():m.end() + 2] == "\\.":  # an escaped dot: the path sits in a regex
                    path += "." + re.match(r"\\.(\w+)", line[m.end():]).group(1)
                if path in EXTERNAL or "{" in line[m.end():m.end() + 1] or line[m.start() - 1:m.start()] == "{":
                    continue  # a format string builds it
                if not (ROOT / path).exists():
                    missing.append(f"{rel}:{n}: {path}")
    assert missing == [], "\n".join(missing)
