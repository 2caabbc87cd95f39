"""Activation memory of one training step, in bytes, measured without an allocator (works on CPU).

Two deterministic measures (no timing, no sampling: the same model and batch give the same bytes):

- ``saved_bytes``: what autograd keeps for backward at the end of the forward, i.e. the bytes of the unique
  storages packed by ``torch.autograd.graph.saved_tensors_hooks``, parameters excluded (a ``Linear`` saves its
  weight, which is not activation memory). Under non-reentrant gradient checkpointing the tensors saved inside a
  checkpointed layer go through the checkpoint's own hooks, so only what lives across layers is counted.
- ``peak_bytes``: the largest total of live tensor storages created during forward + backward (activations,
  temporaries and the parameter gradients, which are the same in every variant), tracked op by op with a
  ``TorchDispatchMode`` and storage weakrefs. It covers the recomputation done by gradient checkpointing. Tensors
  that existed before the step (parameters, inputs) are not counted. Only for eager code: under a Python dispatch
  mode ``torch.compile``'d functions do not run their compiled kernels (measured: a model with compiled region
  kernels then saves exactly what the eager one saves), so ``track_peak=False`` there and ``peak_bytes`` is None.

This module knows nothing about alignment; ``tools/bench/memory.py`` compares variants with it.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


@dataclass(frozen=True)
class StepMemory:
    """Bytes of one forward+backward (see the module docstring for what each counts)."""

    saved_bytes: int
    peak_bytes: int | None


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


class _LiveStorages(TorchDispatchMode):
    """Running total of the storages created by the ops it sees; ``peak_bytes`` is the maximum."""

    def __init__(self, preexisting: set[int]):
        super().__init__()
        self.preexisting = preexisting
        self.live: dict[int, int] = {}  # data_ptr -> nbytes
        self.live_bytes = 0
        self.peak_bytes = 0

    def _release(self, ptr: int) -> None:
        self.live_bytes -= self.live.pop(ptr, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr == 0 or ptr in self.live or ptr in self.preexisting:
                continue
            self.live[ptr] = st.nbytes()
            self.live_bytes += st.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            weakref.finalize(st, self._release, ptr)
        return out


def step_memory(model: torch.nn.Module, input_ids: torch.Tensor, track_peak: bool = True) -> StepMemory:
    """Run ``model(input_ids=..., labels=input_ids).loss.backward()`` once and measure it (gradients are reset
    to None first and left in place afterwards)."""
    model.zero_grad(set_to_none=True)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    params |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    saved: dict[tuple[int, int], int] = {}

    def pack(t: torch.Tensor):
        key = _storage_key(t)
        if key[0] not in params:
            saved[key] = key[1]
        return t

    tracker = _LiveStorages(params | {input_ids.untyped_storage().data_ptr()})
    with tracker if track_peak else contextlib.nullcontext():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(input_ids=input_ids, labels=input_ids).loss
        saved_bytes = sum(saved.values())
        loss.backward()
        del loss
    return StepMemory(saved_bytes=saved_bytes, peak_bytes=tracker.peak_bytes if track_peak else None)
