"""Tasks: arith prompts and reward; math loader and math-verify reward on a local fixture."""

import json
import re
from pathlib import Path

import pytest

from roundalign.models.fetch import fetch_model, prepare_math_data
from roundalign.models.load import load_tokenizer
from roundalign.models.tiny import make_tiny
from roundalign.tasks.arith import arith_reward, make_arith_problems
from roundalign.tasks.math import gold_answer, last_boxed, load_math_dataset, math_reward

FIXTURE = Path(__file__).parent / "fixtures/math_small.jsonl"


def test_arith_is_deterministic_and_correct():
    a = make_arith_problems(50, seed=3, max_operand=49, operators=("+", "-", "*"), fixed_width=True)
    assert a == make_arith_problems(50, seed=3, max_operand=49, operators=("+", "-", "*"), fixed_width=True)
    for p in a:
        expr = p["prompt"].removeprefix("What is ").removesuffix("?")
        assert int(p["answer"]) == eval(_strip_zeros(expr))  # "07+42" -> "7+42"
        assert len(p["prompt"]) == len("What is 07+42?")  # fixed width: every prompt the same length


def _strip_zeros(expr: str) -> str:
    return re.sub(r"\b0+(\d)", r"\1", expr)


def test_fixed_width_prompts_have_equal_token_counts(tmp_path):
    tok = load_tokenizer(str(make_tiny("qwen2", tmp_path / "m")))
    lengths = {len(tok(p["prompt"], add_special_tokens=False)["input_ids"])
               for p in make_arith_problems(200, seed=0, max_operand=49, fixed_width=True)}
    assert len(lengths) == 1


def test_arith_reward_exact_leading_integer():
    assert arith_reward([" 49", "49<", " 491", "-3 apples", "x49", " 7"], ["49", "49", "49", "-3", "49", "8"]) == \
        [1.0, 1.0, 0.0, 1.0, 0.0, 0.0]


def test_math_loader_and_gold_answers():
    ds = load_math_dataset(str(FIXTURE))
    assert ds["answer"] == ["5", "\\frac{3}{4}", "3", "72"]
    assert ds[0]["prompt"][0]["role"] == "system" and ds[0]["prompt"][1]["content"] == "What is $2+3$?"
    assert len(load_math_dataset(str(FIXTURE), limit=2)) == 2
    assert last_boxed("a \\boxed{\\frac{1}{2}} b \\boxed{x^{2}}") == "x^{2}"
    assert gold_answer({"answer": "so\n#### 1,234"}) == "1,234"


def test_unbraced_and_fbox_answers_parse_and_rows_without_gold_are_skipped(tmp_path):
    assert last_boxed("so $\\boxed 2$.") == "2"
    assert last_boxed("first \\boxed{1}, then $\\fbox{\\frac{1}{2}}$") == "\\frac{1}{2}"
    assert last_boxed("\\fbox{3} and later \\boxed 7") == "7"
    assert last_boxed("\\boxed{unclosed") is None and gold_answer({"solution": "no answer here"}) is None
    assert gold_answer({"solution": "\\boxed{}"}) is None
    rows = [{"problem": "a", "solution": "$\\boxed 2$"}, {"problem": "b", "solution": "none given"},
            {"problem": "c", "solution": "$\\fbox{x+1}$"}, {"problem": "d", "answer": None, "solution": ""}]
    data = tmp_path / "m.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    logs = []
    ds = load_math_dataset(str(data), log=logs.append)
    assert ds["answer"] == ["2", "x+1"] and [p[1]["content"] for p in ds["prompt"]] == ["a", "c"]
    assert logs == [f"[math] {data}: skipped 2 of 4 rows without a gold answer (no \\boxed{{}}/\\fbox{{}}, '####' or "
                    "answer value)"]

    out = prepare_math_data(str(data), "train", tmp_path / "p.jsonl", log=lambda *_: None)
    assert [json.loads(x)["answer"] for x in out.read_text().splitlines()] == ["2", "x+1"]
    data.write_text(json.dumps(rows[1]) + "\n")
    with pytest.raises(ValueError, match="none of its 1 rows has a gold answer"):
        load_math_dataset(str(data), log=lambda *_: None)


def test_math_reward_uses_math_verify_equivalence():
    gold = ["5", "\\frac{3}{4}", "3", "72"]
    completions = ["thus \\boxed{5}", "we get \\boxed{0.75}", "x = \\boxed{-3}", [{"role": "assistant",
                                                                                 "content": "total \\boxed{72}"}]]
    assert math_reward(completions, gold) == [1.0, 1.0, 0.0, 1.0]


def test_math_loader_errors_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_math_dataset(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no problem column", "answer": "1"}\n')
    with pytest.raises(ValueError, match="problem columns"):
        load_math_dataset(str(bad))


def test_prepared_math_data_round_trips(tmp_path):
    out = prepare_math_data(str(FIXTURE), "train", tmp_path / "d/math.jsonl", log=lambda *_: None)
    again = load_math_dataset(str(out))
    assert again["answer"] == load_math_dataset(str(FIXTURE))["answer"]
    assert again[0]["prompt"][1]["content"] == "What is $2+3$?"


def test_fetch_model_without_network_fails_clearly_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RuntimeError, match=r"(?s)could not download org/not-cached.*network access"):
        fetch_model("org/not-cached", tmp_path / "m", log=lambda *_: None)
    assert list(tmp_path.iterdir()) == []
