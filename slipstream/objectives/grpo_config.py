"""The `grpo` config section (objectives/grpo.py; docs/grpo.md) and the rollout options it
shares with `rloo` (objectives/rloo_config.py). No torch import: the run config is composed
from it before torch loads."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from slipstream.config_section import ObjectiveSection, option


class RolloutOptions(ObjectiveSection):
    """What GRPO and RLOO share: generation, the clipped ratio, the reference, mu, rewards."""

    num_generations: int = option(8, "G: completions sampled per prompt (a group)", ge=2)
    max_prompt_tokens: int = option(256, "longest prompt; longer ones follow data.overlong", gt=0)
    max_completion_tokens: int = option(256, "most tokens generated per completion", gt=0)
    temperature: float = option(1.0, "sampling temperature (log-probs use the same)", gt=0)
    top_p: float = option(1.0, "nucleus sampling", gt=0, le=1)
    epsilon: float = option(0.2, "clip range of the ratio: [1 - epsilon, 1 + epsilon_high]", gt=0)
    epsilon_high: float | None = option(
        None, "upper clip (DAPO's clip-higher); null: epsilon", gt=0
    )
    beta: float = option(0.0, "KL weight (k3 estimator) against the reference; 0: no KL", ge=0)
    reference: Literal["start", "base"] = option(
        "start", "KL reference with LoRA: the starting adapter frozen, or the base"
    )
    mask_truncated_completions: bool = option(False, "completions cut at the limit get no loss")
    iterations_per_batch: int = option(
        1, "mu: optimizer steps per rollout (importance ratio)", ge=1
    )
    rewards: list[dict[str, Any]] = Field(
        default_factory=list,
        description="reward functions: [{function: accuracy | file.py:name | model:DIR, "
        "weight: 1.0}, ...]; a name alone is weight 1",
    )

    @field_validator("rewards", mode="before")
    @classmethod
    def _name_alone(cls, value: Any) -> Any:
        """`rewards: [model:DIR, accuracy]`: an entry given as a name is {function: name}."""
        if isinstance(value, list):
            return [{"function": v} if isinstance(v, str) else v for v in value]
        return value

    def check_run(self, cfg: Any) -> None:
        """Rewards are given, and a prompt's group of completions fits one micro-batch."""
        g, t, k = self, cfg.train, self.key
        if not g.rewards:
            raise ValueError(
                f"train.objective={k} needs {k}.rewards, e.g. [{{function: accuracy}}]"
            )
        group = g.num_generations * (g.max_prompt_tokens + g.max_completion_tokens)
        if group > t.tokens_per_batch:
            raise ValueError(
                f"{k}: a prompt's group of {g.num_generations} x ({g.max_prompt_tokens} + "
                f"{g.max_completion_tokens}) = {group} tokens exceeds train.tokens_per_batch="
                f"{t.tokens_per_batch}; raise it or lower {k}.max_prompt_tokens, "
                "max_completion_tokens or num_generations"
            )


class GRPOSection(RolloutOptions):
    """train.objective = grpo (slipstream/objectives/grpo.py; docs/grpo.md)."""

    key: ClassVar[str] = "grpo"
    meaning: ClassVar[str] = "the grpo objective's settings"

    loss_type: Literal["dapo", "grpo", "dr_grpo"] = option(
        "dapo", "dapo: token mean over the global batch; grpo: per-sequence means; dr_grpo"
    )
    scale_rewards: Literal["group", "batch", "none"] = option(
        "group", "advantages divided by the group's, the batch's or no reward std"
    )
