"""Scoring with a reward model, for `slipstream score` (objectives/reward_scoring.py) and
GRPO's `rewards: [model:DIR]` (rewards/model.py).

`RewardScorer(dir)` loads a reward model (checkpoint/reward_model.py: a full one or a LoRA
adapter with its score head) and its tokenizer (the one saved with it, else the base's)
and scores token sequences packed without padding, `tokens_per_batch` at a time, each at
transformers' scoring token with the pad id the model was trained with.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from slipstream.checkpoint.reward_model import load_reward_model
from slipstream.models.score_head import pad_id_of, score_positions, sequence_scores
from slipstream.ops.packing import SeqInfo


class RewardScorer:
    """A reward model ready to score sequences (module docstring)."""

    def __init__(self, path: str | Path, device: str | torch.device = "cpu",
                 tokens_per_batch: int = 8192) -> None:  # fmt: skip
        from slipstream.checkpoint.adapter import tokenizer_source
        from slipstream.checkpoint.tokenizer import load_tokenizer
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
