"""Digit-string tasks with long completions: copy, reverse or sort a string of digits, graded exactly.

A problem is ``{"prompt": "Reverse 40172:", "answer": "27104"}``; a completion looks like ``" 27104<eos>"``.
Digits are single tokens in the tiny tokenizer (Qwen's pre-tokenizer splits numbers into digits), so an
answer of L digits is L + 1 completion tokens: with L in the tens, the train-vs-engine mismatch adds up over
tens of tokens per sequence, which the sequence-level statistics (and MIS) see. Prompt lengths vary with L.

Reward (deterministic, exact): the digits the completion starts with are read; the reward is the length of their
longest common prefix with the answer divided by the longer of the two lengths, so 1.0 exactly when the digits
read are the answer, and extra digits cost as much as missing ones. Partial credit keeps a learning signal for
a tiny policy that gets long strings almost right.
"""

from __future__ import annotations

import random
import re

from datasets import Dataset

OPS = ("copy", "reverse", "sort")
_VERBS = {"copy": "Copy", "reverse": "Reverse", "sort": "Sort"}
_DIGITS = re.compile(r"\s*(\d*)")


def solve(op: str, digits: str) -> str:
    if op == "copy":
        return digits
    if op == "reverse":
        return digits[::-1]
    if op == "sort":
        return "".join(sorted(digits))
    raise ValueError(f"unknown digits op {op!r}; valid: {', '.join(OPS)}")


def make_digits_problems(n: int, seed: int = 0, op: str = "copy", min_len: int = 8, max_len: int = 32,
                         len_step: int = 1) -> list[dict[str, str]]:
    """``n`` problems with string lengths in ``range(min_len, max_len + 1, len_step)``, from ``random.Random(seed)``."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if op not in OPS:
        raise ValueError(f"unknown digits op {op!r}; valid: {', '.join(OPS)}")
    if not 1 <= min_len <= max_len or len_step < 1:
        raise ValueError(f"need 1 <= min_len ({min_len}) <= max_len ({max_len}) and len_step ({len_step}) >= 1")
    lengths = list(range(min_len, max_len + 1, len_step))
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        digits = "".join(rng.choice("0123456789") for _ in range(rng.choice(lengths)))
        out.append({"prompt": f"{_VERBS[op]} {digits}:", "answer": solve(op, digits)})
    return out


def digits_dataset(n: int, seed: int = 0, op: str = "copy", min_len: int = 8, max_len: int = 32, len_step: int = 1):
    """A ``datasets.Dataset`` with columns ``prompt`` and ``answer``."""
    return Dataset.from_list(make_digits_problems(n, seed, op, min_len, max_len, len_step))


def digits_reward(completions: list, answer: list[str], **_) -> list[float]:
    """Common prefix of the digits read and the answer / the longer length (1.0 iff they are exactly the answer)."""
    out = []
    for text, gold in zip(completions, answer):
        text = text if isinstance(text, str) else text[-1]["content"]
        got = _DIGITS.match(text).group(1)
        if got == gold:
            out.append(1.0)
            continue
        k = 0
        while k < min(len(got), len(gold)) and got[k] == gold[k]:
            k += 1
        out.append(k / max(len(got), len(gold)))
    return out
