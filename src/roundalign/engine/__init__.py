"""Emulated inference engine for CPU: engine rounding, KV-cache decoding and vLLM's fp32 sampler.

Knows token ids and dtypes, not datasets or tokenizers. See ``model.py`` for what is emulated.
"""

import importlib

from roundalign.engine.choices import ATTN_IMPLS, ENGINE_GEMMS, KV_CACHE_DTYPES, NORM_REDUCTIONS

_LAZY = {"Engine": "generate", "NonFiniteLogitsError": "generate", "Sample": "generate", "EngineModel": "model",
         "KVCache": "model"}


def __getattr__(name):
    # lazy (PEP 562): the option names above are read by config checks that must not import torch
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'roundalign.engine' has no attribute {name!r}")


__all__ = ["Engine", "NonFiniteLogitsError", "Sample", "EngineModel", "KVCache", "ATTN_IMPLS", "ENGINE_GEMMS",
           "KV_CACHE_DTYPES", "NORM_REDUCTIONS"]
