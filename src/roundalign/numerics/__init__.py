"""Rounding-location numerics: the regions (``regions``), where each stack rounds (``plan``), and the
per-instance alignment of Hugging Face Qwen models (``patch``)."""

from roundalign.numerics.plan import ENGINES, VARIANTS, RoundingPlan, engine_plan, plan_for


def __getattr__(name):
    # lazy: ``patch`` imports transformers (seconds); ``plan`` (ENGINES, VARIANTS) is light
    if name in ("SUPPORTED_MODEL_CLASSES", "alignment_of", "apply_alignment"):
        from roundalign.numerics import patch  # noqa: PLC0415 -- lazy: torch + transformers, off the figures path

        return getattr(patch, name)
    raise AttributeError(f"module 'roundalign.numerics' has no attribute {name!r}")

__all__ = ["apply_alignment", "alignment_of", "SUPPORTED_MODEL_CLASSES", "ENGINES", "VARIANTS", "RoundingPlan",
           "engine_plan", "plan_for"]
