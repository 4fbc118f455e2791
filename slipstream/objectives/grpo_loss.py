"""GRPO's published formulas as plain tensor functions: group-normalised advantages, the
clipped surrogate with the k3 KL term, and each loss type's normaliser.

Advantages (Shao et al. 2024, DeepSeekMath; as TRL 1.16's `GRPOTrainer` computes them): a
completion's reward is the weighted sum of its reward functions ignoring None (NaN), NaN when
every function returned None; A = r - mean(group), divided by std + 1e-4 where `scale_rewards`
is "group" (the group's std) or "batch" (the std over every completion of the global step);
"none" (Dr. GRPO) leaves it unscaled. Means and stds ignore NaN; stds are unbiased (Bessel).
An unscorable completion (NaN reward) gets advantage 0.

Per completion token t (ratio rho_t = exp(logp_t - old_t), clipped to [1 - eps, 1 + eps_high]):

    l_t = -min(rho_t * A, clip(rho_t) * A) + beta * rho_t * k3_t,
    k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1

The KL estimate is importance-weighted by rho_t (TRL 1.16's default `use_bias_correction_kl`:
the samples come from the old policy); on policy rho_t = 1 in value, but its gradient adds
k3_t * grad(logp_t), as in TRL.

Normalisation (TRL's names): dapo = sum over every completion token of the global step /
that token count; grpo = each completion's token mean, then the mean over completions;
dr_grpo = sum / (completions * max_completion_tokens). A masked (truncated) completion adds
nothing to the sum and, for dapo, nothing to the count. The trainer divides by the step's
weight once, so these are written as per-token scales times a per-batch weight.

Shapes: N completion tokens, S completions (sequences), G completions per group.
"""

from __future__ import annotations

import math

import torch

LOSS_TYPES = ("dapo", "grpo", "dr_grpo")


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Unbiased std ignoring NaN (NaN with fewer than two values)."""
    mean = x.nanmean(dim=dim, keepdim=True) if dim is not None else x.nanmean()
    var = ((x - mean) ** 2).nanmean(dim=dim)
    count = (~x.isnan()).sum(dim=dim)
    var = var * count / (count - 1)
    return var.masked_fill(count < 2, math.nan).sqrt()


def advantages(
    total_S: torch.Tensor, group_size: int, scale: str, batch_std: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages_S, zero_spread_S) from total rewards, groups of `group_size` consecutive
    completions. `batch_std`: the global step's std for scale "batch" (all ranks; default:
    this batch's). zero_spread: the std used (group or batch) is 0, TRL's frac_reward_zero_std."""
    r_GG = total_S.view(-1, group_size)
    mean_S = r_GG.nanmean(dim=1).repeat_interleave(group_size)
    if scale == "batch":
        std = nanstd(total_S) if batch_std is None else torch.tensor(batch_std)
        std_S = std.expand_as(total_S)
    else:
        std_S = nanstd(r_GG, dim=1).repeat_interleave(group_size)
    adv_S = total_S - mean_S
    if scale != "none":
        adv_S = adv_S / (std_S + 1e-4)
    zero_S = torch.isclose(std_S, torch.zeros_like(std_S))
    return torch.nan_to_num(adv_S, nan=0.0), zero_S


def token_losses(
    logps_N: torch.Tensor,
    old_N: torch.Tensor,
    adv_N: torch.Tensor,
    *,
    epsilon: float,
    epsilon_high: float,
    beta: float = 0.0,
    ref_N: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(l_N, clipped_N, kl_N) per completion token (module docstring). `clipped`: the ratio
    left the clip range on the side the advantage's sign makes binding (TRL's region clip)."""
    ratio_N = torch.exp(logps_N - old_N)
    clipped_ratio_N = ratio_N.clamp(1 - epsilon, 1 + epsilon_high)
    loss_N = -torch.min(ratio_N * adv_N, clipped_ratio_N * adv_N)
    low = (ratio_N < 1 - epsilon) & (adv_N < 0)
    high = (ratio_N > 1 + epsilon_high) & (adv_N > 0)
    kl_N = None
    if beta != 0.0:
        delta_N = ref_N - logps_N
        kl_N = (torch.exp(delta_N) - delta_N - 1) * ratio_N
        loss_N = loss_N + beta * kl_N
    return loss_N, (low | high).float(), kl_N


def token_scales(
    completion_lengths: list[int], masked: list[bool], loss_type: str
) -> tuple[list[float], int]:
    """Per-sequence scale of each token's loss and the sequences' share of the normaliser:
    dapo (1, unmasked tokens), grpo (1 / length, sequences), dr_grpo (1, sequences; the
    caller multiplies by max_completion_tokens). Masked sequences get scale 0."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"grpo.loss_type = {loss_type!r}; use one of {', '.join(LOSS_TYPES)}")
    scales = []
    for n, m in zip(completion_lengths, masked, strict=True):
        s = 0.0 if m else 1.0
        scales.append(s / max(n, 1) if loss_type == "grpo" else s)
    if loss_type == "dapo":
        weight = sum(n for n, m in zip(completion_lengths, masked, strict=True) if not m)
    else:
        weight = len(completion_lengths)
    return scales, weight
