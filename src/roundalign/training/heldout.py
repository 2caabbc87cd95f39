"""Learning measured against the initial policy: the policy's reward on held-out prompts, sampled by the engine.

A run with ``heldout_prompts > 0`` (task digits or arith) evaluates its policy twice, in the same way: before the
first optimizer step (``heldout_initial``: the warm start, as the run's own engine samples it, its dose included) and
after the last (``heldout_final``). The engine is the run's: the emulated one, or TRL's colocated vLLM engine
(``trl_bridge.ColocatedEngine``: vLLM's own sampler, the policy's weights loaded as TRL loads them). Both are
recorded in run.json and in the sweep's ``run_status.csv`` (``roundalign.analysis.aggregate``).

The evaluation:

- problems: ``heldout_prompts`` problems of the run's task drawn from ``HELDOUT_SEED``, a seed no training run uses
  (training draws from the run's seed), so every run of a sweep is evaluated on the same problems;
- sampling: ``heldout_samples`` completions per problem from the run's engine at the run's temperature and
  completion cap, each from its own generator seeded by ``(HELDOUT_SEED, index)`` (vLLM: its request seed): the same draws for every run, so
  two runs at the same weights and engine get the same reward, and the initial reward is the same for every
  variant and seed of one warm start and engine;
- score: the task's own reward function; the reward is the mean over problems of each problem's mean reward, with
  a 95% percentile interval from ``NUM_RESAMPLES`` bootstrap resamples of the problems (``default_rng(0)``).
"""

from __future__ import annotations

import numpy as np

from roundalign.tasks.arith import arith_dataset
from roundalign.tasks.digits import make_digits_problems

HELDOUT_SEED = 1_000_000_007
NUM_RESAMPLES = 2000
HELDOUT_TASKS = ("digits", "arith")


def _draw(cfg, n: int, seed: int) -> list[dict]:
    if cfg.task == "digits":
        return make_digits_problems(n, seed=seed, op=cfg.digits_op, min_len=cfg.digits_min_len,
                                    max_len=cfg.digits_max_len, len_step=cfg.digits_len_step)
    if cfg.task == "arith":
        return [dict(row) for row in arith_dataset(n, seed=seed, max_operand=cfg.arith_max_operand,
                                                   style=cfg.prompt_style)]
    raise ValueError(f"held-out evaluation covers the tasks {', '.join(HELDOUT_TASKS)}, not {cfg.task!r}")


def heldout_problems(cfg) -> list[dict]:
    """The held-out problems of ``cfg``'s task (dicts with ``prompt`` and ``answer``): the first
    ``cfg.heldout_prompts`` distinct problems drawn from ``HELDOUT_SEED`` that are not in the run's training set.
    (Digit strings of the demo lengths never repeat; arith's few thousand problems do, so there the set can differ
    between training seeds.)"""
    train = {p["prompt"] for p in _draw(cfg, cfg.num_train_prompts, cfg.seed)}
    out, seen = [], set()
    for p in _draw(cfg, cfg.heldout_prompts + cfg.num_train_prompts, HELDOUT_SEED):
        if p["prompt"] not in train and p["prompt"] not in seen:
            seen.add(p["prompt"])
            out.append(p)
    if len(out) < cfg.heldout_prompts:
        raise ValueError(f"heldout_prompts={cfg.heldout_prompts}: only {len(out)} problems of this task are outside "
                         "the training set; ask for fewer")
    return out[:cfg.heldout_prompts]


def bootstrap_mean_ci(values, num_resamples: int = NUM_RESAMPLES, seed: int = 0) -> tuple[float, float, float]:
    """(mean, 2.5th and 97.5th percentile of the bootstrap means) of ``values``."""
    v = np.asarray(values, dtype=float)
    rng = np.random.default_rng(seed)
    means = v[rng.integers(0, len(v), size=(num_resamples, len(v)))].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(v.mean()), float(lo), float(hi)


def evaluate_heldout(engine, tokenizer, cfg, reward_fn) -> dict:
    """The held-out reward of the policy ``engine`` holds now (module docstring); a dict for run.json."""
    problems = heldout_problems(cfg)
    k = cfg.heldout_samples
    ids = [tokenizer(p["prompt"], add_special_tokens=False)["input_ids"] for p in problems for _ in range(k)]
    samples = engine.generate(ids, max_new_tokens=cfg.max_completion_length, temperature=cfg.temperature,
                              seed=HELDOUT_SEED, eos_token_id=tokenizer.eos_token_id)
    texts = tokenizer.batch_decode([s.completion_ids for s in samples], skip_special_tokens=True)
    rewards = reward_fn(texts, answer=[p["answer"] for p in problems for _ in range(k)])
    per_problem = np.asarray(rewards, dtype=float).reshape(len(problems), k).mean(axis=1)
    mean, lo, hi = bootstrap_mean_ci(per_problem)
    return {"reward": mean, "ci_low": lo, "ci_high": hi, "prompts": len(problems), "samples_per_prompt": k,
            "seed": HELDOUT_SEED, "temperature": cfg.temperature}
