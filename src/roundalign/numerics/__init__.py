"""Rounding-location numerics: the regions (``regions``), where each stack rounds (``plan``), and the
per-instance alignment of Hugging Face Qwen models (``patch``)."""

from .patch import SUPPORTED_MODEL_CLASSES, alignment_of, apply_alignment
from .plan import ENGINES, VARIANTS, RoundingPlan, engine_plan, plan_for

__all__ = ["apply_alignment", "alignment_of", "SUPPORTED_MODEL_CLASSES", "ENGINES", "VARIANTS", "RoundingPlan",
           "engine_plan", "plan_for"]
