"""Scoring with a reward model: `slipstream score MODEL_DIR data.jsonl` and GRPO's
`rewards: [model:DIR]` (rewards/model.py).

`RewardScorer(dir)` loads a reward model (checkpoint/reward_model.py: a full one or a LoRA
adapter with its score head) and its tokenizer (the one saved with it, else the base's)
and scores token sequences packed without padding, `tokens_per_batch` at a time, each at
transformers' scoring token with the pad id the model was trained with.

Rows `score` reads (jsonl/json/parquet/csv, or a hub id): a pair (`chosen`, `rejected`,
optionally `prompt`: both sides scored, tokenized as reward training tokenizes them, the
accuracy reported), a `prompt` + `completion`, `messages`, or `text` (standard text gets
the eos, as in training). Each output row is the input row with `score` (or `chosen_score`
and `rejected_score`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from slipstream.checkpoint.reward_model import load_reward_model
from slipstream.data.rows import RowError, unwrap_row
from slipstream.models.score_head import score_positions, sequence_scores
from slipstream.ops.packing import SeqInfo


class RewardScorer:
    """A reward model ready to score sequences (module docstring)."""

    def __init__(self, path: str | Path, device: str | torch.device = "cpu",
                 tokens_per_batch: int = 8192) -> None:  # fmt: skip
        from slipstream.checkpoint.adapter import tokenizer_source
        from slipstream.checkpoint.tokenizer import load_tokenizer
        from slipstream.objectives.reward_data import pad_id_of
        from slipstream.sources import adapter_base

        path = Path(path)
        if not path.exists():
            raise ValueError(f"reward model {path} does not exist")
        self.device = torch.device(device)
        self.model = load_reward_model(path, device=self.device).eval()
        source = str(path)
        if (path / "adapter_config.json").is_file():
            source = tokenizer_source(path, adapter_base(path))
        self.tokenizer = load_tokenizer(source, "reward model")
        self.pad_id = getattr(self.model, "score_pad_token_id", pad_id_of(self.tokenizer))
        self.tokens_per_batch = tokens_per_batch

    @torch.no_grad()
    def score_ids(self, sequences: Sequence[Sequence[int]]) -> list[float]:
        """One score per token sequence, in order (one host read per packed batch)."""
        out: list[float] = []
        start = 0
        while start < len(sequences):
            end, total = start, 0
            while end < len(sequences) and (end == start or total + len(sequences[end])
                                            <= self.tokens_per_batch):  # fmt: skip
                total += len(sequences[end])
                end += 1
            part = [list(s) for s in sequences[start:end]]
            ids = torch.tensor([t for s in part for t in s], dtype=torch.int64)
            positions = torch.tensor(score_positions(part, self.pad_id), dtype=torch.int64)
            seq = SeqInfo.from_lengths([len(s) for s in part], device=self.device)
            scores = sequence_scores(self.model, ids.to(self.device), seq,
                                     positions.to(self.device))  # fmt: skip
            out += scores.float().cpu().tolist()
            start = end
        return out

    def score_texts(self, texts: Sequence[str]) -> list[float]:
        """Scores of whole texts tokenized as they are (no special tokens added: TRL's GRPO)."""
        ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        return self.score_ids(ids)


def row_sequences(tokenizer: Any, row: Mapping[str, Any]) -> tuple[str, list[list[int]]]:
    """(kind, its token sequences) of one row to score: "pair" (chosen, rejected) or "one"."""
    from slipstream.objectives.pairs import _ids, encode_pair

    if "chosen" in row and "rejected" in row:
        pair = encode_pair(tokenizer, row)
        return "pair", [pair.chosen, pair.rejected]
    if "messages" in row:
        return "one", [_ids(tokenizer, row["messages"], {})]
    if "prompt" in row and "completion" in row:
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, list) != isinstance(completion, list):
            raise RowError("mixed_formats", "prompt and completion mix strings and messages")
        if isinstance(completion, str):
            return "one", [_ids(tokenizer, prompt + _with_eos(completion, tokenizer), {})]
        return "one", [_ids(tokenizer, prompt + completion, {})]
    if isinstance(row.get("text"), str):
        return "one", [_ids(tokenizer, _with_eos(row["text"], tokenizer), {})]
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
