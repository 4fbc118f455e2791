"""Conversations from the `chitchat-dataset` package as chat `messages` rows (for the demo).

The package ships its data (`dataset.json`, ~7k two-person conversations) inside itself; we
read that file where the package is installed and never copy it. Each conversation is a list
of turns, each turn a list of utterances by one sender; a turn becomes one message (utterances
joined by newlines), the first speaker is the user and speakers alternate.
"""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path

from slipstream.sources import package_file

INSTALL_HINT = "pip install chitchat-dataset"


@functools.lru_cache(maxsize=1)
def _all_conversations() -> tuple[tuple[str, ...], ...]:
    # Reading the 40 MB file takes ~0.5 s; cached because the demo asks for train and eval.
    path = package_file("chitchat_dataset", "dataset.json", INSTALL_HINT)
    data = json.loads(path.read_text(encoding="utf-8"))
    out = []
    for conv in data.values():
        turns = [
            "\n".join(u["text"].strip() for u in turn if u["text"].strip())
            for turn in conv["messages"]
        ]
        out.append(tuple(t for t in turns if t))
    return tuple(out)


def chitchat_conversations(limit: int | None = None) -> list[list[str]]:
    """The first `limit` conversations (all if None), each a list of turn texts."""
    convs = _all_conversations()
    return [list(c) for c in (convs if limit is None else convs[:limit])]


def _shuffled_conversations(
    num_rows: int, seed: int, skip: int, who: str
) -> tuple[list[list[str]], list[int]]:
    """Conversations of two or more turns and their seeded order; an error naming `who` when
    rows `skip..skip+num_rows` go past the end."""
    convs = [c for c in _all_conversations() if len(c) >= 2]
    order = list(range(len(convs)))
    random.Random(seed).shuffle(order)
    if skip + num_rows > len(order):
        raise ValueError(
            f"{who}: asked for rows {skip}..{skip + num_rows} but only {len(order)} "
            "conversations have two or more turns."
        )
    return convs, order


def chitchat_rows(num_rows: int, *, seed: int = 0, max_turns: int = 8, skip: int = 0) -> list[dict]:
    """`num_rows` chat rows `{"messages": [...]}` from a seeded sample of conversations.

    Each keeps its first `max_turns` turns (user first, alternating, ending on the assistant).
    `skip` drops the first rows of the same seeded order, so disjoint train/eval sets are
    `chitchat_rows(n, skip=0)` and `chitchat_rows(m, skip=n)`.
    """
    if max_turns < 2:
        raise ValueError(f"chitchat_rows: max_turns = {max_turns}; need >= 2 (a user and a reply).")
    convs, order = _shuffled_conversations(num_rows, seed, skip, "chitchat_rows")
    rows = []
    for i in order[skip : skip + num_rows]:
        turns = convs[i][:max_turns]
        turns = turns[: len(turns) - len(turns) % 2]  # end on the assistant's turn
        roles = ("user", "assistant")
        rows.append(
            {"messages": [{"role": roles[j % 2], "content": t} for j, t in enumerate(turns)]}
        )
    return rows


def chitchat_pairs(
    num_rows: int, *, seed: int = 0, skip: int = 0, context_turns: int = 3
) -> list[dict]:
    """`num_rows` preference rows (TRL's conversational format, explicit prompt) from chitchat:
    the prompt is a conversation's first turns (1 to `context_turns`, odd: ending on the
    user), `chosen` the reply that followed, `rejected` a reply from another conversation.

    Seeded, and `skip` works as in `chitchat_rows`: disjoint sets for train and held-out.
    """
    convs, order = _shuffled_conversations(num_rows, seed, skip, "chitchat_pairs")
    rng = random.Random(seed * 7919 + skip)
    roles = ("user", "assistant")
    rows = []
    for i in order[skip : skip + num_rows]:
        turns = convs[i]
        n = rng.randrange(1, min(context_turns, len(turns) - 1) + 1, 2)  # odd: ends on user
        other = convs[rng.choice([j for j in rng.sample(order, 3) if j != i])]
        rejected = other[rng.randrange(1, len(other), 2) if len(other) > 1 else 0]
        if rejected == turns[n]:
            rejected = other[0]
        rows.append(
            {
                "prompt": [{"role": roles[j % 2], "content": t} for j, t in enumerate(turns[:n])],
                "chosen": [{"role": "assistant", "content": turns[n]}],
                "rejected": [{"role": "assistant", "content": rejected}],
            }
        )
    return rows


def write_chitchat_pairs(out_dir: str | Path, train_rows: int = 800, eval_rows: int = 64) -> Path:
    """`train.jsonl` and `eval.jsonl` of disjoint `chitchat_pairs` in `out_dir` (the data of
    configs/smollm2_dpo.yaml)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    parts = (("train.jsonl", chitchat_pairs(train_rows)),
             ("eval.jsonl", chitchat_pairs(eval_rows, skip=train_rows)))  # fmt: skip
    for name, rows in parts:
        with open(out / name, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return out
