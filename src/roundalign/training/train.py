"""GRPO on TRL's GRPOTrainer with an alignment variant, on the emulated CPU engine or real vLLM.

    roundalign train --model work/models/tiny-qwen2-sft --variant full --seed 0 --out work/runs/q2-full-s0
    roundalign train --model Qwen/Qwen2.5-Math-1.5B --variant rope --backend vllm --task math \\
        --steps 500 --set learning_rate=1e-6 --out runs/q25m15-rope-s0

This module builds a ``GRPOConfig`` from our ``TrainConfig``, applies the alignment to the policy before
the trainer exists, wires the engine (``trl_bridge``), and keeps the run's files (the checks before any of it,
``preflight``, are ``roundalign.training.preflight``'s):

- ``metrics.jsonl``: one JSON object per optimizer step, appended and flushed as the step ends;
- ``run.json``: resolved config, versions, status (running|done|collapsed|preempted|failed), last step,
  wall time, collapse step and reason; rewritten atomically;
- ``checkpoints/checkpoint-N``: TRL/transformers checkpoints (model, optimizer, scheduler, RNG states,
  data position) plus ``roundalign_state.json``; every ``checkpoint_every`` steps and on SIGTERM.

Rerunning the same command on the same directory resumes from the newest checkpoint (metrics lines
after it are dropped, so the file equals an uninterrupted run's); a finished run is left untouched.
GRPO itself, the loss, the importance-sampling correction and the optimizer are TRL's and transformers'.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PrinterCallback, set_seed
from trl import GRPOConfig

from roundalign.engine import Engine, NonFiniteLogitsError
from roundalign.envinfo import environment_info, torch_threads
from roundalign.io import atomic_write_json, atomic_write_text
from roundalign.models import load as models_load  # through the module: tests replace its functions
from roundalign.numerics import apply_alignment
from roundalign.numerics.dose import apply_dose
from roundalign.numerics.engines import is_cpu
from roundalign.tasks.arith import arith_dataset, arith_reward
from roundalign.tasks.digits import digits_dataset, digits_reward
from roundalign.tasks.math import load_math_dataset, math_reward
from roundalign.training import distributed as D
from roundalign.training import trl_bridge  # through the module: verify.sync_check replaces its trainer class
from roundalign.training.callbacks import RunCallback
from roundalign.training.checkpoints import checkpoints, latest_complete, step_of, verify
from roundalign.training.config import ConfigError, TrainConfig
from roundalign.training.deadline import RunState, make_deadline_callback
from roundalign.training.engine_setup import after_trainer, before_trainer
from roundalign.training.heldout import evaluate_heldout
from roundalign.training.preflight import preflight

# Wall-clock fields of metrics.jsonl: everything else is a deterministic function of config and seed.
TIMING_KEYS = ("step_time_s", "tokens_per_s", "time/trl_step_time_s")
FINISHED = ("done", "collapsed")
EXIT_PREEMPTED = 143  # 128 + SIGTERM: the scheduler sees a failed job and requeues or reruns it


@dataclass
class TrainResult:
    status: str
    last_step: int
    exit_code: int
    out_dir: Path


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as exc:
        raise RuntimeError(f"{path} is corrupt ({exc}); move it away to start the run afresh") from None


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """Newest complete checkpoint (marker written, files as listed: ``roundalign.training.checkpoints.verify``); does not
    move anything (``run_train`` sets incomplete ones aside)."""
    return next((c for c in reversed(checkpoints(ckpt_dir)) if verify(c) is None), None)


def truncate_metrics(path: Path, last_step: int) -> int:
    """Keep the metrics lines of steps <= last_step (a resumed run rewrites what came after). Returns kept."""
    if not path.exists():
        return 0
    kept = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            break  # a line cut by a kill: everything after it is discarded
        if rec.get("step", math.inf) <= last_step:
            kept.append(line)
    atomic_write_text(path, "".join(k + "\n" for k in kept))
    return len(kept)


def export_run(run_dir: str | Path, dest: str | Path) -> None:
    """Copy a finished run's metrics.jsonl and run.json into ``dest`` (each atomically; run.json last, so a
    present run.json means a complete export). Under ``accelerate launch`` every rank calls it: all wait until
    every rank is done (so rank 0's files are final), then rank 0 alone writes."""
    D.barrier()
    if not D.is_main():
        return
    run_dir, dest = Path(run_dir), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("metrics.jsonl", "run.json"):
        src = run_dir / name
        atomic_write_text(dest / name, src.read_text() if src.exists() else "")


def _config_diff(a: dict, b: dict) -> list[str]:
    keys = sorted(set(a) | set(b))
    return [f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in keys if a.get(k) != b.get(k)]


class RunFiles:
    """metrics.jsonl + run.json of one run directory."""

    def __init__(self, out_dir: Path, cfg: TrainConfig):
        # under `accelerate launch` every rank runs this code; only rank 0 owns the run's files
        self.is_main = os.environ.get("RANK", "0") == "0"
        self.out_dir = out_dir
        self.metrics_path = out_dir / "metrics.jsonl"
        self.run_path = out_dir / "run.json"
        self.cfg = cfg
        self.record: dict = {}

    def start(self, previous: dict | None, resumed_from: int | None) -> None:
        env = environment_info()
        self.record = {
            "config": self.cfg.to_dict(), "backend": self.cfg.backend, "engine": self.cfg.engine,
            "variant": self.cfg.variant, "seed": self.cfg.seed, "model": self.cfg.model,
            "versions": env["versions"], "git_sha": env["git_sha"], "device": env["device"],
            "gpu_name": env["gpu_name"], "cpu_kernels": env["cpu_kernels"], "status": "running",
            "last_step": resumed_from or 0,
            "wall_time_s": (previous or {}).get("wall_time_s", 0.0), "collapse": None, "reward_collapse": None,
            "grad_norm_collapse": None, "collapse_event": None,
            "resumed_from": (previous or {}).get("resumed_from", []) + ([resumed_from] if resumed_from else []),
            "error": None,
            # the warm start's held-out reward, measured once before step 1 (training/heldout.py)
            "heldout_initial": (previous or {}).get("heldout_initial"), "heldout_final": None,
        }
        self.write()

    def write(self) -> None:
        if self.is_main:
            atomic_write_json(self.run_path, self.record)

    def append_metrics(self, rec: dict) -> None:
        if not self.is_main:
            return
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(rec, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())


def build_grpo_args(cfg: TrainConfig, ckpt_dir: Path, world_size: int = 1, deepspeed: bool | None = None):
    if deepspeed is None:
        deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"

    kwargs = dict(
        output_dir=str(ckpt_dir), seed=cfg.seed, max_steps=cfg.steps,
        per_device_train_batch_size=cfg.per_device_batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps(world_size),
        num_generations=cfg.num_generations, max_completion_length=cfg.max_completion_length,
        learning_rate=cfg.learning_rate, lr_scheduler_type=cfg.lr_scheduler, warmup_steps=cfg.warmup_steps,
        weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm,
        temperature=cfg.temperature, top_k=0, top_p=1.0,  # the sampler must match the trainer's plain softmax
        beta=cfg.beta, epsilon=cfg.epsilon, loss_type=cfg.loss_type,
        # The policy holds bf16 (or fp16) weights itself and runs without autocast: under autocast the trainer
        # would round differently from the engine in places this study does not control. fp32 master weights:
        # on one process and under DDP roundalign.training.optim (wired in trl_bridge); under DeepSpeed, its bf16/fp16
        # mode (these flags fill the "auto" precision keys of configs/accelerate/zero3.json; accelerate does
        # not autocast under DeepSpeed).
        bf16=deepspeed and cfg.dtype == "bf16", fp16=deepspeed and cfg.dtype == "fp16",
        gradient_checkpointing=cfg.gradient_checkpointing,
        logging_steps=1, save_strategy="steps", save_steps=cfg.checkpoint_every,
        # rotation by roundalign.training.checkpoints.rotate, after the completion marker, counting complete checkpoints
        # only: Trainer's own would count a checkpoint still being written and could drop the last complete one
        save_total_limit=None, report_to=list(cfg.report_to) or "none",
        disable_tqdm=True, remove_unused_columns=False, log_completions=False,
        vllm_importance_sampling_correction=cfg.use_is_correction,
        vllm_importance_sampling_mode=cfg.is_mode, vllm_importance_sampling_clip_max=cfg.is_cap,
        vllm_importance_sampling_clip_min=(1.0 / cfg.is_cap) if cfg.variant == "mis" else None,
        use_cpu=cfg.backend == "emulated" or is_cpu(cfg.engine),
        # fp32-head variants: TRL's own mechanism (lm_head.float(), an fp32 forward, the fused LM head scoring the
        # fp32-cast hidden state without autocast; a tied embedding's output is cast back to the model dtype);
        # the emulated engine computes its logits the same way (EngineModel(lm_head_fp32=True)).
        cast_lm_head_to_fp32=cfg.lm_head_fp32,
        # Every parameter of these text-only decoders gets a gradient each step, so DDP need not search the
        # autograd graph for unused ones. transformers' default (None) turns that search on for a model without
        # gradient checkpointing, and the one-process runs against the real engine are DDP-wrapped too (TRL's
        # colocated vLLM starts a world-size-1 process group); results/bench/train_vllm_cpu.txt measures what the
        # search cost there. With the search off, a parameter left without a gradient fails the step loudly in DDP.
        ddp_find_unused_parameters=False,
    )
    if cfg.backend == "vllm":
        kwargs.update(use_vllm=True, vllm_mode=cfg.vllm_mode,
                      vllm_gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
                      vllm_tensor_parallel_size=cfg.vllm_tensor_parallel_size)
        if cfg.vllm_server_base_url:
            kwargs["vllm_server_base_url"] = cfg.vllm_server_base_url
    return GRPOConfig(**kwargs)


def _dataset(cfg: TrainConfig, tokenizer):
    if cfg.task == "digits":
        return digits_dataset(cfg.num_train_prompts, seed=cfg.seed, op=cfg.digits_op, min_len=cfg.digits_min_len,
                              max_len=cfg.digits_max_len, len_step=cfg.digits_len_step), digits_reward
    if cfg.task == "arith":
        return arith_dataset(cfg.num_train_prompts, seed=cfg.seed, max_operand=cfg.arith_max_operand,
                             style=cfg.prompt_style), arith_reward
    ds = load_math_dataset(cfg.math_dataset, split=cfg.math_split, limit=cfg.num_train_prompts)
    lengths = [len(tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False))
               for p in ds["prompt"]]
    keep = [i for i, n in enumerate(lengths) if n <= cfg.max_prompt_length]
    return ds.select(keep), math_reward


