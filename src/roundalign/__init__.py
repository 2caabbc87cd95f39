"""roundalign: make the RL training side round where the inference engine rounds.

``apply_alignment(model, variant, engine)`` aligns one Hugging Face Qwen2/Qwen3 model instance;
``roundalign.engine`` emulates the inference engine on CPU; ``roundalign.metrics`` measures the
train-vs-inference mismatch. See README.md and docs/numerics.md.
"""

from .numerics import ENGINES, VARIANTS, alignment_of, apply_alignment

__version__ = "0.1.0"
__all__ = ["apply_alignment", "alignment_of", "ENGINES", "VARIANTS", "__version__"]
