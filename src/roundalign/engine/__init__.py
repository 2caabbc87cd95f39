"""Emulated inference engine for CPU: engine rounding, KV-cache decoding and vLLM's fp32 sampler.

Knows token ids and dtypes, not datasets or tokenizers. See ``model.py`` for what is emulated.
"""

from .generate import Engine, NonFiniteLogitsError, Sample
from .model import ATTN_IMPLS, ENGINE_GEMMS, EngineModel, KVCache

__all__ = ["Engine", "NonFiniteLogitsError", "Sample", "EngineModel", "KVCache", "ATTN_IMPLS", "ENGINE_GEMMS"]
