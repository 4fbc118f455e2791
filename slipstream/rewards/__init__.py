"""Reward functions for RL on verifiable rewards (GRPO): built-ins and TRL-style user functions.

`build_rewards(specs)` turns the config's `grpo.rewards` entries into a `RewardFunctions`,
which scores completions into an (N, F) float32 tensor (NaN where a function returned None)
and sums them with the weights (`total`). A user function has TRL's reward-function signature
(`prompts`, `completions`, `completion_ids`, the dataset's other columns, `trainer_state`,
`log_extra`, `log_metric` as keyword arguments; one float or None per completion), so
functions written for TRL's `GRPOTrainer` are used unchanged.

No torch import here: config validation builds the functions to check a spec.
"""

from slipstream.rewards.functions import RewardError, RewardFunctions
from slipstream.rewards.specs import build_rewards

__all__ = ["RewardError", "RewardFunctions", "build_rewards"]
