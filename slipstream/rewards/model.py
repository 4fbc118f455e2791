"""A reward model as a GRPO reward function: `rewards: [model:DIR]` (or `{function: model:DIR,
weight: ...}`), DIR a `train.objective: reward` result (slipstream/scoring.py).

Called TRL's way (`GRPOTrainer._calculate_rewards` with a sequence-classification model):
a conversational prompt and its completion are one chat, rendered by the reward model's
chat template without a generation prompt; a text prompt is joined to its completion; the
text is tokenized without special tokens and scored at the model's scoring token. The model
loads on first use (not at config validation), on CUDA when there is one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

PREFIX = "model:"


class ModelReward:
    """The scores of a reward model folder; `__name__` is the folder's name (its metrics)."""

    def __init__(self, path: str, where: str) -> None:
        if not Path(path).expanduser().is_dir():
            raise ValueError(f"{where}: reward model {path} is not a folder")
        self.path = str(Path(path).expanduser())
        self.__name__ = Path(path).name or "model"
        self.scorer: Any = None

    def __call__(self, prompts: list, completions: list, **kwargs: Any) -> list[float]:
        if self.scorer is None:
            import torch

            from slipstream.scoring import RewardScorer

            device = "cuda" if torch.cuda.is_available() else "cpu"
            self.scorer = RewardScorer(self.path, device=device)
        tokenizer = self.scorer.tokenizer
        texts = []
        for p, c in zip(prompts, completions, strict=True):
            if isinstance(p, list):
                texts.append(tokenizer.apply_chat_template(p + c, tokenize=False))
            else:
                texts.append(p + c)
        return self.scorer.score_texts(texts)
