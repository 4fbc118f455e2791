"""The `rloo` config section (objectives/rloo.py; docs/grpo.md, "RLOO"): GRPO's rollout
options (objectives/grpo_config.py) with TRL 1.16 RLOOConfig's defaults where they differ
(G 2, beta 0.05) and its `normalize_advantages`. No torch import."""

from __future__ import annotations

from typing import ClassVar

from slipstream.config_section import option
from slipstream.objectives.grpo_config import RolloutOptions


class RLOOSection(RolloutOptions):
    """train.objective = rloo (slipstream/objectives/rloo.py)."""

    key: ClassVar[str] = "rloo"
    meaning: ClassVar[str] = "the rloo objective's settings"

    num_generations: int = option(2, "G: completions sampled per prompt (a group)", ge=2)
    beta: float = option(
        0.05, "KL penalty in the reward: r - beta * sum(old - ref) over the completion", ge=0
    )
    normalize_advantages: bool = option(
        False, "advantages normalised over the global batch (mean 0, std 1)"
    )
