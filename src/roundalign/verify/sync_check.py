"""Is TRL's weight sync into its colocated vLLM correct? A few GRPO steps, and after each one a comparison with an
engine built from scratch.

After each optimizer step of ``roundalign train --backend vllm`` (TRL 1.16's GRPOTrainer with its colocated
``vllm.LLM``) this records the engine's teacher-forced logprobs of fixed token sequences before TRL's
``sync_weights`` and after it, and saves the fp32 master weights rounded to bf16. Once training is over (and the
colocated engine gone: one engine per process), a fresh engine is built from each saved step, in the same mode,
and scores the same sequences. The sync is correct when, at every step, the synced engine equals the fresh one
bitwise; the engine before the sync must differ (else the step did not move the engine, and the check proves
nothing). Used by ``tests/vllm_cpu/test_grpo_real.py`` (vLLM's CPU build) and ``tools/gpu_check.py`` (CUDA).
"""

from __future__ import annotations

import argparse
import gc
import os
from pathlib import Path

import torch
from transformers import TrainerCallback

from roundalign.bridge.vllm_internals import colocated_llm
from roundalign.training.config import build_config, parse_set
from roundalign.training.distributed import rank_log


def teacher_forced(llm, seqs: list[list[int]]) -> torch.Tensor:
    """The engine's logprob of every token of every sequence after its first (one prefill each), concatenated."""
    from vllm import SamplingParams  # noqa: PLC0415 -- optional: vllm

    outs = llm.generate([{"prompt_token_ids": s} for s in seqs], SamplingParams(max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)
    return torch.cat([torch.tensor([o.prompt_logprobs[i][s[i]].logprob for i in range(1, len(s))])
                      for o, s in zip(outs, seqs)])


class SyncProbe(TrainerCallback):
    """After each optimizer step: the engine's logprobs before and after TRL's sync, and the masters saved in bf16.
    ``trainer`` must be set to the GRPOTrainer before training starts (callbacks are not given the trainer)."""

    def __init__(self, out: Path, seqs: list[list[int]], dtype: torch.dtype = torch.bfloat16):
        self.out, self.seqs, self.dtype, self.trainer = Path(out), seqs, dtype, None
        self.before: list[torch.Tensor] = []
        self.after: list[torch.Tensor] = []
        self.steps: list[Path] = []
        self.log_history: list[dict] = []  # what this rank logged (Trainer's logs: the ranks' gathered metrics)

    def on_log(self, args, state, control, logs=None, **kw):
        self.log_history.append(dict(logs or {}))

    def on_step_end(self, args, state, control, **kw):
        from roundalign.training.trl_bridge import master_state_dict  # noqa: PLC0415 -- optional: vllm (trl imports it)

        gen = self.trainer.vllm_generation
        self.before.append(teacher_forced(colocated_llm(self.trainer), self.seqs))
        gen.sync_weights()  # TRL's own call (trl/generation/vllm_generation.py), as its next generation makes it
        self.after.append(teacher_forced(colocated_llm(self.trainer), self.seqs))
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        path = self.out / f"step{state.global_step}"
        masters = master_state_dict(self.trainer)  # a collective under DeepSpeed: every rank calls it
        if self.trainer.accelerator.is_main_process:  # DDP: every rank holds the same masters; rank 0 saves them
            model.save_pretrained(path, state_dict={k: v.to(self.dtype) for k, v in masters.items()})
            self.trainer.processing_class.save_pretrained(path)
        self.trainer.accelerator.wait_for_everyone()
        self.steps.append(path)


def fresh_engine(path, *, eager: bool, dtype: str = "bfloat16", **llm_kwargs):
    """An engine built from ``path`` with the arguments of TRL's colocated ``LLM(...)`` that can matter for the
    numbers (trl/generation/vllm_generation.py:347)."""
    from vllm import LLM  # noqa: PLC0415 -- optional: vllm

    return LLM(model=str(path), skip_tokenizer_init=True, dtype=dtype, enforce_eager=eager, seed=0,
               max_num_batched_tokens=4096, logprobs_mode="processed_logprobs", **llm_kwargs)


def _fresh_logprobs(steps, seqs, *, eager: bool, **llm_kwargs):
    """For each saved step directory, in order: a fresh engine's teacher-forced logprobs of ``seqs`` (one engine
    at a time, released before the next)."""
    for path in steps:
        llm = fresh_engine(path, eager=eager, **llm_kwargs)
        want = teacher_forced(llm, seqs)
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        yield want


def _sync_row(before: torch.Tensor, after: torch.Tensor, want: torch.Tensor) -> dict:
    """Did the step move the engine (before vs after the sync), and is the synced engine bitwise the fresh one."""
    return {"tokens": int(want.numel()), "moved": not torch.equal(before, after), "bitwise": bool(torch.equal(after, want)),
            "max_abs_diff": float((after - want).abs().max()), "stale_max_abs_diff": float((before - want).abs().max())}


def compare_with_fresh_engines(probe: SyncProbe, *, eager: bool, **llm_kwargs) -> list[dict]:
    """Per step: did the step move the engine, and is the synced engine bitwise equal to a fresh one."""
    fresh = _fresh_logprobs(probe.steps, probe.seqs, eager=eager, **llm_kwargs)
    return [{"step": step, **_sync_row(before, after, want)}
            for step, (before, after, want) in enumerate(zip(probe.before, probe.after, fresh), start=1)]


def train_with_sync_probe(cfg, out: str | Path, seqs: list[list[int]], log=print):
    """``run_train(cfg)`` into ``out/run`` with a :class:`SyncProbe` (steps saved under ``out/sync``). Returns
    (TrainResult, probe); the trainer and its colocated engine are released before it returns, so that
    :func:`compare_with_fresh_engines` can build engines of its own."""
    from roundalign.training import trl_bridge  # noqa: PLC0415 -- optional: vllm (trl imports it)
    from roundalign.training.train import run_train  # noqa: PLC0415 -- optional: vllm (trl imports it)

    out = Path(out)
    probe = SyncProbe(out / "sync", seqs)
    base = trl_bridge.RoundalignGRPOTrainer

    class Trainer(base):  # hands the probe its trainer (a callback is not given one)
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            probe.trainer = self

    trl_bridge.RoundalignGRPOTrainer = Trainer  # train.py reads the name off trl_bridge when it builds the trainer
    try:
        res = run_train(cfg, out / "run", callbacks=[probe], log=log)
    finally:
        trl_bridge.RoundalignGRPOTrainer = base
        probe.trainer = None
        gc.collect()
    return res, probe


def main(argv=None) -> int:
    """Under ``accelerate launch`` (several ranks, one colocated engine each): ``run_train`` with a
    :class:`SyncProbe` on every rank, then each rank writes what its own engine gave, ``<out>/rank<R>.pt``: the
    logprobs before and after each sync, the steps' saved masters (rank 0 writes them; DDP keeps the ranks'
    masters equal) and the metrics the rank logged. No fresh engine is built here (a process that trained holds
    its distributed state and its engine's memory): :func:`compare_ranks` does that afterwards, in one process.

        accelerate launch --config_file configs/accelerate/cpu.yaml --num_processes 2 -m roundalign.verify.sync_check \
            --out OUT --set model=M --set backend=vllm --set engine=vllm-cpu-eager --set steps=3 ...
    """
    ap = argparse.ArgumentParser(prog="python -m roundalign.verify.sync_check", description=main.__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--seq-lens", default="7,23,40", help="lengths of the fixed token sequences scored (default %(default)s)")
    args = ap.parse_args(argv)
    cfg = build_config(overrides=parse_set(args.overrides))
    rank = int(os.environ.get("RANK", "0"))
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 200, (int(n),), generator=g).tolist() for n in args.seq_lens.split(",")]
    res, probe = train_with_sync_probe(cfg, args.out, seqs, log=rank_log())
    logged = [{k: v for k, v in h.items() if isinstance(v, (int, float))} for h in probe.log_history]
    tmp = args.out / f".rank{rank}.pt.tmp"
    torch.save({"status": res.status, "last_step": res.last_step, "seqs": seqs, "before": probe.before,
                "after": probe.after, "steps": [str(p) for p in probe.steps], "log_history": logged}, tmp)
    tmp.replace(args.out / f"rank{rank}.pt")
    return res.exit_code


def compare_ranks(out: str | Path, world: int, *, eager: bool, **llm_kwargs) -> list[dict]:
    """After :func:`main` ran on ``world`` ranks: per step and rank, is that rank's synced engine bitwise equal to
    a fresh engine built from the step's saved masters (one fresh engine per step, shared by the ranks)."""
    ranks = [torch.load(Path(out) / f"rank{r}.pt") for r in range(world)]
    fresh = _fresh_logprobs(ranks[0]["steps"], ranks[0]["seqs"], eager=eager, **llm_kwargs)
    return [{"step": i + 1, "rank": r, **_sync_row(rec["before"][i], rec["after"][i], want)}
            for i, want in enumerate(fresh) for r, rec in enumerate(ranks)]


if __name__ == "__main__":
    raise SystemExit(main())
