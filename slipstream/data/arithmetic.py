"""Small arithmetic questions generated from a seed: an offline task with a verifiable answer
for RL (GRPO, configs/smollm2_grpo.yaml).

A row is `{"prompt": [{"role": "user", "content": question}], "answer": "42"}`: the prompt
in chat messages, the answer as the text the `accuracy` reward checks. Questions are distinct
`a op b` with operands in [low, high], in a seeded order; `skip` starts further along the same
order, so `arithmetic_rows(n)` and `arithmetic_rows(m, skip=n)` never share a question.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
# SmolLM2-135M-Instruct at temperature 0.7 on 12 questions x 4 (system "Be brief."), this
# question, 1..9 + 1..9: the right answer in any form 38%, ending in `Answer: N` 8%, both 6%
# (with - too: 33%, 8%, 2%).
# The earlier \boxed{} form (with the example \boxed{7}, then \boxed{100}) was boxed-right in
# 2%, and GRPO on it copied the example or never learned to box (docs/grpo.md).
QUESTION = 'What is {a} {op} {b}? End your reply with the line "Answer: " followed by the number.'


def arithmetic_rows(num_rows: int, *, seed: int = 0, skip: int = 0, low: int = 1, high: int = 9,
                    ops: str = "+", question: str = QUESTION,
                    system: str | None = None) -> list[dict]:  # fmt: skip
    """`num_rows` distinct questions `a op b` (a, b in [low, high], op from `ops`), seeded;
    `question` is the prompt's text with {a}, {op} and {b}; `system` a system message (None:
    the chat template's default)."""
    if low > high:
        raise ValueError(f"arithmetic_rows: low = {low} > high = {high}; give low <= high")
    if not ops or any(op not in OPERATIONS for op in ops):
        raise ValueError(f"arithmetic_rows: ops = {ops!r}; give some of {''.join(OPERATIONS)}")
    span = range(low, high + 1)
    triples = [(a, op, b) for op in dict.fromkeys(ops) for a in span for b in span]
    if skip + num_rows > len(triples):
        raise ValueError(
            f"arithmetic_rows: asked for rows {skip}..{skip + num_rows} but operands in "
            f"[{low}, {high}] with ops {ops!r} give only {len(triples)} distinct questions"
        )
    random.Random(seed).shuffle(triples)
    head = [] if system is None else [{"role": "system", "content": system}]
    return [
        {
            "prompt": [*head, {"role": "user", "content": question.format(a=a, op=op, b=b)}],
            "answer": str(OPERATIONS[op](a, b)),
        }
        for a, op, b in triples[skip : skip + num_rows]
    ]


def write_arithmetic(out_dir: str | Path, train_rows: int = 64, eval_rows: int = 17,
                     **options) -> Path:  # fmt: skip
    """`train.jsonl` and `eval.jsonl` of disjoint `arithmetic_rows` (options passed on) in
    `out_dir`: the data of configs/smollm2_grpo.yaml."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    parts = (("train.jsonl", arithmetic_rows(train_rows, **options)),
             ("eval.jsonl", arithmetic_rows(eval_rows, skip=train_rows, **options)))  # fmt: skip
    for name, rows in parts:
        with open(out / name, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return out
