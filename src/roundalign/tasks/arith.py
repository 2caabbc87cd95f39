"""Synthetic arithmetic: deterministic prompts with exact integer answers and an exact-match reward.

A problem is ``{"prompt": "What is 07+42?", "answer": "49"}``; completions look like ``" 49<eos>"``
(the prompt ends on a token boundary: byte-level BPE attaches a space to the following word); the same ``(n, seed, max_operand)``
always gives the same list. ``arith_dataset(style="fixed")`` zero-pads operands so every prompt has the same
number of tokens; ``style="variable"`` gives prompts of different token lengths (plain operands, three
phrasings), which TRL left-pads like MATH prompts: the runner scores them with positions from the attention
mask, so each sequence starts at RoPE position 0 as in vLLM.
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


VARIABLE_TEMPLATES = ("What is {q}?", "Compute {q}.", "Please work out the value of {q}?")


def arith_dataset(n: int, seed: int = 0, max_operand: int = 49, style: str = "fixed"):
    """A ``datasets.Dataset`` with columns ``prompt`` and ``answer``; ``style`` "fixed" (zero-padded operands,
    one template: equal token lengths) or "variable" (plain operands, templates drawn per problem)."""
    # the probe reads make_arith_problems only, so the library install (no datasets) runs it
    from datasets import Dataset  # noqa: PLC0415 -- optional: datasets (the harness extra)

    if style == "fixed":
        return Dataset.from_list(make_arith_problems(n, seed=seed, max_operand=max_operand, fixed_width=True))
    if style != "variable":
        raise ValueError(f"unknown arith prompt style {style!r}; valid: fixed, variable")
    rng = random.Random(seed + 1)
    rows = []
    for p in make_arith_problems(n, seed=seed, max_operand=max_operand, fixed_width=False):
        q = p["prompt"].removeprefix("What is ").removesuffix("?")
        rows.append({"prompt": rng.choice(VARIABLE_TEMPLATES).format(q=q), "answer": p["answer"]})
    return Dataset.from_list(rows)


def arith_reward(completions: list[str], answer: list[str], **_) -> list[float]:
    """1.0 when the completion starts with the exact answer (an integer, then a non-digit or the end)."""
    out = []
    for text, gold in zip(completions, answer):
        m = _LEADING_INT.match(text if isinstance(text, str) else text[-1]["content"])
        out.append(1.0 if m and m.group(1) == gold else 0.0)
    return out
