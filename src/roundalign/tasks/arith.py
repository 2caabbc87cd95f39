"""Synthetic arithmetic problems: deterministic prompts with exact integer answers.

Used by the probe and by CPU training runs. A problem is ``{"prompt": "What is 12+7?", "answer": "19"}``;
the same ``(n, seed, max_operand)`` always gives the same list.
"""

from __future__ import annotations

import random

OPERATORS = ("+", "-", "*")


def make_arith_problems(n: int, seed: int = 0, max_operand: int = 99, operators: tuple[str, ...] = ("+", "-")
                        ) -> list[dict[str, str]]:
    """``n`` problems ``a op b`` with ``0 <= a, b <= max_operand``, drawn from ``random.Random(seed)``."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    bad = [op for op in operators if op not in OPERATORS]
    if bad:
        raise ValueError(f"unknown operator(s) {bad}; valid: {list(OPERATORS)}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(operators)
        value = a + b if op == "+" else a - b if op == "-" else a * b
        out.append({"prompt": f"What is {a}{op}{b}?", "answer": str(value)})
    return out