def make_rollout(engine, tokenizer, cfg: TrainConfig):
    """TRL ``rollout_func`` for the emulated engine: prompts (already repeated per generation) -> tokens."""

    def encode(prompt) -> list[int]:
        if isinstance(prompt, str):
            return tokenizer(prompt, add_special_tokens=False)["input_ids"]
        return list(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False))

    def rollout(prompts, trainer):
        ids = [encode(p) for p in prompts]
        # seeds are a function of (seed, step, index): resumed runs sample exactly what they would have
        base = (trainer.state.global_step * 1_000_003 + trainer.accelerator.process_index) * len(ids)
        error = None
        try:
            samples = engine.generate(ids, max_new_tokens=cfg.max_completion_length, temperature=cfg.temperature,
                                      seed=cfg.seed, eos_token_id=tokenizer.eos_token_id,
                                      sample_indices=[base + i for i in range(len(ids))])
        except NonFiniteLogitsError as exc:
            error = exc
        # every rank decides together, or the healthy ones would wait forever in the next collective
        if D.any_rank(error is not None):
            raise error or NonFiniteLogitsError("engine logits contain NaN/inf on another rank")
        return {"prompt_ids": [s.prompt_ids for s in samples], "completion_ids": [s.completion_ids for s in samples],
                "logprobs": [s.logprobs.tolist() for s in samples]}

    return rollout


