"""roundalign: make the RL training side round where the inference engine rounds.

``apply_alignment(model, variant, engine)`` aligns one Hugging Face Qwen2/Qwen3 model instance;
``roundalign.engine`` emulates the inference engine on CPU; ``roundalign.metrics`` measures the
train-vs-inference mismatch. See README.md and docs/numerics.md.
"""

__version__ = "0.1.0"
__all__ = ["apply_alignment", "alignment_of", "ENGINES", "VARIANTS", "__version__"]


def __getattr__(name):
    # Lazy (PEP 562): ``import roundalign.training.sweep`` (what the Snakefile does on every invocation) must not pay for
    # torch + transformers, which ``numerics.patch`` imports; a dry run of the paper sweep took 8-10 s with them.
    if name in ("apply_alignment", "alignment_of", "ENGINES", "VARIANTS"):
        from roundalign import numerics  # noqa: PLC0415 -- lazy: torch + transformers, kept off `import roundalign`

        return getattr(numerics, name)
    raise AttributeError(f"module 'roundalign' has no attribute {name!r}")
