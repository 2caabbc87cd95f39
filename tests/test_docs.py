"""The README is a front page and the docs pages are current.

- README.md has at most 200 lines (it is also the package's long description) and its docs map links every page
  under docs/, so no page is out of reach;
- every relative link in the README and the docs pages resolves (a file or folder of the repository);
- the benchmark tables in the docs are what ``tools/bench/tables.py`` generates from the records under
  results/bench/ (``--check``), and a doctored record makes that check fail, naming the stale block.
"""

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _run(*args):
    return subprocess.run([sys.executable, "-m", "tools.bench.tables", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_readme_is_at_most_200_lines():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= 200, f"README.md has {n} lines; move detail to a docs/ page"


def test_readme_docs_map_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    linked = {m for m in LINK.findall(readme) if m.startswith("docs/")}
    pages = {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")}
    assert pages - linked == set(), f"docs pages the README does not link: {sorted(pages - linked)}"


def test_readme_keeps_the_two_commands():
    # .ci/run runs `make test`; a new user reads both commands on the front page
    readme = (ROOT / "README.md").read_text()
    assert re.search(r"^make demo\b", readme, re.M) and re.search(r"^make test\b", readme, re.M)
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_every_relative_link_in_readme_and_docs_resolves():
    missing = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            for target in LINK.findall(line):
                if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                    continue  # a URL or an anchor on the same page
                path = (page.parent / target.split("#")[0]).resolve()
                if not path.exists():
                    missing.append(f"{page.relative_to(ROOT)}:{n}: {target}")
    assert missing == [], "\n".join(missing)


def test_bench_tables_in_the_docs_are_current():
    res = _run("--check")
    assert res.returncode == 0, res.stderr


def _copy_tree(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", root / "docs")
    shutil.copytree(ROOT / "results" / "bench", root / "results" / "bench")
    # the other records the generated tables read (docs/attribution.md)
    for rel in ("vllm-cpu/aggregate/attribution.csv", "smoke/aggregate/attribution.csv", "vllm-cpu/user_effects.json"):
        (root / "results" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / "results" / rel, root / "results" / rel)
    return root


def test_a_doctored_bench_record_makes_the_check_fail_and_a_rewrite_mends_it(tmp_path):
    root = _copy_tree(tmp_path)
    assert _run("--check", "--root", str(root)).returncode == 0
    record = root / "results" / "bench" / "memory.txt"
    text = record.read_text()
    assert "0.828" in text
    record.write_text(text.replace("0.828", "0.829", 1))  # the Qwen2 saved-bytes ratio, a number a page quotes
    res = _run("--check", "--root", str(root))
    assert res.returncode == 1
    assert "docs/bench.md: bench:memory is stale" in res.stderr, res.stderr
    before = (root / "docs" / "bench.md").read_text()
    assert _run("--root", str(root)).returncode == 0
    after = (root / "docs" / "bench.md").read_text()
    assert "| 0.829 |" in after and "| 0.829 |" not in before
    assert _run("--check", "--root", str(root)).returncode == 0
    assert not list((root / "docs").glob(".*.tmp")), "the rewrite left a temporary file"


def test_a_record_whose_layout_changed_is_named_not_tabled(tmp_path):
    root = _copy_tree(tmp_path)
    record = root / "results" / "bench" / "train.txt"
    record.write_text(record.read_text().replace("median step s", "median step time s"))
    res = _run("--check", "--root", str(root))
    assert res.returncode == 1 and "results/bench/train.txt" in res.stderr and "header" in res.stderr, res.stderr
    # a rewrite leaves the page alone rather than writing a wrong table
    page = (root / "docs" / "bench.md").read_text()
    assert _run("--root", str(root)).returncode == 1
    assert (root / "docs" / "bench.md").read_text() == page


def test_a_block_without_a_generator_or_an_end_marker_is_named(tmp_path):
    root = _copy_tree(tmp_path)
    page = root / "docs" / "versions.md"
    page.write_text(page.read_text() + "\n<!-- bench:nonesuch start -->\n<!-- bench:nonesuch end -->\n")
    res = _run("--check", "--root", str(root))
    assert res.returncode == 1 and "bench:nonesuch has no generator" in res.stderr, res.stderr
    page.write_text(page.read_text().replace("<!-- bench:nonesuch start -->\n<!-- bench:nonesuch end -->\n",
                                             "<!-- bench:memory start -->\n"))
    res = _run("--check", "--root", str(root))
    assert res.returncode == 1 and "bench:memory start without its end marker" in res.stderr, res.stderr