def run_train(cfg: TrainConfig, out_dir: str | Path, *, callbacks=(), log=print) -> TrainResult:
    """Run (or resume, or report as finished) one GRPO run in ``out_dir``.

    Read top to bottom: preflight (every check that can refuse the run, before a model is loaded), resume (the
    newest complete checkpoint, and run.json carried over), build (model, alignment, engine, TRL's trainer),
    train, finalize (status, final policy, run.json)."""
    out_dir = Path(out_dir)
    # 1. preflight
    preflight(cfg, out_dir)
    files = RunFiles(out_dir, cfg)
    previous = _read_json(files.run_path)
    fingerprint = models_load.weights_fingerprint(cfg.model)
    finished = _check_previous_run(cfg, out_dir, previous, fingerprint, log)
    if finished is not None:
        return finished
    # 2. resume
    resume = _resume(cfg, out_dir, files, previous, fingerprint, log)
    state = RunState(resume_state=_read_json(resume / "roundalign_state.json") if resume else None)
    t0 = time.perf_counter()
    with _stop_requests(state):
        try:
            # 3. build
            trainer = _build_trainer(cfg, out_dir / "checkpoints", files, state, callbacks, log)
            # 4. train
            _train(trainer, resume, state)
            # 5. finalize
            status, code = _finalize(trainer, cfg, out_dir, files, state)
        except BaseException as exc:
            files.record.update(status="failed", error=f"{type(exc).__name__}: {exc}",
                                wall_time_s=files.record.get("wall_time_s", 0.0) + time.perf_counter() - t0)
            if files.record.get("config"):
                files.write()
            raise
    files.record.update(status=status, exit_code=code,
                        wall_time_s=round(files.record["wall_time_s"] + time.perf_counter() - t0, 3))
    files.write()
    log(f"[train] {out_dir}: {status} at step {files.record['last_step']}"
        + (f" ({state.collapse['reason']})" if state.collapse else ""))
    return TrainResult(status, files.record["last_step"], code, out_dir)


