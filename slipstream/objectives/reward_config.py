"""The `reward` config section (objectives/reward.py). No torch import: the run config is
composed from it before torch loads."""

from __future__ import annotations

from typing import Any, ClassVar

from slipstream.config_section import ObjectiveSection, option

FSDP_REFUSAL = (
    "train.objective=reward runs with train.parallel=ddp (or none) under torchrun, not fsdp: "
    "its score head is read outside the sharded forward; set train.parallel=ddp"
)


class RewardSection(ObjectiveSection):
    """train.objective = reward (slipstream/objectives/reward.py; docs/preference.md)."""

    key: ClassVar[str] = "reward"
    meaning: ClassVar[str] = "the reward objective's settings (TRL's RewardConfig names)"

    center_rewards_coefficient: float | None = option(
        None, "weight of mean((chosen + rejected)^2), centring the scores; null: off", ge=0
    )

    def check_run(self, cfg: Any) -> None:
        if cfg.train.parallel == "fsdp":
            raise ValueError(FSDP_REFUSAL)
