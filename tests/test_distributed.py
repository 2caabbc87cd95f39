"""Two CPU processes (gloo): mismatch metrics gathered across ranks equal one process's over the same
completions, NaN engine logprobs are masked, and a NaN on one rank stops both ranks together."""

import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from roundalign.engine import NonFiniteLogitsError
from roundalign.training import distributed as D
from roundalign.training.train import make_rollout
from roundalign.training.trl_bridge import step_mismatch_metrics


def _batches():
    # rank 0: 3 completions of 5 tokens; rank 1: 2 completions of 7 (TRL pads per rank, so widths differ)
    g = torch.Generator().manual_seed(0)
    out = []
    for b, t in ((3, 5), (2, 7)):
        train = -torch.rand(b, t, generator=g) * 3
        engine = train + 0.01 * torch.randn(b, t, generator=g)
        mask = torch.rand(b, t, generator=g) > 0.2
        mask[:, 0] = True
        ent = torch.rand(b, t, generator=g)
        out.append([train, engine, mask, ent])
    out[1][1][0, 2] = float("nan")  # vLLM could not score this token (TRL: None -> NaN)
    out[1][2][0, 2] = True
    return out


def _single_process_reference():
    parts = _batches()
    width = max(p[0].shape[1] for p in parts)
    padded = [[torch.nn.functional.pad(x, (0, width - x.shape[1]), value=v)
               for x, v in zip(p, (0.0, 0.0, False, 0.0))] for p in parts]
    train, engine, mask, ent = (torch.cat([p[i] for p in padded]) for i in range(4))
    return step_mismatch_metrics(train, engine, mask, ent, ("token_truncate", 3.0, None))


def _worker(rank, world, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        train, engine, mask, ent = _batches()[rank]
        metrics = step_mismatch_metrics(train, engine, mask, ent, ("token_truncate", 3.0, None))
        # a non-finite value on rank 1 only: both ranks must decide to stop
        stop = D.any_rank(rank == 1)
        keep_going = D.any_rank(False)
        # the engine raising on one rank makes the rollout raise on every rank (no rank left waiting)
        class Engine:
            def generate(self, ids, **kw):
                if rank == 1:
                    raise NonFiniteLogitsError("engine logits contain NaN/inf")
                return []  # rank 0 is healthy

        class Tok:
            eos_token_id = 0

            def __call__(self, text, add_special_tokens=False):
                return {"input_ids": [1, 2]}

        class Trainer:
            class state:
                global_step = 0

            class accelerator:
                process_index = rank

        class Cfg:
            max_completion_length, temperature, seed = 2, 1.0, 0

        try:
            make_rollout(Engine(), Tok(), Cfg())(["a"], Trainer())
            raised = False
        except NonFiniteLogitsError:
            raised = True
        D.barrier()
        results[rank] = {"metrics": metrics, "stop": stop, "keep_going": keep_going, "raised": raised,
                         "main": D.is_main()}
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_gather_metrics_and_stop_together():
    results = mp.Manager().dict()
    ctx = mp.spawn(_worker, args=(2, _free_port(), results), nprocs=2, join=False)
    deadline = time.monotonic() + 90
    while not ctx.join(timeout=5):  # returns when one rank ends; True once all have ended cleanly
        if time.monotonic() > deadline:  # a rank left waiting in a collective would hang here
            for p in ctx.processes:
                p.kill()
            pytest.fail("the two ranks did not finish within 90 s (a hang in a collective)")
    ref = _single_process_reference()
    assert ref["mismatch/token/num_tokens"] == sum(int(m.sum()) for _, _, m, _ in _batches()) - 1  # NaN masked
    for rank in (0, 1):
        got = results[rank]["metrics"]
        assert got.keys() == ref.keys()
        for k in ref:
            assert got[k] == pytest.approx(ref[k], rel=1e-12, abs=1e-15), k
        assert all(v == v for v in got.values())  # no NaN from the unscored token
        assert results[rank]["stop"] is True and results[rank]["keep_going"] is False
        assert results[rank]["raised"] is True
    assert [results[0]["main"], results[1]["main"]] == [True, False]