def _check_previous_run(cfg: TrainConfig, out_dir: Path, previous: dict | None, fingerprint: str,
                        log) -> TrainResult | None:
    """Refuse a directory that holds another run (another config, or a model rebuilt since); a finished run is
    reported as it is (its TrainResult), an unfinished one resumes (None)."""
    if previous is None:
        return None
    diff = _config_diff(previous.get("config", {}), cfg.to_dict())
    if previous.get("model_fingerprint") not in (None, fingerprint):
        diff.append(f"the model at {cfg.model} changed since this run started (weights fingerprint "
                    f"{previous['model_fingerprint']} vs {fingerprint})")
    if previous.get("model_fingerprint") is None and previous.get("status") in FINISHED:
        log(f"[train] {out_dir}: its run predates model fingerprints; whether the model at {cfg.model} changed "
            "since cannot be told (remove the directory to retrain)")
    if diff:
        raise ConfigError(f"{out_dir} holds a run with another config ({'; '.join(diff)}); "
                          "use another --out or remove that directory")
    if previous.get("status") in FINISHED:
        log(f"[train] {out_dir}: already {previous['status']} at step {previous.get('last_step')}; nothing to do")
        return TrainResult(previous["status"], previous.get("last_step", 0), 0, out_dir)
    return None


def _resume(cfg: TrainConfig, out_dir: Path, files: RunFiles, previous: dict | None, fingerprint: str,
            log) -> Path | None:
    """The checkpoint to resume from (None: step 0); metrics.jsonl cut back to it and run.json started anew,
    carrying the previous wall time, resume steps and incomplete checkpoints set aside."""
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt_dir = out_dir / "checkpoints"
    # every rank reads the same directory: rank 0 sets incomplete checkpoints aside, the others wait and then look
    resume, aside = latest_complete(ckpt_dir, log=log) if D.is_main() else (None, [])
    D.barrier()
    if not D.is_main():
        resume = latest_checkpoint(ckpt_dir)
    resume_step = step_of(resume) if resume else 0
    kept = truncate_metrics(files.metrics_path, resume_step)
    files.start(previous, resume_step or None)
    files.record["model_fingerprint"] = fingerprint
    earlier = (previous or {}).get("incomplete_checkpoints", [])
    if earlier or aside:  # what was set aside, and why, stays on record across resumes
        files.record["incomplete_checkpoints"] = [*earlier, *aside]
    files.write()
    if aside and resume is None:
        log(f"[train] {out_dir}: no complete checkpoint is left; restarting from step 0")
    log(f"[train] {out_dir}: " + (f"resuming from {resume.name} ({kept} metric lines kept)" if resume
                                   else f"starting {cfg.variant} seed {cfg.seed} on {cfg.backend}/{cfg.engine}"))
    return resume


