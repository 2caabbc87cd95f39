"""Synthetic arithmetic: deterministic prompts with exact integer answers and an exact-match reward.

A problem is ``{"prompt": "What is 07+42?", "answer": "49"}``; completions look like ``" 49<eos>"``
(the prompt ends on a token boundary: byte-level BPE attaches a space to the following word); the same ``(n, seed, max_operand)``
always gives the same list. Training uses ``fixed_width=True``: operands are zero-padded so every prompt
has the same number of tokens. TRL left-pads prompts of unequal length and the trainer then sees them at
shifted RoPE positions, which vLLM never does; equal lengths keep that mismatch source out of CPU runs
(see docs/numerics.md).
"""

from __future__ import annotations

import random
import re

OPERATORS = ("+", "-", "*")
_LEADING_INT = re.compile(r"\s*(-?\d+)")


def make_arith_problems(n: int, seed: int = 0, max_operand: int = 99, operators: tuple[str, ...] = ("+", "-"),
                        fixed_width: bool = False) -> list[dict[str, str]]:
    """``n`` problems ``a op b`` with ``0 <= a, b <= max_operand``, drawn from ``random.Random(seed)``."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    bad = [op for op in operators if op not in OPERATORS]
    if bad:
        raise ValueError(f"unknown operator(s) {bad}; valid: {list(OPERATORS)}")
    width = len(str(max_operand)) if fixed_width else 0
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(operators)
        value = a + b if op == "+" else a - b if op == "-" else a * b
        out.append({"prompt": f"What is {a:0{width}d}{op}{b:0{width}d}?", "answer": str(value)})
    return out


def arith_dataset(n: int, seed: int = 0, max_operand: int = 49):
    """A ``datasets.Dataset`` with columns ``prompt`` (fixed-width text) and ``answer``."""
    from datasets import Dataset

    return Dataset.from_list(make_arith_problems(n, seed=seed, max_operand=max_operand, fixed_width=True))


def arith_reward(completions: list[str], answer: list[str], **_) -> list[float]:
    """1.0 when the completion starts with the exact answer (an integer, then a non-digit or the end)."""
    out = []
    for text, gold in zip(completions, answer):
        m = _LEADING_INT.match(text if isinstance(text, str) else text[-1]["content"])
        out.append(1.0 if m and m.group(1) == gold else 0.0)
    return out
