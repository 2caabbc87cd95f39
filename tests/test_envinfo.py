"""run.json's git field: a modified output (results/, figures/) leaves it clean, a modified source marks it dirty."""

import subprocess

from roundalign.envinfo import git_sha


def _git(repo, *args):
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


def test_dirty_means_code_not_outputs(tmp_path):
    repo = tmp_path / "repo"
    for sub in ("src", "results", "figures"):
        (repo / sub).mkdir(parents=True)
        (repo / sub / "f.txt").write_text("0\n")
    _git(repo, "init", "-q")
    _git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "add", ".")
    _git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "init")
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    assert git_sha(repo / "src") == sha
    (repo / "results" / "f.txt").write_text("1\n")  # a sweep re-run overwrote a committed result
    (repo / "figures" / "f.txt").write_text("1\n")
    assert git_sha(repo / "src") == sha
    (repo / "src" / "f.txt").write_text("1\n")
    assert git_sha(repo / "src") == sha + "+dirty"