@contextlib.contextmanager
def _stop_requests(state):
    """SIGTERM (the scheduler's preemption) and SIGUSR1 (an early warning from ``srun --signal=USR1@N`` in
    hand-written batch scripts, deadline.py) ask the run to checkpoint and stop at the end of the step."""
    previous_term = signal.signal(signal.SIGTERM, lambda *_: state.request_stop("signal"))
    previous_usr1 = signal.signal(signal.SIGUSR1, lambda *_: state.request_stop("signal"))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous_term)
        signal.signal(signal.SIGUSR1, previous_usr1)


def _train(trainer, resume: Path | None, state) -> None:
    """TRL's training loop; non-finite engine logits end it as a collapse at the step they were sampled for."""
    try:
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    except NonFiniteLogitsError as exc:
        state.collapse = {"step": trainer.state.global_step + 1, "reason": str(exc)}


def _finalize(trainer, cfg: TrainConfig, out_dir: Path, files: RunFiles, state) -> tuple[str, int]:
    """The run's status and exit code, the final policy of a run that is done, and the run's record."""
    status = "collapsed" if state.collapse else "preempted" if state.stop_requested else "done"
    if status == "done":
        save_final_policy(trainer, out_dir / "final")
        if state.heldout is not None:
            files.record["heldout_final"] = state.heldout()
    files.record["last_step"] = trainer.state.global_step
    files.record["collapse"] = state.collapse
    if status == "preempted":
        files.record["preempted_by"] = state.stopped_by
    files.record["collapse_event"] = collapse_event(files.record)
    code = cfg.collapse_exit_code if status == "collapsed" else EXIT_PREEMPTED if status == "preempted" else 0
    return status, code


COLLAPSE_KINDS = ("nonfinite", "reward", "grad_norm")


def collapse_event(record: dict) -> dict | None:
    """The run's first collapse of any kind, ``{"kind", "step", "reason"}``, or None (censored at last_step).

    Kinds (fixed before any run, thresholds from the run's config): ``nonfinite`` (NaN/inf loss, grad norm, k3
    or engine logits: the run stops), ``reward`` (rolling reward mean below reward_collapse_drop x its best for
    reward_collapse_patience steps; onset step), ``grad_norm`` (grad norm above grad_norm_collapse_factor x the
    median of the earlier steps). Ties go to the order of ``COLLAPSE_KINDS``."""
    found = [(ev["step"], i, kind, ev) for i, (kind, key) in enumerate(zip(COLLAPSE_KINDS, (
        "collapse", "reward_collapse", "grad_norm_collapse"))) if (ev := record.get(key))]
    if not found:
        return None
    step, _, kind, ev = min(found, key=lambda f: (f[0], f[1]))
    return {"kind": kind, "step": step, "reason": ev.get("reason")}


def save_final_policy(trainer, dest: Path) -> None:
    """The trained policy in HF format at master precision (fp32), loadable with ``from_pretrained``; written by
    rank 0 into a temporary directory renamed into place (a present ``final/`` is complete)."""
    state = trl_bridge.master_state_dict(trainer)  # a collective under DeepSpeed: every rank calls it
    if D.is_main():
        model = trainer.accelerator.unwrap_model(trainer.model)
        tmp = dest.with_name(dest.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, state_dict=state)
        config = json.loads((tmp / "config.json").read_text())
        config["dtype"] = "float32"  # save_pretrained writes the (bf16) model's dtype; the weights are fp32
        atomic_write_json(tmp / "config.json", config)
        trainer.processing_class.save_pretrained(tmp)
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
    D.barrier()


