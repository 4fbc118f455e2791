"""The seeded arithmetic task (slipstream/data/arithmetic.py): deterministic rows, right answers,
disjoint train and eval, and its answers accepted by the `accuracy` reward."""

from __future__ import annotations

import json
import re

import pytest

from slipstream.data.arithmetic import arithmetic_rows, write_arithmetic

QUESTION = re.compile(r"What is (\d+) ([-+*]) (\d+)\? ")


def test_rows_are_seeded_and_right():
    rows = arithmetic_rows(50, seed=3, low=2, high=30, ops="+-*")
    assert rows == arithmetic_rows(50, seed=3, low=2, high=30, ops="+-*")
    assert rows != arithmetic_rows(50, seed=4, low=2, high=30, ops="+-*")
    for row in rows:
        (message,) = row["prompt"]
        assert message["role"] == "user" and set(row) == {"prompt", "answer"}
        a, op, b = QUESTION.match(message["content"]).groups()
        assert 2 <= int(a) <= 30 and 2 <= int(b) <= 30
        assert row["answer"] == str({"+": int(a) + int(b), "-": int(a) - int(b),
                                     "*": int(a) * int(b)}[op])  # fmt: skip
    assert {QUESTION.match(r["prompt"][0]["content"]).group(2) for r in rows} == {"+", "-", "*"}
    with_system = arithmetic_rows(50, seed=3, low=2, high=30, ops="+-*", system="Be brief.")
    assert [r["prompt"][0] for r in with_system] == [
        {"role": "system", "content": "Be brief."}
    ] * 50
    assert [r["prompt"][1:] for r in with_system] == [r["prompt"] for r in rows]


def test_write_train_and_eval_disjoint(tmp_path):
    out = write_arithmetic(tmp_path / "d", train_rows=60, eval_rows=20, low=1, high=9)
    train, held_out = (
        [json.loads(x) for x in (out / n).read_text().splitlines()]
        for n in ("train.jsonl", "eval.jsonl")
    )
    assert len(train) == 60 and len(held_out) == 20
    questions = {r["prompt"][0]["content"] for r in train}
    assert len(questions) == 60 and not questions & {r["prompt"][0]["content"] for r in held_out}
    assert train == arithmetic_rows(60, low=1, high=9)  # the default seed, reproducible
    with pytest.raises(ValueError, match=r"give only 81 distinct questions"):
        arithmetic_rows(80, skip=2, low=1, high=9)
    with pytest.raises(ValueError, match=r"ops = '/'"):
        arithmetic_rows(1, ops="/")


def test_accuracy_reward_checks_the_answers():
    pytest.importorskip("math_verify")
    from slipstream.rewards import build_rewards

    rows = arithmetic_rows(4, ops="-")
    rewards = build_rewards([{"function": "accuracy", "boxed": True}])
    right = [f"So it is \\boxed{{{r['answer']}}}." for r in rows]
    wrong = [f"\\boxed{{{int(r['answer']) + 1}}}" for r in rows]
    out = rewards([r["prompt"] for r in rows] * 2, right + wrong,
                  {"answer": [r["answer"] for r in rows] * 2}, list(range(4)) * 2)  # fmt: skip
    assert out[:, 0].tolist() == [1.0] * 4 + [0.0] * 4
