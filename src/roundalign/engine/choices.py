"""The emulated engine's option names, importable without torch (the sweep's config checks read them on every
Snakemake invocation; ``roundalign.engine`` itself imports torch and transformers)."""

# vllm_cpu: vLLM's own CPU attention kernel (roundalign.bridge.vllm_cpu_attention; needs vLLM's CPU build): in the emulated engine,
# the probe's trainer side and training, where it runs as the engine's forward with SDPA's gradient
ENGINE_ATTN_IMPLS = ("eager", "sdpa", "vllm_cpu")
# vllm_flash: vLLM's own CUDA FlashAttention call (roundalign.bridge.vllm_flash; needs vLLM's CUDA build and a GPU), the
# trainer's attention in training against the real GPU engine only: the emulated (CPU) engine cannot run it, so it is
# no engine attention (check_choice refuses it there, and train's preflight refuses it before anything loads)
ATTN_IMPLS = ENGINE_ATTN_IMPLS + ("vllm_flash",)
ENGINE_GEMMS = ("same", "splitk")
NORM_REDUCTIONS = ("opaque", "inductor")
# vLLM's ``--kv-cache-dtype`` names: "auto" keeps K/V in the model dtype; the fp8 formats store them quantized
# (per-tensor scale 1.0, the default when a checkpoint carries no KV scales)
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
