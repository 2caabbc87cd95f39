"""Shared fixtures: small randomly initialised Qwen2/Qwen3 models with realistic scales.

Weights ~ N(0, 1/fan_in) (activations O(1)), non-unit norm weights (lognormal, sigma 0.3), Qwen2 q/k/v
biases ~ N(0, 1): with HF's default init (std 0.02, unit norms) bf16 `weight * x` is exact and the
rounding differences under study mostly vanish.
"""

import copy

import pytest
import torch

from roundalign.models.tiny import random_qwen  # noqa: F401  (tests import it from here)
from roundalign.numerics import regions

torch.set_num_threads(1)


@pytest.fixture(params=["qwen2", "qwen3"])
def arch(request):
    return request.param


@pytest.fixture
def clone():
    return copy.deepcopy


@pytest.fixture
def fresh_region_kernels(monkeypatch):
    """Region kernels built anew in the test that uses this: ``region_kernels`` caches them per process, and a kernel
    built before the test (by another test, or before mutmut forked its worker) would hide what building it does."""
    monkeypatch.setattr(regions, "_KERNEL_CACHE", {})
