"""Which transformers releases the alignment is verified on, and the check ``apply_alignment`` makes.

``numerics.patch`` re-states transformers' forwards of the aligned classes (decoder layer, attention, MLP, RMSNorm,
rotary embedding, MoE block) and ``apply_rotary_pos_emb``. A release that changes one of them would be patched
silently with the old code. So each verified release is recorded with the sha256 of each such forward's source, and
``check_transformers`` compares the installed release with them once per process:

- a verified release: nothing is said;
- an unverified release whose re-stated forwards are the source of a verified one: one warning line, naming the
  release and the verified ones (the alignment is what was verified; the release as a whole was not run);
- an unverified release that changes a re-stated forward: one error line, naming the forwards that changed and the
  releases to install. ``ROUNDALIGN_ALLOW_UNVERIFIED_TRANSFORMERS=1`` turns it into a warning, for whoever ports
  ``patch.py`` to the new code.

A release is verified when the numerics tests pass there: 5.17.0 is the harness pin (the whole suite, and the real
engine, run on it); 5.10.4 is the newest release in verl 0.9.1's range (``>=5.5.3,<5.11``), where CI installs the
built wheel and runs the numerics tests (``make library-check``; docs/versions.md).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import os
import warnings

import transformers

from roundalign.numerics.families import FAMILIES

ALLOW_ENV = "ROUNDALIGN_ALLOW_UNVERIFIED_TRANSFORMERS"

# The bounds pyproject.toml declares for transformers: the oldest and the newest verified release.
TESTED_RANGE = ">=5.10.4,<5.18"

# 16 hex digits of sha256(inspect.getsource(...)) of each re-stated forward (``restated_sources``). Between 5.10.4 and
# 5.17.0 only apply_rotary_pos_emb's decorator changed (use_kernel_func_from_hub -> use_kernel_forward_from_hub).
_COMMON = {
    "Qwen2DecoderLayer": "75d1d62e173e8c57", "Qwen2Attention": "3d7ae1485294d0c8", "Qwen2MLP": "03df2d7685cf8446",
    "Qwen2RMSNorm": "790fa612e4fa57ac", "Qwen2RotaryEmbedding": "48af9cb5114a19ab",
    "Qwen3DecoderLayer": "75d1d62e173e8c57", "Qwen3Attention": "6c8fb032ff374243", "Qwen3MLP": "03df2d7685cf8446",
    "Qwen3RMSNorm": "790fa612e4fa57ac", "Qwen3RotaryEmbedding": "48af9cb5114a19ab",
}
VERIFIED: dict[str, dict[str, str]] = {
    "5.17.0": {**_COMMON, "apply_rotary_pos_emb": "ea234325c15de475"},
    "5.10.4": {**_COMMON, "apply_rotary_pos_emb": "e2975ea7060de677"},
}


def _hash(obj) -> str:
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]


def restated_sources() -> dict[str, str]:
    """Hash of each forward ``patch.py`` re-states, in the installed transformers (Qwen2 and Qwen3: the families whose
    code is recorded in ``VERIFIED``)."""
    out = {}
    for name in ("qwen2", "qwen3"):
        family = FAMILIES[name]
        mod = importlib.import_module(family.module)
        for suffix in ("DecoderLayer", "Attention", "MLP", "RMSNorm", "RotaryEmbedding"):
            out[family.prefix + suffix] = _hash(getattr(mod, family.prefix + suffix).forward)
    out["apply_rotary_pos_emb"] = _hash(importlib.import_module(FAMILIES["qwen2"].module).apply_rotary_pos_emb)
    return out


def verdict(version: str, sources: dict[str, str]) -> tuple[str, str]:
    """``("verified" | "same-source" | "changed", message)`` for a transformers ``version`` with these forwards."""
    verified = ", ".join(sorted(VERIFIED))
    if version in VERIFIED and sources == VERIFIED[version]:
        return "verified", ""
    same = [v for v, ref in VERIFIED.items() if ref == sources]
    if same:
        return "same-source", (
            f"roundalign: transformers {version} is not a verified release ({verified}); the Qwen forwards the "
            f"alignment re-states are the source of {', '.join(same)}, so it aligns as there. Verified ranges: "
            "docs/versions.md")
    nearest = min(VERIFIED, key=lambda v: sum(VERIFIED[v].get(k) != h for k, h in sources.items()))
    changed = sorted(k for k, h in sources.items() if VERIFIED[nearest].get(k) != h)
    return "changed", (
        f"roundalign: transformers {version} changes {', '.join(changed)} (against {nearest}), which the alignment "
        f"re-states: aligning would patch the old code in silently. Install transformers{TESTED_RANGE} (verified: "
        f"{verified}), or set {ALLOW_ENV}=1 to align anyway while porting numerics/patch.py")


@functools.cache
def check_transformers() -> str:
    """Check the installed transformers once per process (module docstring); returns the verdict."""
    kind, message = verdict(transformers.__version__, restated_sources())
    if kind == "changed" and os.environ.get(ALLOW_ENV) != "1":
        raise RuntimeError(message)
    if message:
        warnings.warn(message, stacklevel=3)
    return kind
