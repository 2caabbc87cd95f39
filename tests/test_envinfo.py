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


def test_kernel_selection_ignores_the_cpu_name_and_vnni_but_not_amx():
    from roundalign.envinfo import kernel_selection

    epyc = {"model": "AMD EPYC", "torch_capability": "AVX512",
            "isa": ["avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"]}
    # the same kernels under another name with avx_vnni: the smoke cells and `make demo` reran bitwise there
    other = {**epyc, "model": "AMD EPYC 9R14", "isa": epyc["isa"] + ["avx_vnni"]}
    assert kernel_selection(epyc) == kernel_selection(other)
    # oneDNN's AMX kernels round bf16 GEMMs differently from its AVX-512 BF16 ones, and ATen's level selects too
    assert kernel_selection(epyc) != kernel_selection({**epyc, "isa": epyc["isa"] + ["amx_tile", "amx_bf16"]})
    assert kernel_selection(epyc) != kernel_selection({**epyc, "torch_capability": "AVX2"})
    assert kernel_selection(None) is None
