"""The few collectives the runner needs under ``accelerate launch`` (any torch.distributed backend; no-ops in
a single process): gather per-rank tensors padded to a common length, a global "any rank" flag, a barrier; and a
per-rank progress printer."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def is_main() -> bool:
    return dist.get_rank() == 0 if active() else os.environ.get("RANK", "0") == "0"


def barrier() -> None:
    if active():
        dist.barrier()


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is True on at least one (a collective: every rank must call it)."""
    if not active():
        return bool(flag)
    t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def gather_padded(tensors: list[torch.Tensor], pad_values: list, dim: int = 1) -> list[torch.Tensor]:
    """Concatenate each rank's (B_r, T_r, ...) tensors along dim 0, padding dim ``dim`` to the longest T_r with
    ``pad_values`` (a collective). Ranks may hold different batch sizes. Single process: returned as given."""
    if not active():
        return list(tensors)
    dev = _device()
    world = dist.get_world_size()
    shape = torch.tensor([tensors[0].shape[0], tensors[0].shape[dim]], dtype=torch.int64, device=dev)
    shapes = [torch.zeros_like(shape) for _ in range(world)]
    dist.all_gather(shapes, shape)
    rows, width = [int(s[0]) for s in shapes], max(int(s[1]) for s in shapes)
    out = []
    for t, pad in zip(tensors, pad_values):
        orig_dtype = t.dtype
        x = t.to(dev)
        if x.dtype == torch.bool:
            x = x.to(torch.uint8)  # gloo has no bool all_gather
        if x.shape[dim] < width:
            fill_shape = list(x.shape)
            fill_shape[dim] = width - x.shape[dim]
            x = torch.cat([x, torch.full(fill_shape, pad, dtype=x.dtype, device=dev)], dim=dim)
        parts = []
        for r in rows:
            shp = list(x.shape)
            shp[0] = r
            parts.append(torch.empty(shp, dtype=x.dtype, device=dev))
        if len(set(rows)) == 1:
            dist.all_gather(parts, x.contiguous())
        else:  # unequal batch sizes: pad rows too, then cut
            most = max(rows)
            padded = torch.cat([x, x.new_zeros((most - x.shape[0], *x.shape[1:]))]) if x.shape[0] < most else x
            buf = [torch.empty_like(padded) for _ in rows]
            dist.all_gather(buf, padded.contiguous())
            parts = [b[:r] for b, r in zip(buf, rows)]
        out.append(torch.cat(parts, dim=0).to(device=t.device, dtype=orig_dtype))
    return out


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def rank_log():
    """``print`` for one process; under ``accelerate launch`` (WORLD_SIZE > 1, where every rank prints its progress)
    a printer that prefixes ``[rank<R>]`` and writes each line whole, so interleaved lines say which rank wrote them."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return print
    rank = os.environ.get("RANK", "0")

    def log(msg) -> None:
        # one write per line: torchrun's children write unbuffered, and print() writes the text and its newline
        # separately, so two ranks' lines came out glued together ("...(0.26s)[rank1] [train] step 2/4 ...")
        sys.stdout.write(f"[rank{rank}] {msg}\n")
        sys.stdout.flush()

    return log
