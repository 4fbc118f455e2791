"""A scalar score head for reward models, on any model that gives `hidden_states(ids, seq)`.

The head is `model.score`, an `nn.Linear(hidden_size, 1, bias=False)` in float32: the name,
shape and place of the head of transformers' `*ForSequenceClassification` (num_labels=1), so
its weight is saved as `score.weight` beside the backbone's `model.*` tensors and
`AutoModelForSequenceClassification` loads it. It reads nothing of a family but the final
hidden states, so a native family and the generic path carry it alike.

Which token scores a sequence is transformers' rule: the rightmost token that is not the pad
token (the last token when there is no pad id). It is found on the host from the token ids
(`score_positions`), so the device never searches for it.

Shapes: T packed tokens, D hidden size, S sequences.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


def add_score_head(model: nn.Module, weight: torch.Tensor | None = None) -> nn.Linear:
    """Give `model` a trainable float32 `score` head: `weight` (1, D), or drawn as
    transformers initialises it (normal, std = the config's initializer_range, 0.02 if unset)."""
    hidden = model.config.hidden_size
    device = next(model.parameters()).device
    head = nn.Linear(hidden, 1, bias=False, device=device, dtype=torch.float32)
    with torch.no_grad():
        if weight is None:
            std = float(model.config.hf.get("initializer_range", 0.02) or 0.02)
            head.weight.normal_(0.0, std)
        else:
            if tuple(weight.shape) != (1, hidden):
                raise ValueError(
                    f"score head weight has shape {tuple(weight.shape)}; the model's hidden "
                    f"size needs (1, {hidden})"
                )
            head.weight.copy_(weight)
    head.weight.requires_grad_(True)
    model.score = head
    return head


def pad_id_of(tokenizer) -> int | None:
    """The pad id a reward model scores with: the tokenizer's pad, else its eos (as TRL sets
    `config.pad_token_id`)."""
    pad = tokenizer.pad_token_id
    return pad if pad is not None else tokenizer.eos_token_id


def score_positions(ids_per_seq: Sequence[Sequence[int]], pad_token_id: int | None) -> list[int]:
    """For sequences packed one after another: the packed index of each one's scoring token,
    transformers' rule (the rightmost token != pad_token_id; the last without a pad id; the
    first when every token is the pad)."""
    out, start = [], 0
    for ids in ids_per_seq:
        pick = len(ids) - 1
        if pad_token_id is not None:
            pick = next((t for t in range(len(ids) - 1, -1, -1) if ids[t] != pad_token_id), 0)
        out.append(start + pick)
        start += len(ids)
    return out


def sequence_scores(
    model: nn.Module, input_ids_T: torch.Tensor, seq, positions_S: torch.Tensor
) -> torch.Tensor:
    """(S,) float32 scores: the head on the final hidden state at each sequence's scoring
    position (`positions_S`, host-built int64); one forward, no host sync."""
    h_SD = model.hidden_states(input_ids_T, seq).index_select(0, positions_S)
    return F.linear(h_SD.float(), model.score.weight.float()).squeeze(-1)
