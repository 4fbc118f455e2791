"""A test objective: SFT's loss normalised per sequence instead of per labelled token, with
two metrics, to check that the trainer takes the normaliser and metrics from the objective."""

from __future__ import annotations

import torch

from slipstream.objectives.sft import SFT


class PerSequence(SFT):
    name = "per_sequence"
    perplexity = False
    metric_names = ("seqs", "seq_tokens")

    def weight(self, batch) -> int:
        return len(batch.seq.lengths)

    def micro_batch_loss(self, model, batch):
        loss, _ = super().micro_batch_loss(model, batch)
        ones = torch.ones((), device=loss.device)
        # summed per unit of weight: logged as sequences per sequence (1) and tokens per sequence
        return loss, {"seqs": ones * len(batch.seq.lengths), "seq_tokens": ones * batch.num_tokens}
