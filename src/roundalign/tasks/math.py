"""Math word problems from a dataset, graded by math-verify, in the model's chat template.

``load_math_dataset`` reads a local json/jsonl file or a hub dataset (``datasets.load_dataset``; hub ids
need network access or a pre-filled HF cache). Each row becomes a conversational prompt (system
instruction + problem) and the gold answer: the last ``\\boxed{...}`` of the reference solution, or an
``answer`` column when present (GSM8K's ``#### 42`` form is understood too).
"""

from __future__ import annotations

from pathlib import Path

from datasets import load_dataset
from math_verify import parse, verify

SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."
_PROBLEM_COLUMNS = ("problem", "question", "prompt")
_SOLUTION_COLUMNS = ("answer", "solution")


_BOX_COMMANDS = ("\\boxed", "\\fbox")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` or ``\\fbox{...}`` in ``text`` (balanced braces), or of the brace-less
    form ``\\boxed 2`` (up to the closing ``$``, as MATH's reference grader reads it); None when there is none
    or its braces never close."""
    best = None  # (position, command) of the last box command followed by "{" or " "
    for cmd in _BOX_COMMANDS:
        for sep in ("{", " "):
            pos = text.rfind(cmd + sep)
            if pos >= 0 and (best is None or pos > best[0]):
                best = (pos, cmd + sep)
    if best is None:
        return None
    pos, head = best
    i = pos + len(head)
    if head.endswith(" "):
        content = text[i:].split("$", 1)[0].strip()
        return content or None
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def gold_answer(row: dict) -> str | None:
    """The gold answer of a dataset row: the last box of ``answer``/``solution``, GSM8K's ``#### 42``, or a plain
    ``answer`` value; None when the row has none (such rows are skipped by ``load_math_dataset``)."""
    for col in _SOLUTION_COLUMNS:
        value = row.get(col)
        if value is None:
            continue
        value = str(value)
        boxed = last_boxed(value)
        if boxed is not None and boxed.strip():
            return boxed
        if "####" in value:
            return value.rsplit("####", 1)[1].strip() or None
        if col == "answer" and value.strip():
            return value.strip()
    return None


def load_math_dataset(name_or_path: str, split: str = "train", limit: int | None = None, log=print):
    """Dataset with columns ``prompt`` (chat messages) and ``answer`` (gold answer string). Rows without a gold
    answer are skipped and counted (one log line), never an error; ``limit`` caps the rows kept."""
    path = Path(name_or_path)
    if path.suffix in (".json", ".jsonl") or path.exists():
        if not path.is_file():
            raise FileNotFoundError(f"math dataset file {path} does not exist")
        ds = load_dataset("json", data_files=str(path), split="train")
    else:
        try:
            ds = load_dataset(name_or_path, split=split)
        except Exception as exc:  # datasets raises many types for offline/unknown ids
            raise RuntimeError(
                f"could not load the math dataset {name_or_path!r} (split {split!r}): {exc}. Hub datasets need "
                "network access or a pre-filled HF cache; or pass a local .jsonl file with problem/solution "
                "columns as math_dataset.") from None
    problem_col = next((c for c in _PROBLEM_COLUMNS if c in ds.column_names), None)
    if problem_col is None:
        raise ValueError(f"math dataset {name_or_path!r} has none of the problem columns {_PROBLEM_COLUMNS}; "
                         f"it has {ds.column_names}")
    answers = [gold_answer(row) for row in ds]
    keep = [i for i, a in enumerate(answers) if a is not None]
    if len(keep) < len(ds):
        log(f"[math] {name_or_path}: skipped {len(ds) - len(keep)} of {len(ds)} rows without a gold answer "
            f"(no \\boxed{{}}/\\fbox{{}}, '####' or answer value)")
        if not keep:
            raise ValueError(f"math dataset {name_or_path!r}: none of its {len(ds)} rows has a gold answer in "
                             f"the columns {_SOLUTION_COLUMNS}")
        ds = ds.select(keep)
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    return ds.map(lambda row: {"prompt": [{"role": "system", "content": SYSTEM_PROMPT},
                                          {"role": "user", "content": str(row[problem_col])}],
                               "answer": gold_answer(row)},
                  remove_columns=ds.column_names)


def math_reward(completions, answer: list[str], **_) -> list[float]:
    """1.0 when math-verify finds the completion's final answer equal to the gold answer, else 0.0."""
    out = []
    for completion, gold in zip(completions, answer):
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        try:
            ok = verify(parse(f"${gold}$" if "\\boxed" not in gold else gold), parse(text))
        except Exception:  # math-verify can raise on pathological input; that completion earns nothing
            ok = False
        out.append(1.0 if ok else 0.0)
    return out
