"""Qwen3-MoE family (Qwen3MoeForCausalLM): the Qwen3 decoder with sparse MoE blocks.

A layer is sparse unless its index is in `mlp_only_layers` or `(index + 1)` is not a multiple
of `decoder_sparse_step`; dense layers keep a SwiGLU `mlp` of `intermediate_size`. A sparse
`mlp` is a softmax router over all experts (`mlp.gate.weight (E, D)`), top-k, renormalised
when `norm_topk_prob`, and experts stacked as transformers 5 holds them in memory:
`mlp.experts.gate_up_proj (E, 2I, D)` (gate rows, then up rows) and
`mlp.experts.down_proj (E, D, I)`, each expert in the nn.Linear (out, in) layout.

On disk, hub checkpoints and transformers 5's `save_pretrained` store one tensor per expert:
`mlp.experts.{e}.gate_proj.weight (I, D)`, `.up_proj.weight (I, D)`, `.down_proj.weight
(D, I)`. The weight map (`Qwen3MoeWeights`) copies each into its slice of the stacked
parameter as it streams in (the fused names load as they are) and writes the per-expert layout
back.

Shapes: T tokens, D hidden, E experts, I expert width, F = 2I, R routed rows.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.models.common import (
    Backbone,
    CausalLM,
    DecoderLayer,
    GatedMLP,
    ModelConfig,
    sliding_windows,
)
from slipstream.models.common import base_config_from_hf as _base_config
from slipstream.models.moe_block import (
    MoEBlock,
    Router,
    StackedExperts,
    aux_loss_coef_from_hf,
    num_experts_from_hf,
)
from slipstream.models.qwen3 import attention
from slipstream.models.spec import FamilySpec
from slipstream.models.weights import WeightMap, check_shape
from slipstream.ops.moe import RoutingPlan, grouped_mm

PER_EXPERT = re.compile(r"(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json: hidden_act {act!r} is not supported; use 'silu'.")
    num_experts_from_hf(hf)
    cfg = _base_config(hf)
    layer_windows(cfg)  # a malformed sliding_window fails at load, not at build
    return cfg


class Qwen3MoeExperts(StackedExperts):
    """E SwiGLU experts stacked (E, out, in); runs the routed rows as grouped GEMMs."""

    is_transposed = False  # per expert (out, in), as nn.Linear (PEFT reads this name)

    def __init__(self, num_experts: int, hidden: int, width: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * width, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, width))
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)

    def gate_up(self, x_RD: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
        return grouped_mm(x_RD, self.gate_up_proj.transpose(1, 2), plan.offsets_E)

    def activate(self, h_RF: torch.Tensor) -> torch.Tensor:
        gate_RI, up_RI = h_RF.chunk(2, dim=-1)
        return F.silu(gate_RI) * up_RI

    def down(self, a_RI: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
        return grouped_mm(a_RI, self.down_proj.transpose(1, 2), plan.offsets_E)


class Qwen3MoeBlock(MoEBlock):
    """Softmax over all E router logits, top-k, optional renormalisation (`norm_topk_prob`)."""

    route_kind = "softmax_topk"

    def __init__(self, cfg: ModelConfig) -> None:
        hf, D = cfg.hf, cfg.hidden_size
        E = num_experts_from_hf(hf)
        super().__init__(
            Qwen3MoeExperts(E, D, hf["moe_intermediate_size"]),
            E,
            hf["num_experts_per_tok"],
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        )
        self.gate = Router(D, E, bias=False)

    def router_logits(self, x_TD: torch.Tensor) -> torch.Tensor:
        return self.gate(x_TD)


def sparse_layers(cfg: ModelConfig) -> list[bool]:
    """Which layers get a MoE block (the rule of transformers' Qwen3MoeDecoderLayer)."""
    hf = cfg.hf
    dense = set(hf.get("mlp_only_layers") or [])
    step = hf.get("decoder_sparse_step", 1) or 1
    E = num_experts_from_hf(hf)
    return [i not in dense and E > 0 and (i + 1) % step == 0 for i in range(cfg.num_hidden_layers)]


def layer_windows(cfg: ModelConfig) -> list[int | None]:
    """transformers sets sliding_window to None unless use_sliding_window; then every layer."""
    hf, L = cfg.hf, cfg.num_hidden_layers
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    return sliding_windows(window, ["sliding_attention"] * L, L)


def build(cfg: ModelConfig) -> CausalLM:
    D, F_dense = cfg.hidden_size, cfg.intermediate_size
    layers = [
        DecoderLayer(
            cfg,
            attention(cfg, window),
            Qwen3MoeBlock(cfg) if sparse else GatedMLP(D, F_dense),
        )
        for window, sparse in zip(layer_windows(cfg), sparse_layers(cfg), strict=True)
    ]
    return CausalLM(cfg, Backbone(cfg, layers), aux_loss_coef_from_hf(cfg.hf))


# ------------------------------------------------------------------- weight map


class Qwen3MoeWeights(WeightMap):
    """Hub checkpoints hold one tensor per expert; the model holds them stacked."""

    def load(self, model: CausalLM, name: str, tensor: torch.Tensor) -> bool:
        """Copy a per-expert tensor into its slice of the stacked expert parameter."""
        m = PER_EXPERT.match(name)
        if m is None:
            return False
        prefix, e, proj = m.group(1), int(m.group(2)), m.group(3)
        target = f"{prefix}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
        param = self.split_target(model, target, name)
        E, rows = param.shape[0], param.shape[1]
        if e >= E:
            raise ValueError(f"tensor {name!r}: expert {e} but config.json has {E} experts.")
        width = rows // 2
        dest = {"gate_proj": param[e, :width], "up_proj": param[e, width:], "down_proj": param[e]}
        dest = dest[proj]
        check_shape(name, tensor.shape, dest.shape, hint=" (hidden_size, moe_intermediate_size)")
        dest.copy_(tensor)
        return True

    def num_experts(self) -> int:
        return num_experts_from_hf(self.cfg.hf)

    def split_parts(self, param_name: str) -> list[str]:
        prefix, _, target = param_name.rpartition(".")
        projs = ("down_proj",) if target == "down_proj" else ("gate_proj", "up_proj")
        E = self.num_experts()
        return [f"{prefix}.{e}.{p}.weight" for e in range(E) for p in projs]

    def hf_state(self, model: CausalLM) -> Iterator[tuple[str, torch.Tensor]]:
        """Stacked experts written one tensor per expert (cloned: safetensors refuses tensors
        that share storage)."""
        for name, p in model.named_parameters():
            prefix, _, target = name.rpartition(".")
            if prefix.endswith("mlp.experts") and target == "gate_up_proj":
                width = p.shape[1] // 2
                for e in range(p.shape[0]):
                    yield f"{prefix}.{e}.gate_proj.weight", p[e, :width].detach().clone()
                    yield f"{prefix}.{e}.up_proj.weight", p[e, width:].detach().clone()
            elif prefix.endswith("mlp.experts") and target == "down_proj":
                for e in range(p.shape[0]):
                    yield f"{prefix}.{e}.down_proj.weight", p[e].detach().clone()
            else:
                yield name, p.detach()


weights = Qwen3MoeWeights
SPEC = FamilySpec("qwen3_moe", config_from_hf, build, weights)
