"""Choosing the next token from logits: greedy, or sampling with temperature, top-k, top-p.

The filters follow transformers' logits warpers in the same order (temperature, then top-k,
then top-p), so the log-probabilities we return equal those `generate(output_scores=True)`
reports for the same tokens. Sampling draws by the exponential-race trick,
argmax(p / E) with E ~ Exp(1), which picks token i with probability p_i and, unlike
`torch.multinomial`, needs no host sync on any device. Everything stays on the device.

Shapes: B rows, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slipstream.generation.options import check_options


@dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy; top_k 0 and top_p 1.0 switch those filters off."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        check_options(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def warp(logits_BV: torch.Tensor, s: Sampling) -> torch.Tensor:
    """Float32 logits of the sampling distribution: scaled, tokens filtered out at -inf."""
    x_BV = logits_BV.float()
    if s.greedy:
        return x_BV
    if s.temperature != 1.0:
        x_BV = x_BV / s.temperature
    if 0 < s.top_k < x_BV.shape[-1]:
        kth_B1 = torch.topk(x_BV, s.top_k, dim=-1).values[:, -1:]
        x_BV = x_BV.masked_fill(x_BV < kth_B1, float("-inf"))
    if s.top_p < 1.0:
        # Smallest set whose probability reaches top_p: drop, from the least likely up, the
        # tokens whose cumulative probability stays within 1 - top_p; the likeliest stays.
        sorted_BV, order_BV = torch.sort(x_BV, dim=-1)
        drop_BV = sorted_BV.softmax(-1).cumsum(-1) <= 1 - s.top_p
        drop_BV[:, -1] = False
        x_BV = x_BV.masked_fill(drop_BV.scatter(1, order_BV, drop_BV), float("-inf"))
    return x_BV


def sample(
    logits_BV: torch.Tensor,
    s: Sampling,
    generator: torch.Generator | None = None,
    logprobs: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """-> (token_B int64, logprob_B float32 or None): the chosen tokens and, if asked, their
    log-probability under the sampling distribution (for greedy: under the model's softmax).

    Sampling is argmax(x - log E), E ~ Exp(1): the exponential race argmax(p / E) in log
    space, so no softmax over the vocabulary is needed to draw (at vocab 49152 and batch 16 a
    log_softmax costs about as much as a 4-layer SmolLM2's attention a step).
    """
    x_BV = warp(logits_BV, s)
    if s.greedy:
        token_B = x_BV.argmax(-1)
    else:
        e_BV = torch.empty_like(x_BV).exponential_(1.0, generator=generator)
        token_B = (x_BV - e_BV.log()).argmax(-1)
    if not logprobs:
        return token_B, None
    chosen_B = x_BV.gather(1, token_B[:, None])[:, 0]
    return token_B, chosen_B - torch.logsumexp(x_BV, dim=-1)
