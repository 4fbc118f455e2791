"""Qwen3.5-MoE family (Qwen3_5MoeForCausalLM, `model_type: qwen3_5_moe_text`, and the
language model of the multimodal `qwen3_5_moe`): the Qwen3.5 hybrid decoder
(models/qwen3_5.py) with a sparse MoE block in every layer.

The block: a softmax router over E experts (`mlp.gate.weight (E, D)`), top-k, always
renormalised; the experts stacked as transformers holds them in memory
(`mlp.experts.gate_up_proj (E, 2I, D)`, `down_proj (E, D, I)`: Qwen3-MoE's `Qwen3MoeExperts`;
on disk one tensor per expert, as `save_pretrained` writes), run by the one-pass routing and
grouped GEMMs of `MoEBlock`; plus a shared SwiGLU expert (`mlp.shared_expert`, width
`shared_expert_intermediate_size`) scaled per token by sigmoid(`mlp.shared_expert_gate`).

Shapes: T tokens, D hidden, E experts, I expert width.
"""

from __future__ import annotations

import torch
from torch import nn

from slipstream.models.common import CausalLM, GatedMLP
from slipstream.models.moe_block import MoEBlock, Router, aux_loss_coef_from_hf, num_experts_from_hf
from slipstream.models.qwen3_5 import Qwen35Config, Qwen35Layout, build_hybrid
from slipstream.models.qwen3_5 import config_from_hf as _config_from_hf
from slipstream.models.qwen3_moe import Qwen3MoeExperts, Qwen3MoeWeights
from slipstream.models.spec import FamilySpec


def config_from_hf(hf: dict) -> Qwen35Config:
    cfg = _config_from_hf(hf)
    for key in ("num_experts_per_tok", "moe_intermediate_size"):
        if key not in text_hf(cfg):
            raise ValueError(f"config.json: a Qwen3.5-MoE config needs {key}.")
    num_experts_from_hf(text_hf(cfg))
    return cfg


def text_hf(cfg: Qwen35Config) -> dict:
    """config.json's text model part (the whole file for a text-only checkpoint)."""
    return cfg.hf.get("text_config") or cfg.hf


class Qwen35MoeBlock(MoEBlock):
    """Routed experts (softmax top-k, renormalised) + sigmoid-gated shared expert."""

    route_kind = "softmax_topk"

    def __init__(self, cfg: Qwen35Config) -> None:
        hf, D = text_hf(cfg), cfg.hidden_size
        E = num_experts_from_hf(hf)
        experts = Qwen3MoeExperts(E, D, hf["moe_intermediate_size"])
        super().__init__(experts, E, hf["num_experts_per_tok"], norm_topk_prob=True)
        self.gate = Router(D, E, bias=False)
        self.shared_expert = GatedMLP(D, hf.get("shared_expert_intermediate_size", 512))
        self.shared_expert_gate = nn.Linear(D, 1, bias=False)

    def router_logits(self, x_TD: torch.Tensor) -> torch.Tensor:
        return self.gate(x_TD)

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y_TD, stats_2E = super().forward(x_TD)
        shared_TD = torch.sigmoid(self.shared_expert_gate(x_TD)) * self.shared_expert(x_TD)
        return y_TD + shared_TD, stats_2E


def build(cfg: Qwen35Config) -> CausalLM:
    return build_hybrid(cfg, Qwen35MoeBlock, aux_loss_coef_from_hf(text_hf(cfg)))


class Qwen35MoeWeights(Qwen35Layout, Qwen3MoeWeights):
    """Qwen3-MoE's expert map (transformers' save_pretrained writes one tensor per expert;
    stacked ones load as they are) under Qwen3.5's multimodal layout and pass-through."""

    def num_experts(self) -> int:
        return num_experts_from_hf(text_hf(self.cfg))


weights = Qwen35MoeWeights
SPEC = FamilySpec("qwen3_5_moe", config_from_hf, build, weights)
