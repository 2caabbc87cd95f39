"""transformers' own common model tests, taken from the released v5.17.0 sdist at test time.

The sdist (PyPI) ships ``tests/*.py`` (``test_modeling_common.py`` and the other mixins) but not ``tests/models``,
``tests/generation`` or ``tests/exporters``. We download it once (``pip download --no-binary :all:``), check its
sha256, and unpack its top-level ``tests/*.py`` as the package ``hf_tests`` in a cache directory. Nothing of
transformers is committed here. The two imports of ``test_modeling_common.py`` whose modules the sdist lacks
get empty stand-ins, written by ``write_stubs`` below and named in every record:

- ``hf_tests.exporters.test_export.ExportTesterMixin``: torch.export tests, not run;
- ``hf_tests.generation.test_utils.GenerationTesterMixin``: ``ModelTesterMixin`` does not inherit it; without the
  real one transformers' generate() tests do not run here.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import transformers

TRANSFORMERS_VERSION = "5.17.0"
# sha256 of transformers-5.17.0.tar.gz as PyPI serves it (checked after every download)
SDIST_SHA256 = "a153be279169b55b92d8000bf4af294aed684503d091cca7804da2dd8a9de000"
SDIST_NAME = f"transformers-{TRANSFORMERS_VERSION}.tar.gz"
PACKAGE = "hf_tests"

STUBS = {
    "exporters/test_export.py": (
        '"""roundalign stand-in: the v5.17.0 sdist has no tests/exporters; torch.export tests are not run."""\n\n\n'
        "class ExportTesterMixin:\n    pass\n"),
    "generation/test_utils.py": (
        '"""roundalign stand-in: the v5.17.0 sdist has no tests/generation (imported by test_modeling_common only)."""'
        "\n\n\nclass GenerationTesterMixin:\n    pass\n"),
}


def cache_dir() -> Path:
    root = os.environ.get("ROUNDALIGN_CACHE") or Path.home() / ".cache" / "roundalign"
    return Path(root) / f"transformers-{TRANSFORMERS_VERSION}-tests"


def check_installed_transformers() -> None:
    if transformers.__version__ != TRANSFORMERS_VERSION:
        raise RuntimeError(f"transformers {transformers.__version__} is installed; these are the v{TRANSFORMERS_VERSION} "
                           f"tests, pinned in pyproject.toml (pip install -e '.[test]')")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def download_sdist(dest: Path) -> Path:
    """``pip download`` the sdist into ``dest``; returns the tarball, sha256-checked."""
    cmd = [sys.executable, "-m", "pip", "download", f"transformers=={TRANSFORMERS_VERSION}", "--no-binary", ":all:",
           "--no-deps", "--disable-pip-version-check", "-q", "-d", str(dest)]
    print(f"roundalign: fetching the transformers {TRANSFORMERS_VERSION} sdist: {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    tarball = dest / SDIST_NAME
    if proc.returncode != 0 or not tarball.exists():
        raise RuntimeError(f"could not download {SDIST_NAME} (pip exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    digest = _sha256(tarball)
    if digest != SDIST_SHA256:
        raise RuntimeError(f"{SDIST_NAME}: sha256 {digest}, expected {SDIST_SHA256} (a different file than PyPI's)")
    return tarball


def write_stubs(pkg: Path) -> None:
    for rel, text in STUBS.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.parent / "__init__.py").touch()
        path.write_text(text)


def hf_tests_root() -> Path:
    """A directory holding the package ``hf_tests`` (put it on ``sys.path``); fetched on first use, then cached."""
    root = cache_dir()
    if (root / PACKAGE / ".complete").exists():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent) as tmp:
        tmp = Path(tmp)
        tarball = download_sdist(tmp)
        pkg = tmp / "out" / PACKAGE
        pkg.mkdir(parents=True)
        prefix = f"transformers-{TRANSFORMERS_VERSION}/tests/"
        with tarfile.open(tarball) as tar:
            members = [m for m in tar.getmembers() if m.isfile() and m.name.startswith(prefix)
                       and "/" not in m.name[len(prefix):] and m.name.endswith(".py")]
            if not any(m.name.endswith("/test_modeling_common.py") for m in members):
                raise RuntimeError(f"{SDIST_NAME} has no tests/test_modeling_common.py")
            for m in members:
                (pkg / Path(m.name).name).write_bytes(tar.extractfile(m).read())
        (pkg / "__init__.py").touch()
        write_stubs(pkg)
        (pkg / ".complete").write_text(f"{SDIST_NAME} sha256 {SDIST_SHA256}\n")
        # another process may have finished first: keep its copy
        if not (root / PACKAGE / ".complete").exists():
            shutil.rmtree(root, ignore_errors=True)
            os.replace(tmp / "out", root)
    return root
