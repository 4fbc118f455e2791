"""What the MoE families share: the router, the routed block and the auxiliary loss.

`MoEBlock.forward` calls `slipstream.ops.moe.moe`: no loop over experts and no host sync.
Family files subclass it only to name the router as Hugging Face does (`mlp.gate` in
Qwen3-MoE, `mlp.router` in GPT-OSS) and to give it an experts module with
`gate_up(x_RD, plan)`, `activate(h_RF)` and `down(a_RI, plan)`; keeping the three steps
separate is what lets expert LoRA (`slipstream.peft.lora_experts`) add its deltas.

A block returns its router statistics beside its output, and `CausalLM.loss` turns them into
the auxiliary load-balancing loss: nothing is kept on the modules, so checkpointing and
offload pass the statistics on as layer outputs.

Shapes: T tokens, D hidden, E experts, K top-k, R = T*K routed rows, F = 2I, I expert width.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.models.generic_hooks import is_standard_experts
from slipstream.ops.moe import moe, router_stats


class Router(nn.Module):
    """Router logits: x @ weight.T (+ bias). A plain module, not an nn.Linear, so that
    `apply_lora(targets="all-linear")` leaves routers alone; an adapter's LoRA on its weight
    (peft's `target_parameters` `mlp.gate.weight`) wraps it like a linear layer."""

    def __init__(self, hidden_size: int, num_experts: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.zeros(num_experts)) if bias else None
        nn.init.normal_(self.weight, std=0.02)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return F.linear(x_TD, self.weight, self.bias)


class MoEBlock(nn.Module):
    """Router -> `moe` (one-pass routing, stacked experts) -> (y_TD, router_stats_2E)."""

    route_kind = "softmax_topk"

    def __init__(
        self, experts: nn.Module, num_experts: int, k: int, norm_topk_prob: bool = True
    ) -> None:
        super().__init__()
        self.experts = experts
        self.num_experts, self.k, self.norm_topk_prob = num_experts, k, norm_topk_prob

    def router_logits(self, x_TD: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits_TE = self.router_logits(x_TD)
        kind, norm = self.route_kind, self.norm_topk_prob
        y_TD, p = moe(x_TD, logits_TE, self.experts, self.k, kind=kind, norm_topk_prob=norm)
        return y_TD, router_stats(logits_TE, p)


class StackedExperts(nn.Module):
    """Base of native stacked experts run in the three steps expert LoRA wraps:
    `gate_up(x_RD, plan)` -> h_RF, `activate(h_RF)` -> a_RI, `down(a_RI, plan)` -> y_RD."""

    def forward(self, x_RD: torch.Tensor, plan) -> torch.Tensor:
        return self.down(self.activate(self.gate_up(x_RD, plan)), plan)


def moe_blocks(model: nn.Module) -> list[MoEBlock]:
    return [m for m in model.modules() if isinstance(m, MoEBlock)]


def expert_blocks(model: nn.Module) -> list[nn.Module]:
    """The MoE blocks whose `.experts` expert LoRA can wrap (wrapped ones too: the original is
    then `.experts.base_layer`): native `MoEBlock`s, native modules holding `StackedExperts`
    beside their own router (Gemma 4's decoder layer), and on the generic path transformers'
    blocks whose experts have the standard stacked layout (generic_hooks.is_standard_experts)."""

    def stacked(m: nn.Module) -> bool:
        experts = getattr(m, "experts", None)
        if not isinstance(experts, nn.Module):
            return False
        experts = getattr(experts, "base_layer", experts)
        return isinstance(experts, StackedExperts) or is_standard_experts(experts)

    return [m for m in model.modules() if isinstance(m, MoEBlock) or stacked(m)]


def has_router_loss(model: nn.Module) -> bool:
    """Whether `model.loss` can add a router load-balancing loss: native MoE blocks, or a
    generic model whose transformers class computes one (`generic.router_loss`)."""
    return bool(moe_blocks(model)) or getattr(model, "router_loss", None) is not None


def router_aux_loss_coef(model: nn.Module) -> float:
    """The coefficient `model.loss` adds the auxiliary loss with (0.0: off, or no MoE layer)."""
    return float(getattr(model, "router_aux_loss_coef", 0.0)) if has_router_loss(model) else 0.0


def set_router_aux_loss_coef(model: nn.Module, coef: float) -> None:
    """Turn the auxiliary loss in `model.loss` on (coef > 0) or off (0)."""
    if not coef >= 0:
        raise ValueError(f"router_aux_loss_coef must be >= 0, got {coef!r}")
    model.router_aux_loss_coef = float(coef)


def aux_loss_coef_from_hf(hf: dict[str, Any]) -> float:
    # transformers adds the aux loss only with output_router_logits=True (False on the hub
    # checkpoints): mirror that, so a plain fine-tune computes what transformers computes.
    if not hf.get("output_router_logits", False):
        return 0.0
    return float(hf.get("router_aux_loss_coef", 0.0) or 0.0)


def num_experts_from_hf(hf: dict[str, Any]) -> int:
    """`num_experts` on the hub, `num_local_experts` in transformers 5's saved configs."""
    for key in ("num_experts", "num_local_experts"):
        if hf.get(key) is not None:
            return int(hf[key])
    raise ValueError("config.json: set num_experts (or num_local_experts) for a MoE model.")
