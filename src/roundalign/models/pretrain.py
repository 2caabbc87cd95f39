"""Supervised warm start of a tiny model on ``arith`` with TRL's SFTTrainer, so GRPO starts from a policy
that earns some reward (a random tiny model never answers correctly and GRPO would see zero advantage).

    roundalign pretrain-tiny --model work/models/tiny-qwen2 --out work/models/tiny-qwen2-sft --steps 1200

Trains in fp32 (bf16 weight updates of a tiny model are mostly below one bf16 ulp) on prompt-completion
pairs ``"What is 07+42?" -> " 49<|endoftext|>"`` (loss on the completion only), then saves the model in
bf16 with the tokenizer, atomically. The training problems use a different seed stream from the GRPO
prompts' seed, but the two sets may share problems: the warm start teaches the format, not the test set.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import PrinterCallback, TrainerCallback
from trl import SFTConfig, SFTTrainer

from roundalign.engine import Engine
from roundalign.io import atomic_dir
from roundalign.models.load import load_model, load_tokenizer
from roundalign.models.tiny import META_FILE
from roundalign.tasks.arith import arith_reward, make_arith_problems
from roundalign.tasks.digits import digits_reward, make_digits_problems

SFT_SEED_OFFSET = 10_000  # SFT problems are drawn from seed + offset, GRPO's from seed


def pretrain_tiny(model_dir: str | Path, out_dir: str | Path, *, steps: int = 1200, learning_rate: float = 3e-3,
                  batch_size: int = 32, max_operand: int = 49, seed: int = 0, task: str = "arith",
                  digits: dict | None = None, log=print) -> Path:
    """``task`` "arith" (the default) or "digits" (``digits``: op, min_len, max_len, len_step of
    ``tasks.digits.make_digits_problems``)."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if not (model_dir / META_FILE).is_file():
        raise FileNotFoundError(f"{model_dir} is not a tiny model directory (no {META_FILE}); build one with "
                                "roundalign make-tiny")
    bad = [f"{name}={value!r} (must be {rule})" for name, value, ok, rule in (
        ("steps", steps, steps >= 1, "an integer >= 1"), ("batch_size", batch_size, batch_size >= 1, "an integer >= 1"),
        ("learning_rate", learning_rate, learning_rate > 0, "> 0")) if not ok]
    if bad:
        raise ValueError("invalid pretrain-tiny setting: " + "; ".join(bad))
    tokenizer = load_tokenizer(str(model_dir))
    model = load_model(str(model_dir), dtype="fp32", attn="eager")
    eos = tokenizer.eos_token
    if task == "digits":
        digits = dict(digits or {})
        problems = make_digits_problems(steps * batch_size, seed=seed + SFT_SEED_OFFSET, **digits)
    elif task == "arith":
        problems = make_arith_problems(steps * batch_size, seed=seed + SFT_SEED_OFFSET, max_operand=max_operand,
                                       fixed_width=True)
    else:
        raise ValueError(f"unknown warm-start task {task!r}; valid: arith, digits")
    data = Dataset.from_list([{"prompt": p["prompt"], "completion": " " + p["answer"] + eos} for p in problems])
    t0 = time.perf_counter()

    class Progress(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                log(f"[pretrain-tiny] step {state.global_step}/{steps} loss={logs['loss']:.4f} "
                    f"({time.perf_counter() - t0:.0f}s)")

    with tempfile.TemporaryDirectory() as tmp:
        args = SFTConfig(output_dir=tmp, max_steps=steps, per_device_train_batch_size=batch_size,
                         learning_rate=learning_rate, lr_scheduler_type="cosine", warmup_steps=min(20, steps // 10),
                         logging_steps=max(1, steps // 10), save_strategy="no", report_to="none", seed=seed,
                         bf16=False, use_cpu=True, disable_tqdm=True, gradient_checkpointing=False,
                         completion_only_loss=True, dataset_num_proc=None)
        trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer,
                             callbacks=[Progress()])
        trainer.remove_callback(PrinterCallback)  # our Progress line replaces its raw dict dumps
        trainer.train()
    model = trainer.model.to(torch.bfloat16).eval()
    if task == "digits":
        held_out = make_digits_problems(64, seed=seed + 2 * SFT_SEED_OFFSET, **digits)
        accuracy = _greedy_reward(model, tokenizer, held_out, digits_reward, digits.get("max_len", 32) + 1)
    else:
        held_out = make_arith_problems(64, seed=seed + 2 * SFT_SEED_OFFSET, max_operand=max_operand, fixed_width=True)
        accuracy = _greedy_reward(model, tokenizer, held_out, arith_reward, 6)
    log(f"[pretrain-tiny] greedy mean reward on 64 held-out {task} problems: {accuracy:.3f}")

    with atomic_dir(out_dir) as tmp_dir:
        model.generation_config.top_k, model.generation_config.top_p = 0, 1.0
        model.save_pretrained(tmp_dir)
        tokenizer.save_pretrained(tmp_dir)
        meta = json.loads((model_dir / META_FILE).read_text())
        meta["sft"] = {"from": str(model_dir), "task": task, "digits": digits, "steps": steps, "learning_rate": learning_rate,
                       "batch_size": batch_size, "max_operand": max_operand, "seed": seed,
                       "greedy_accuracy_64": accuracy, "wall_time_s": round(time.perf_counter() - t0, 1)}
        (tmp_dir / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    log(f"[pretrain-tiny] wrote {out_dir}")
    return out_dir


def _greedy_reward(model, tokenizer, problems, reward, max_new_tokens) -> float:
    ids = [tokenizer(p["prompt"], add_special_tokens=False)["input_ids"] for p in problems]
    samples = Engine(model).generate(ids, max_new_tokens=max_new_tokens, temperature=0.0,
                                     eos_token_id=tokenizer.eos_token_id)
    texts = tokenizer.batch_decode([s.completion_ids for s in samples], skip_special_tokens=True)
    return sum(reward(texts, [p["answer"] for p in problems])) / len(problems)
