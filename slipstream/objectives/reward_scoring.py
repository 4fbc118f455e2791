"""`slipstream score MODEL_DIR DATA`: every row of a data file scored by a reward model
(slipstream/scoring.py's `RewardScorer`).

Rows (jsonl/json/parquet/csv, or a hub id): a pair (`chosen`, `rejected`, optionally
`prompt`: both sides scored, tokenized as reward training tokenizes them, the accuracy
reported), a `prompt` + `completion`, `messages`, or `text` (standard text gets the eos, as
in training). Each output row is the input row with `score` (or `chosen_score` and
`rejected_score`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from slipstream.data.rows import RowError, unwrap_row
from slipstream.scoring import RewardScorer


def row_sequences(tokenizer: Any, row: Mapping[str, Any]) -> tuple[str, list[list[int]]]:
    """(kind, its token sequences) of one row to score: "pair" (chosen, rejected) or "one"."""
    from slipstream.objectives.pairs import encode_pair, token_ids

    if "chosen" in row and "rejected" in row:
        pair = encode_pair(tokenizer, row)
        return "pair", [pair.chosen, pair.rejected]
    if "messages" in row:
        return "one", [token_ids(tokenizer, row["messages"], {})]
    if "prompt" in row and "completion" in row:
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, list) != isinstance(completion, list):
            raise RowError("mixed_formats", "prompt and completion mix strings and messages")
        if isinstance(completion, str):
            return "one", [token_ids(tokenizer, prompt + _with_eos(completion, tokenizer), {})]
        return "one", [token_ids(tokenizer, prompt + completion, {})]
    if isinstance(row.get("text"), str):
        return "one", [token_ids(tokenizer, _with_eos(row["text"], tokenizer), {})]
    raise RowError(
        "no_columns", f"no chosen/rejected, prompt/completion, messages or text (keys: "
        f"{sorted(row)})"
    )  # fmt: skip


def _with_eos(text: str, tokenizer: Any) -> str:
    eos = tokenizer.eos_token
    return text + eos if eos and not text.endswith(eos) else text


def score_file(
    model: str, data: str, output: str | None, *, device: str = "cpu",
    tokens_per_batch: int = 8192,
) -> dict[str, Any]:  # fmt: skip
    """Score every row of `data`; rows with the scores to `output` (jsonl) or stdout; returns
    the summary (rows, mean score, pair accuracy). A malformed row is a one-line error."""
    from slipstream.data import load_rows

    scorer = RewardScorer(model, device=device, tokens_per_batch=tokens_per_batch)
    rows = load_rows(data)
    kinds, sequences = [], []
    for index, row in enumerate(rows):
        row = unwrap_row(row)
        try:
            kind, seqs = row_sequences(scorer.tokenizer, row)
        except RowError as e:
            raise ValueError(f"{data}: row {index}: {e}") from None
        kinds.append(kind)
        sequences += seqs
    scores = iter(scorer.score_ids(sequences))
    lines, singles, wins, pairs = [], [], 0, 0
    for row, kind in zip(rows, kinds, strict=True):
        row = dict(unwrap_row(row))
        if kind == "pair":
            c, r = next(scores), next(scores)
            row |= {"chosen_score": c, "rejected_score": r}
            wins, pairs = wins + (c > r), pairs + 1
            singles += [c, r]
        else:
            row["score"] = next(scores)
            singles.append(row["score"])
        lines.append(json.dumps(row, ensure_ascii=False))
    text = "".join(line + "\n" for line in lines)
    if output:
        from slipstream.checkpoint.atomic import atomic_write_text

        Path(output).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(Path(output), text)
    else:
        print(text, end="")
    return {
        "rows": len(lines),
        "mean_score": sum(singles) / len(singles),
        "pairs": pairs,
        "accuracy": wins / pairs if pairs else None,
    }
