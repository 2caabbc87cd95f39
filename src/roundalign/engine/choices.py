"""The emulated engine's option names, importable without torch (the sweep's config checks read them on every
Snakemake invocation; ``roundalign.engine`` itself imports torch and transformers)."""

ATTN_IMPLS = ("eager", "sdpa")
ENGINE_GEMMS = ("same", "splitk")
NORM_REDUCTIONS = ("opaque", "inductor")
