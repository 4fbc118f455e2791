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
from dataclasses import dataclass, field
from typing import Any

import torch

from slipstream.data.rows import DataReport, Encoded, RowError, encode_rows, row_columns
from slipstream.models.score_head import score_positions
from slipstream.objectives.pairs import check_pair_columns, encode_pair
from slipstream.ops.packing import SeqInfo, to_device


@dataclass
class RewardPair:
    """A pair's two sequences, each one's scoring index, and the pair's margin."""

    chosen: list[int]
    rejected: list[int]
    chosen_at: int
    rejected_at: int
    margin: float = 0.0

    def __len__(self) -> int:
        return len(self.chosen) + len(self.rejected)


def pad_id_of(tokenizer: Any) -> int | None:
    """The pad id a reward model scores with: the tokenizer's pad, else its eos (TRL)."""
    pad = tokenizer.pad_token_id
    return pad if pad is not None else tokenizer.eos_token_id


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
    return RewardPair(chosen, rejected, chosen_at, rejected_at, margin)


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
    report = DataReport(rows=len(rows))

    def encode(row: Mapping[str, Any], index: int) -> Encoded:
        row = {k: v for k, v in row.items() if v is not None or k in ("chosen", "rejected")}
        ex = encode_reward_pair(tokenizer, row, pad)
        longest = max(len(ex.chosen), len(ex.rejected))
        if longest > max_tokens:
            if overlong == "drop":
                return Encoded(None, longest)
            ex = scored_pair(ex.chosen[:max_tokens], ex.rejected[:max_tokens], pad, ex.margin)
            report.truncated += 1
        return Encoded(ex, len(ex), 2)  # the targets: two scores

    examples = encode_rows(rows, encode, report, strict, first_row)
    if not examples:
        raise ValueError(f"no usable preference pairs: {report.summary()}")
    return examples, report


@dataclass
class RewardBatch:
    """P pairs as 2P packed sequences (chosen, rejected, chosen, ...): `input_ids` (T,),
    `positions` (2P,) each sequence's scoring index, `margins` (P,) float; `num_pairs`."""

    input_ids: torch.Tensor
    seq: SeqInfo
    positions: torch.Tensor
    margins: torch.Tensor
    num_pairs: int
    _host: list[torch.Tensor] = field(default_factory=list, repr=False)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def to(self, device: torch.device | str) -> RewardBatch:
        ints, floats = (to_device(buf, device) for buf in self._host)
        T = self.input_ids.numel()
        return RewardBatch(ints[:T], self.seq.to(device), ints[T:], floats, self.num_pairs,
                           [ints, floats])  # fmt: skip


def collate_reward_pairs(examples: Sequence[RewardPair]) -> RewardBatch:
    if not examples:
        raise ValueError("collate_reward_pairs: no pairs; a batch needs at least one.")
    ids: list[int] = []
    positions: list[int] = []
    lengths: list[int] = []
    for ex in examples:
        for seq_ids, at in ((ex.chosen, ex.chosen_at), (ex.rejected, ex.rejected_at)):
            positions.append(len(ids) + at)
            ids.extend(seq_ids)
            lengths.append(len(seq_ids))
    ints = torch.tensor(ids + positions, dtype=torch.int64)
    floats = torch.tensor([ex.margin for ex in examples], dtype=torch.float32)
    if torch.cuda.is_available():
        ints, floats = ints.pin_memory(), floats.pin_memory()
    T = len(ids)
    return RewardBatch(ints[:T], SeqInfo.from_lengths(lengths), ints[T:], floats, len(examples),
                       [ints, floats])  # fmt: skip
