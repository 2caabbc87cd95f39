"""GRPO with TRL's own GRPOTrainer, on-policy against vLLM through one roundalign call (docs/trl.md).

On CPU, against vLLM's CPU build (.venv-vllm, `make vllm-env`), with a tiny warm-started model:

    export OMP_NUM_THREADS=1
    .venv-vllm/bin/python -m roundalign make-tiny --arch qwen2 --hidden 128 --heads 4 --out work/models/tiny-qwen2
    .venv-vllm/bin/python -m roundalign pretrain-tiny --model work/models/tiny-qwen2 --out work/models/tiny-qwen2-sft
    .venv-vllm/bin/python examples/trl_grpo.py --model work/models/tiny-qwen2-sft --out work/trl-grpo \\
        --report-to tensorboard --metrics-jsonl work/trl-grpo/metrics.jsonl

On a GPU (vLLM 0.31.0, `pip install -e '.[harness,gpu]'`): the same script with --engine vllm-compiled (or vllm-eager).

Every logged step carries TRL's own metrics and roundalign's mismatch metrics: with variant full and engine
scoring, `mismatch/token/logp_abs_diff_max` is 0.0 and `mismatch/token/tokens_exact_frac` 1.0 (every sampled token's
log-prob is bitwise the engine's), and TRL's `sampling/sampling_logp_difference/max` is 0.0. `--variant baseline
--scoring trl` trains with stock numerics (the same engine setup) for comparison.
"""

import argparse
import json
import re
from pathlib import Path

from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from roundalign.integrations.trl import on_policy_grpo
from roundalign.models.load import load_tokenizer
from roundalign.tasks.arith import arith_dataset, arith_reward


def near_reward(completions: list[str], answer: list[str], **_) -> list[float]:
    """Partial credit 1 / (1 + |guess - answer|) / 2 for a completion that starts with an integer: a tiny model's
    exact answers are rare, and GRPO learns nothing from a group whose rewards are all equal."""
    out = []
    for completion, gold in zip(completions, answer):
        m = re.match(r"\s*(-?\d+)", completion)
        out.append(0.5 / (1 + abs(int(m.group(1)) - int(gold))) if m else 0.0)
    return out


class JsonlLog(TrainerCallback):
    """Appends each of the trainer's logs (what report_to receives) as one JSON line, with its step."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": state.global_step, **logs}) + "\n")


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="Local model directory (a Qwen2/Qwen3/Llama ForCausalLM).")
    p.add_argument("--out", required=True, help="TRL's output_dir (TensorBoard logs go under it).")
    p.add_argument("--engine", default="vllm-cpu-compiled",
                   help="vLLM mode: vllm-cpu-compiled, vllm-cpu-eager (CPU build); vllm-compiled, vllm-eager (GPU).")
    p.add_argument("--variant", default="full", help="Alignment variant: full, or baseline for stock numerics.")
    p.add_argument("--scoring", default="engine", help="engine (the engine sampler's formula) or trl.")
    p.add_argument("--attn", default=None, help="Trainer attention; default: the engine's own kernel.")
    p.add_argument("--steps", type=int, default=4, help="Optimizer steps.")
    p.add_argument("--learning-rate", type=float, default=2e-3, help="Large enough to move a tiny model's bf16 weights.")
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient; > 0 loads a reference model.")
    p.add_argument("--num-prompts", type=int, default=64, help="Distinct arithmetic prompts in the training set.")
    p.add_argument("--max-completion-tokens", type=int, default=6, help="Cap on completion length, in tokens.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report-to", default="none", help='Logging integrations, comma-separated (e.g. "tensorboard").')
    p.add_argument("--metrics-jsonl", default=None, help="Also append every log line to this JSONL file.")
    return p


def main(a: argparse.Namespace) -> None:
    tokenizer = load_tokenizer(a.model)  # tiny models' tokenizer.json verbatim, else AutoTokenizer
    # prompts of different token lengths: TRL left-pads them, so the positions fix (docs/trl.md, a) is exercised
    dataset = arith_dataset(a.num_prompts, seed=a.seed, style="variable")
    cpu = a.engine.startswith("vllm-cpu")
    args = GRPOConfig(
        output_dir=a.out, seed=a.seed, max_steps=a.steps, learning_rate=a.learning_rate, beta=a.beta,
        per_device_train_batch_size=8, num_generations=4,  # 2 prompts x 4 completions a step
        max_completion_length=a.max_completion_tokens,
        use_vllm=True, vllm_mode="colocate",
        # the model holds bf16 weights itself; TRL's default bf16=True would add autocast, which rounds elsewhere
        bf16=False, use_cpu=cpu,
        logging_steps=1, report_to=[r for r in a.report_to.split(",") if r and r != "none"] or "none",
        save_strategy="no", disable_tqdm=True,
    )
    trainer = on_policy_grpo(
        GRPOTrainer, engine=a.engine, variant=a.variant, scoring=a.scoring, attn=a.attn,
        model=a.model, args=args, reward_funcs=[arith_reward, near_reward], train_dataset=dataset, processing_class=tokenizer,
        callbacks=[JsonlLog(Path(a.metrics_jsonl))] if a.metrics_jsonl else None)
    trainer.train()


if __name__ == "__main__":  # vLLM starts worker processes with spawn
    main(make_parser().parse_args())
