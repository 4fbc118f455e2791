"""RLOO's formulas as plain tensor functions (Ahmadian et al. 2024, "Back to Basics"; as
TRL 1.16's `RLOOTrainer` computes them).

Rewards: a completion's reward is the weighted sum of its reward functions ignoring None
(NaN), NaN when every function returned None; with beta > 0 the KL penalty is in the
reward: r - beta * sum_t (old_t - ref_t) over the completion's tokens (the first-order log
ratio, which can be negative; old = the policy's log-probs at rollout time).

Advantages: the leave-one-out baseline over the scorable completions of the group,
A_i = r_i - (sum_j r_j - r_i) / (n - 1) with n the group's scorable count (NaN when n = 1),
optionally normalised over the global batch, (A - mean) / (std + 1e-4), ignoring NaN
(unbiased std); an unscorable completion's advantage is 0.

Loss per completion (sequence-level ratio rho = exp(sum_t logp_t - sum_t old_t), clipped to
[1 - eps, 1 + eps_high]): l = -min(rho * A, clip(rho) * A), the mean over completions, so
the objective's weight is its completions.

Shapes: S completions, G completions per group.
"""

from __future__ import annotations

import torch

from slipstream.objectives.grpo_loss import nanstd


def leave_one_out(total_S: torch.Tensor, group_size: int) -> torch.Tensor:
    """(S,) r - mean of the other scorable completions of the group (NaN where r is NaN or
    the group has one scorable completion)."""
    r_PG = total_S.view(-1, group_size)
    count_P1 = (~r_PG.isnan()).sum(dim=1, keepdim=True)
    sum_P1 = r_PG.nansum(dim=1, keepdim=True)
    return (r_PG - (sum_P1 - r_PG) / (count_P1 - 1)).view(-1)


def normalise(adv_S: torch.Tensor, all_adv: torch.Tensor | None = None) -> torch.Tensor:
    """(A - mean) / (std + 1e-4) with the global batch's mean and std (`all_adv`: every
    rank's advantages; default: these), ignoring NaN."""
    ref = adv_S if all_adv is None else all_adv
    return (adv_S - ref.nanmean()) / (nanstd(ref) + 1e-4)


def sequence_losses(
    logps_S: torch.Tensor,
    old_S: torch.Tensor,
    adv_S: torch.Tensor,
    *,
    epsilon: float,
    epsilon_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(l_S, low_S, high_S): the clipped surrogate per completion and whether its ratio was
    clipped below (A < 0) or above (A > 0), TRL's clip_ratio/low and /high."""
    ratio_S = torch.exp(logps_S - old_S)
    clipped_S = ratio_S.clamp(1 - epsilon, 1 + epsilon_high)
    loss_S = -torch.min(ratio_S * adv_S, clipped_S * adv_S)
    low_S = ((ratio_S < 1 - epsilon) & (adv_S < 0)).float()
    high_S = ((ratio_S > 1 + epsilon_high) & (adv_S > 0)).float()
    return loss_S, low_S, high_S
