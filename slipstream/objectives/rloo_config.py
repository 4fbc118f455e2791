"""The `rloo` config section (objectives/rloo.py; docs/grpo.md, "RLOO"). No torch import:
the run config is composed from it before torch loads. Defaults are TRL 1.16's RLOOConfig's
where it has the option (G 2, beta 0.05, normalize_advantages false, epsilon 0.2)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from slipstream.config_section import ObjectiveSection, option


class RLOOSection(ObjectiveSection):
    """train.objective = rloo (slipstream/objectives/rloo.py)."""

    key: ClassVar[str] = "rloo"
    meaning: ClassVar[str] = "the rloo objective's settings"

    num_generations: int = option(2, "G: completions sampled per prompt (a group)", ge=2)
    max_prompt_tokens: int = option(256, "longest prompt; longer ones follow data.overlong", gt=0)
    max_completion_tokens: int = option(256, "most tokens generated per completion", gt=0)
    temperature: float = option(1.0, "sampling temperature (log-probs use the same)", gt=0)
    top_p: float = option(1.0, "nucleus sampling", gt=0, le=1)
    epsilon: float = option(0.2, "clip range of the sequence ratio: [1 - eps, 1 + eps_high]", gt=0)
    epsilon_high: float | None = option(None, "upper clip; null: epsilon", gt=0)
    beta: float = option(
        0.05, "KL penalty in the reward: r - beta * sum(old - ref) over the completion", ge=0
    )
    reference: Literal["start", "base"] = option(
        "start", "KL reference with LoRA: the starting adapter frozen, or the base"
    )
    normalize_advantages: bool = option(
        False, "advantages normalised over the global batch (mean 0, std 1)"
    )
    mask_truncated_completions: bool = option(False, "completions cut at the limit get no loss")
    iterations_per_batch: int = option(
        1, "mu: optimizer steps per rollout (importance ratio)", ge=1
    )
    rewards: list[dict[str, Any]] = Field(
        default_factory=list,
        description="reward functions: [{function: accuracy | file.py:name, weight: 1.0}, ...]",
    )

    def check_run(self, cfg: Any) -> None:
        """Rewards are given, and a prompt's group of completions fits one micro-batch."""
        if not self.rewards:
            raise ValueError("train.objective=rloo needs rloo.rewards, e.g. [{function: accuracy}]")
        group = self.num_generations * (self.max_prompt_tokens + self.max_completion_tokens)
        if group > cfg.train.tokens_per_batch:
            raise ValueError(
                f"rloo: a prompt's group of {self.num_generations} x ({self.max_prompt_tokens} "
                f"+ {self.max_completion_tokens}) = {group} tokens exceeds train.tokens_per_batch="
                f"{cfg.train.tokens_per_batch}; raise it or lower rloo.max_prompt_tokens, "
                "max_completion_tokens or num_generations"
            )