def _build_trainer(cfg: TrainConfig, ckpt_dir: Path, files: RunFiles, state, callbacks, log):
    """The policy (loaded, aligned), the engine (emulated, or real vLLM built by TRL) and TRL's GRPOTrainer."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    set_seed(cfg.seed)
    tokenizer = models_load.load_tokenizer(cfg.model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # GRPOConfig first: under `accelerate launch` with DeepSpeed, building it creates accelerate's DeepSpeedPlugin,
    # which registers transformers' HfDeepSpeedConfig (transformers/training_args.py, step "12. DeepSpeed";
    # accelerate/utils/dataclasses.py DeepSpeedPlugin.set_deepspeed_weakref), so a model loaded afterwards is
    # created under deepspeed.zero.Init (zero3_init_flag) and each rank holds only its shard, not the full model.
    args = build_grpo_args(cfg, ckpt_dir, int(os.environ.get("WORLD_SIZE", "1")))
    model = models_load.load_model(cfg.model, dtype=cfg.dtype, attn=cfg.attn)
    model.generation_config.top_k, model.generation_config.top_p = 0, 1.0
    dataset, reward_fn = _dataset(cfg, tokenizer)
    engine = None
    if cfg.backend == "emulated":
        engine = Engine(model, engine=cfg.engine, attn=cfg.attn, gemm=cfg.engine_gemm, splitk_chunk=cfg.splitk_chunk,
                        norm_reduction=cfg.engine_norm_reduction, attn_decode=cfg.engine_attn_decode,
                        lm_head_fp32=cfg.lm_head_fp32, kv_cache_dtype=cfg.engine_kv_cache_dtype,
                        dose_bits=cfg.engine_dose_bits)
    apply_alignment(model, cfg.alignment, cfg.engine, kernels=cfg.kernels)
    apply_dose(model, cfg.engine_dose_bits, cfg.alignment)  # the regions it aligns round as the dosed engine's
    deadline = make_deadline_callback(state, log=log)  # checkpoint before the job's time limit (None: no limit)
    with before_trainer(cfg, log):
        trainer = trl_bridge.RoundalignGRPOTrainer(
            model=model, reward_funcs=reward_fn, args=args, train_dataset=dataset, processing_class=tokenizer,
            rollout_func=make_rollout(engine, tokenizer, cfg) if engine is not None else None,
            callbacks=[RunCallback(files, cfg, state, log), *callbacks, *([deadline] if deadline else [])])
    if cfg.scoring == "engine":
        trl_bridge.use_engine_scoring(trainer)  # TRL's fused LM head -> the engine sampler's formula (policy and reference)
    trainer.remove_callback(PrinterCallback)  # metrics.jsonl and our progress line replace its dict dumps
    # the real engine's checks (stops here, before step 1, on a mismatch) and what decides its rounding, in run.json
    record, orders = after_trainer(trainer, model, cfg, log)
    if record is not None:
        files.record["vllm_engine"] = record
        files.write()
    if getattr(trainer, "ref_model", None) is not None:
        # beta > 0: TRL loads a reference copy; it must round like the policy, or the policy-vs-reference
        # KL would measure the alignment itself (4e-4 nats at step 1 on a tiny model before this line)
        # (under torch_compile TRL holds it compiled: the module to align is the one inside)
        ref = trainer.accelerator.unwrap_model(trainer.ref_model, keep_torch_compile=False)
        apply_alignment(ref, cfg.alignment, cfg.engine, kernels=cfg.kernels, norm_sum_orders=orders)
        apply_dose(ref, cfg.engine_dose_bits, cfg.alignment)
    trainer.log_mismatch = cfg.mismatch_metrics
    if cfg.use_is_correction:
        trainer.mismatch_is = (cfg.is_mode, cfg.is_cap, args.vllm_importance_sampling_clip_min)
    if engine is not None:
        state.sync = trl_bridge.bridge_emulated_engine(trainer, engine, model)
    if cfg.heldout_prompts:
        sampler = engine if engine is not None else trl_bridge.ColocatedEngine(trainer)

        def heldout():
            sampler.sync_weights(model)  # the policy as it is now, sampled by the run's engine
            return evaluate_heldout(sampler, tokenizer, cfg, reward_fn)

        state.heldout = heldout
        if files.record.get("heldout_initial") is None:
            files.record["heldout_initial"] = heldout()
            log(f"[train] held-out reward of the initial policy: {files.record['heldout_initial']['reward']:.4f}")
            files.write()
    torch.set_num_threads(torch_threads())
    return trainer
