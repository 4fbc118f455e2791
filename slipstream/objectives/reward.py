"""Reward modelling (`train.objective: reward`): a scalar head on the last token of each packed
sequence, trained with the Bradley-Terry loss as TRL 1.16's `RewardTrainer` trains it.

Data: preference pairs, TRL's formats (`chosen`, `rejected`, optionally `prompt`;
objectives/pairs.py), with an optional `margin` column. Each side is tokenized whole, as TRL
does (the prompt's tokens joined to the chosen's or rejected's; standard text gets the eos).
A micro-batch packs P pairs as 2P sequences (chosen, rejected of each pair in turn) without
padding; each sequence is scored at transformers' scoring token (models/score_head.py:
the rightmost token that is not the pad, pad = the tokenizer's pad or eos, as TRL sets it).

Per pair, with c, r the chosen and rejected scores, m the margin (0 without one) and
mu = `reward.center_rewards_coefficient`:
    loss = -logsigmoid(c - r - m) + mu * (c + r)^2
which, averaged over the pairs, is TRL's loss (its centring term is mu * mean((c + r)^2)).
The trainer normalises by pairs (`weight`), so grad-accum and data parallelism equal one
batch of all the pairs. Metrics (TRL's names, summed over pairs; the trainer divides by the
pairs): `accuracy` (c > r), `margin` (c - r), `mean_reward` ((c + r) / 2: the mean of all
scores); `min_reward` / `max_reward`, the extremes of every score, reduced by min / max
over micro-batches, steps and ranks (`metric_extremes`, train/extremes.py).

The result is a reward model transformers loads (checkpoint/reward_model.py): a full
`*ForSequenceClassification` checkpoint, or with LoRA a PEFT adapter whose
`modules_to_save` holds the head.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F

from slipstream import distributed as dist
from slipstream.models.score_head import add_score_head, pad_id_of, sequence_scores
from slipstream.objectives.base import Objective
from slipstream.objectives.reward_config import FSDP_REFUSAL
from slipstream.objectives.reward_data import (
    RewardPair,
    collate_reward_pairs,
    tokenize_reward_pairs,
)


def bradley_terry_losses(
    chosen_P: torch.Tensor,
    rejected_P: torch.Tensor,
    margin_P: torch.Tensor | None = None,
    center: float | None = None,
) -> torch.Tensor:
    """(P,) per-pair losses: -logsigmoid(c - r - m) (+ center * (c + r)^2)."""
    diff = chosen_P - rejected_P
    loss = -F.logsigmoid(diff if margin_P is None else diff - margin_P)
    if center:
        loss = loss + center * (chosen_P + rejected_P) ** 2
    return loss


class Reward(Objective):
    """The objective the trainer runs for train.objective = reward."""

    name = "reward"
    perplexity = False
    metric_names = ("accuracy", "margin", "mean_reward", "min_reward", "max_reward")
    metric_extremes = MappingProxyType({"min_reward": "min", "max_reward": "max"})

    def __init__(self, cfg: Any = None, **options: Any) -> None:
        """From a RunConfig (the `reward` section, data options) or, without one, keyword
        options (center_rewards_coefficient)."""
        self.full, self.base, self.parallel = False, None, None
        if cfg is None:
            self.center = options.get("center_rewards_coefficient")
            self.data_options: dict[str, Any] = {"max_tokens": 1 << 30}
            return
        d, t = cfg.data, cfg.train
        self.full, self.base = cfg.train.finetune == "full", cfg.model.path
        self.center = cfg.reward.center_rewards_coefficient
        self.parallel = dist.parallel_options(cfg)
        self.data_options = dict(
            max_tokens=min(d.max_tokens or t.tokens_per_batch // 2, t.tokens_per_batch // 2),
            overlong=d.overlong, strict=d.strict,
        )  # fmt: skip

    def attach(self, ctx: Any, data: Any) -> None:
        """The score head, before the optimizer and any data-parallel wrapping."""
        if dist.shards_parameters(self.parallel):  # train.parallel=auto, full fine-tuning
            raise ValueError(FSDP_REFUSAL)
        if getattr(ctx.model, "score", None) is None:
            add_score_head(ctx.model)

    def save(self, model: torch.nn.Module, tokenizer: Any, out: Any) -> bool:
        """The reward model (checkpoint/reward_model.py) and the tokenizer into `out`: a
        *ForSequenceClassification checkpoint (full), or a PEFT adapter with the head."""
        from slipstream.checkpoint.atomic import atomic_write_files
        from slipstream.checkpoint.reward_model import save_reward_adapter, save_reward_model

        pad = pad_id_of(tokenizer)
        if self.full:
            save_reward_model(model, out, pad)
        else:  # the base as load_model noted it (a GGUF's hub id); else the config's
            base = None if getattr(model, "name_or_path", None) else self.base
            save_reward_adapter(model, out, pad, base)
        if hasattr(tokenizer, "save_pretrained"):
            atomic_write_files(out, tokenizer.save_pretrained)
        return True

    # -- data ---------------------------------------------------------------------------
    def tokenize(self, rows: Any, tokenizer: Any, first_row: int = 0) -> tuple[list, Any]:
        return tokenize_reward_pairs(rows, tokenizer, first_row=first_row, **self.data_options)

    def length(self, example: RewardPair) -> int:
        return len(example)

    def collate(self, examples: list[RewardPair]) -> Any:
        return collate_reward_pairs(examples)

    def weight(self, batch: Any) -> int:
        return batch.num_pairs

    # -- loss ---------------------------------------------------------------------------
    def micro_batch_loss(
        self, model: torch.nn.Module, batch: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss summed over the batch's pairs and metric sums (device tensors, no sync)."""
        scores_CR = sequence_scores(model, batch.input_ids, batch.seq, batch.score_positions)
        scores_CR = scores_CR.view(batch.num_pairs, 2)
        c, r = scores_CR[:, 0], scores_CR[:, 1]
        loss = bradley_terry_losses(c, r, batch.margins, self.center).sum()
        c, r = c.detach(), r.detach()
        return loss, {
            "accuracy": (c > r).float().sum(),
            "margin": (c - r).sum(),
            "mean_reward": ((c + r) / 2).sum(),
            "min_reward": scores_CR.detach().min(),  # extremes over both sides, as TRL's
            "max_reward": scores_CR.detach().max(),
        }
