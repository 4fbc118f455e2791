"""Conversations from the `chitchat-dataset` package as chat `messages` rows (for the demo).

The package ships its data (`dataset.json`, ~7k two-person conversations) inside itself; we
read that file where the package is installed and never copy it. Each conversation is a list
of turns, each turn a list of utterances by one sender; a turn becomes one message (utterances
joined by newlines), the first speaker is the user and speakers alternate.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import random
from pathlib import Path

INSTALL_HINT = "pip install chitchat-dataset"


def _dataset_path() -> Path:
    spec = importlib.util.find_spec("chitchat_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the chitchat-dataset package is not installed; run: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / "dataset.json"
    if not path.is_file():
        raise ValueError(f"chitchat-dataset has no {path.name} at {path}; run: {INSTALL_HINT}")
    return path


@functools.lru_cache(maxsize=1)
def _all_conversations() -> tuple[tuple[str, ...], ...]:
    # Reading the 40 MB file takes ~0.5 s; cached because the demo asks for train and eval.
    data = json.loads(_dataset_path().read_text(encoding="utf-8"))
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


def chitchat_rows(num_rows: int, *, seed: int = 0, max_turns: int = 8, skip: int = 0) -> list[dict]:
    """`num_rows` chat rows `{"messages": [...]}` from a seeded sample of conversations.

    Each keeps its first `max_turns` turns (user first, alternating, ending on the assistant).
    `skip` drops the first rows of the same seeded order, so disjoint train/eval sets are
    `chitchat_rows(n, skip=0)` and `chitchat_rows(m, skip=n)`.
    """
    if max_turns < 2:
        raise ValueError(f"chitchat_rows: max_turns = {max_turns}; need >= 2 (a user and a reply).")
    convs = [c for c in _all_conversations() if len(c) >= 2]
    order = list(range(len(convs)))
    random.Random(seed).shuffle(order)
    if skip + num_rows > len(order):
        raise ValueError(
            f"chitchat_rows: asked for rows {skip}..{skip + num_rows} but only {len(order)} "
            "conversations have two or more turns."
        )
    rows = []
    for i in order[skip : skip + num_rows]:
        turns = convs[i][:max_turns]
        turns = turns[: len(turns) - len(turns) % 2]  # end on the assistant's turn
        roles = ("user", "assistant")
        rows.append(
            {"messages": [{"role": roles[j % 2], "content": t} for j, t in enumerate(turns)]}
        )
    return rows
