"""Reward-model data: preference rows tokenized as TRL 1.16's `RewardTrainer` tokenizes them,
and P pairs packed as 2P scored sequences.

Tokens: each side whole (`prompt + chosen`, `prompt + rejected`; the chat template without a
generation prompt for conversations, the eos appended to standard text), as
objectives/pairs.py's `encode_pair` builds a pair's sequences. An optional `margin` column
(a number per row; TRL's margin) joins the loss. Each sequence's scoring position is fixed
here, from its ids: transformers' rule with the pad id TRL gives the model (the tokenizer's
pad, else its eos; models/score_head.py).

Shapes: T packed tokens, S = 2P sequences, P pairs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from slipstream.data.packed import PackedBuilder, PackedView, packed_field
from slipstream.data.rows import DataReport, LengthLimit, RowError, encode_rows, row_columns
from slipstream.models.score_head import pad_id_of, score_positions
from slipstream.objectives.pairs import check_pair_columns, encode_pair


@dataclass
class RewardPair:
    """A pair's two sequences, each one's scoring index, and the pair's margin."""

    chosen: list[int]
    rejected: list[int]
    chosen_at: int
    rejected_at: int
    margin: float = 0.0
    pad: int | None = None  # the scoring rule's pad id, which a cut sequence is scored by

    prompt_len = 0  # the whole sequence is scored: a cut keeps no prompt whole

    def __len__(self) -> int:
        return len(self.chosen) + len(self.rejected)

    def longest(self) -> int:
        return max(len(self.chosen), len(self.rejected))

    def cut(self, max_tokens: int) -> RewardPair:
        return scored_pair(self.chosen[:max_tokens], self.rejected[:max_tokens], self.pad,
                           self.margin)  # fmt: skip

    def counts(self) -> tuple[int, int]:
        return len(self), 2  # the targets: two scores


def _margin(row: Any) -> float:
    value = row.get("margin", 0.0)
    if value is None:
        raise RowError("margin", "'margin' is null; give a number")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RowError("margin", f"'margin' is {value!r}; give a finite number")
    return float(value)


def encode_reward_pair(tokenizer: Any, row: Any, pad_token_id: int | None) -> RewardPair:
    pair = encode_pair(tokenizer, row)
    return scored_pair(pair.chosen, pair.rejected, pad_token_id, _margin(row))


def scored_pair(chosen: list[int], rejected: list[int], pad: int | None, margin: float):
    (chosen_at,), (rejected_at,) = score_positions([chosen], pad), score_positions([rejected], pad)
    return RewardPair(chosen, rejected, chosen_at, rejected_at, margin, pad)


def tokenize_reward_pairs(
    rows: Any,
    tokenizer: Any,
    *,
    max_tokens: int,
    overlong: str = "drop",
    strict: bool = False,
    first_row: int = 0,
) -> tuple[list[RewardPair], DataReport]:
    """Rows (a `datasets.Dataset` or list of dicts) to pairs; every skip counted."""
    check_pair_columns(row_columns(rows), "reward")
    pad = pad_id_of(tokenizer)
    report, limit = DataReport(rows=len(rows)), LengthLimit(max_tokens, overlong)

    def encode(row: Mapping[str, Any], index: int):  # -> rows.Encoded
        row = {k: v for k, v in row.items() if v is not None or k in ("chosen", "rejected")}
        return limit.encoded(encode_reward_pair(tokenizer, row, pad), report)

    examples = encode_rows(rows, encode, report, strict, first_row)
    if not examples:
        raise ValueError(f"no usable preference pairs: {report.summary()}")
    return examples, report


@dataclass(eq=False)
class RewardBatch(PackedView):
    """P pairs as 2P packed sequences (chosen, rejected, chosen, ...), a view of the packed
    batch (data/packed.py): `input_ids`, `seq`; `score_positions` (2P,) each sequence's
    scoring index in the packed stream; `margins` (P,) float. Host int: `num_pairs`."""

    num_pairs: int

    score_positions = packed_field("score_positions")
    margins = packed_field("margins")


def collate_reward_pairs(examples: Sequence[RewardPair]) -> RewardBatch:
    """Pack pairs into one batch (see RewardBatch); nothing is scored by the LM head."""
    if not examples:
        raise ValueError("collate_reward_pairs: no pairs; a batch needs at least one.")
    builder = PackedBuilder()
    positions, start = [], 0
    for ex in examples:
        for ids, at in ((ex.chosen, ex.chosen_at), (ex.rejected, ex.rejected_at)):
            builder.add(ids, [])
            positions.append(start + at)
            start += len(ids)
    builder.put("score_positions", torch.tensor(positions, dtype=torch.int64))
    builder.put("margins", torch.tensor([ex.margin for ex in examples], dtype=torch.float32))
    return RewardBatch(builder.build(), len(examples))
