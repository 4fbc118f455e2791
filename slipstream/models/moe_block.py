"""What the MoE families share: the router, the routed block and the auxiliary loss.

`MoEBlock.forward` routes in one pass with `slipstream.ops.moe` (top-k -> one stable sort ->
counts by scatter_add -> grouped GEMMs over the offsets -> weighted gather back): no loop over
experts and no host sync. Family files subclass it only to name the router as Hugging Face
does (`mlp.gate` in Qwen3-MoE, `mlp.router` in GPT-OSS) and to give it an experts module with
`gate_up(x_RD, plan)`, `activate(h_RF)` and `down(a_RI, plan)`; keeping the three steps
separate is what lets expert LoRA (`apply_lora`, see `slipstream.peft.lora_experts`) add
its deltas.

Auxiliary load-balancing loss: when a block's `aux_loss_coef` is > 0, each forward stores
`router_stats` (per-expert routed-row counts and summed router probabilities, on the device);
`moe_aux_loss(model)` pools them over the layers exactly as transformers'
`load_balancing_loss_func` does. The trainer adds `router_aux_loss_coef(model) * aux`.
The aux gradient reaches each router through `probs_sum_E`'s graph in every checkpointing
mode: under activation offload, where a layer's forward runs without a graph, the layer's
autograd Function returns each block's `probs_sum_E` as an extra output and recomputes it in
backward (`slipstream.memory.offload`), so the pooled loss is built the same way.

Shapes: T tokens, D hidden, E experts, K top-k, R = T*K routed rows, F = 2I, I expert width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.ops.moe import permute, plan, route, unpermute


class Router(nn.Module):
    """Router logits: x @ weight.T (+ bias). A plain module, not an nn.Linear, so that
    `apply_lora(targets="all-linear")` leaves routers alone (PEFT does the same)."""

    def __init__(self, hidden_size: int, num_experts: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.zeros(num_experts)) if bias else None
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return F.linear(x_TD, self.weight, self.bias)


@dataclass
class RouterStats:
    """One block's routing statistics for the auxiliary loss (device tensors, no sync)."""

    counts_E: torch.Tensor  # float32, rows routed to each expert (no grad)
    probs_sum_E: torch.Tensor  # float32, router softmax summed over tokens (with grad)
    tokens: int


class MoEBlock(nn.Module):
    """Router -> one-pass routing -> stacked experts -> weighted sum over the K choices."""

    route_kind = "softmax_topk"

    def __init__(
        self,
        experts: nn.Module,
        num_experts: int,
        k: int,
        norm_topk_prob: bool = True,
        aux_loss_coef: float = 0.0,
    ) -> None:
        super().__init__()
        self.experts = experts
        self.num_experts, self.k, self.norm_topk_prob = num_experts, k, norm_topk_prob
        self.aux_loss_coef = float(aux_loss_coef)
        self.router_stats: RouterStats | None = None

    def router_logits(self, x_TD: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        logits_TE = self.router_logits(x_TD)
        weights_TK, ids_TK = route(
            logits_TE, self.k, kind=self.route_kind, norm_topk_prob=self.norm_topk_prob
        )
        p = plan(ids_TK, self.num_experts)
        y_RD = self.experts(permute(x_TD, p), p)
        if self.aux_loss_coef > 0:  # a Python float: no sync, no graph when disabled
            probs_sum_E = torch.softmax(logits_TE.float(), dim=-1).sum(0)
            self.router_stats = RouterStats(p.counts_E.float(), probs_sum_E, x_TD.shape[0])
        return unpermute(y_RD, p, weights_TK)


def moe_blocks(model: nn.Module) -> list[MoEBlock]:
    return [m for m in model.modules() if isinstance(m, MoEBlock)]


def moe_aux_loss(model: nn.Module, clear: bool = True) -> torch.Tensor | None:
    """The load-balancing loss of the last forward, pooled over layers as transformers does:
    E * sum_e (rows to e / rows) * (mean router prob of e). None when no block recorded stats
    (no MoE layer, or coefficient 0). `clear` drops the stats so the graph is freed."""
    blocks = [b for b in moe_blocks(model) if b.router_stats is not None]
    if not blocks:
        return None
    stats = [b.router_stats for b in blocks]
    tokens = sum(s.tokens for s in stats)
    counts_E = torch.stack([s.counts_E for s in stats]).sum(0)
    probs_E = torch.stack([s.probs_sum_E for s in stats]).sum(0)
    if clear:
        for b in blocks:
            b.router_stats = None
    return blocks[0].num_experts * torch.sum((counts_E / tokens) * (probs_E / tokens))


def router_aux_loss_coef(model: nn.Module) -> float:
    """The coefficient the MoE blocks use (0.0 when disabled or when there is no MoE layer)."""
    blocks = moe_blocks(model)
    return blocks[0].aux_loss_coef if blocks else 0.0


def set_router_aux_loss_coef(model: nn.Module, coef: float) -> None:
    """Turn the auxiliary loss on (coef > 0) or off (0) for every MoE block."""
    if not coef >= 0:
        raise ValueError(f"router_aux_loss_coef must be >= 0, got {coef!r}")
    for block in moe_blocks(model):
        block.aux_loss_coef = float(coef)
        block.router_stats = None


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
