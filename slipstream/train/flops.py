"""Training FLOPs of a step, for MFU: the one formula the trainer logs and the GPU suite uses.

MFU = useful training FLOPs per second / the device's dense bf16 peak. For a step over packed
sequences of lengths n_1..n_S (T = sum of them):

- matmuls: 4·N·T with LoRA (forward 2NT + input gradients 2NT; frozen weights get no weight
  gradients, and the adapters' own FLOPs are negligible and not counted), 6·N·T when training
  every weight. N = active parameters: every weight one token multiplies, MoE experts scaled by
  top-k / num_experts, the input embedding left out (a lookup; counted once, as the head, when
  tied), NF4 weights counted at their full shape.
- attention (not in N·T): per layer, head and sequence, forward = 2 matmuls x 2 FLOP x head_dim
  x the query-key pairs the mask allows (causal, or windowed); backward = 2x forward.
- recompute by activation checkpointing is not counted: MFU measures useful work.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import torch
from torch import nn

from slipstream.models.common import Attention
from slipstream.models.moe_block import MoEBlock


def weight_numel(p: torch.Tensor) -> int:
    """Elements of the weight `p` stands for (an NF4 `Params4bit` stores two per byte)."""
    shape = getattr(getattr(p, "quant_state", None), "shape", None)
    return math.prod(shape) if shape is not None else p.numel()


def active_params(model: nn.Module) -> int:
    """N of the formula: see the module docstring. LoRA adapter weights are not counted."""
    expert_share: dict[int, float] = {}
    for block in model.modules():
        if isinstance(block, MoEBlock):
            for p in block.experts.parameters():
                expert_share[id(p)] = block.k / block.num_experts
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    total = 0.0
    for name, p in model.named_parameters():
        if "lora_" in name or (name.endswith("embed_tokens.weight") and not tied):
            continue
        total += weight_numel(p) * expert_share.get(id(p), 1.0)
    return int(total)


def causal_pairs(n: int, window: int | None = None) -> int:
    """Query-key pairs a causal mask (of `window` keys, itself included) allows in n tokens."""
    if window is None or n <= window:
        return n * (n + 1) // 2
    return window * (window + 1) // 2 + (n - window) * window


class StepFlops:
    """FLOPs of a training step of `model` from its host sequence lengths (no device work).

    `lora=True` when only adapters train (4NT), False when every weight does (6NT).
    """

    def __init__(self, model: nn.Module, lora: bool) -> None:
        self.n_active = active_params(model)
        self.per_token = (4 if lora else 6) * self.n_active
        # Attention cost per allowed query-key pair, summed over layers with the same window.
        self.pair_cost: Counter[int | None] = Counter()
        for attn in model.modules():
            if isinstance(attn, Attention):
                self.pair_cost[attn.window] += 3 * 2 * 2 * attn.num_heads * attn.head_dim

    def attention(self, lengths: Sequence[int]) -> float:
        return float(
            sum(
                cost * sum(causal_pairs(n, w) for n in lengths)
                for w, cost in self.pair_cost.items()
            )
        )

    def __call__(self, lengths: Sequence[int]) -> float:
        return float(self.per_token * sum(lengths)) + self.attention(lengths)
