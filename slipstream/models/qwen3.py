"""Qwen3 family (Qwen3ForCausalLM): the Llama decoder plus a per-head RMSNorm on q and k
before RoPE, and optional sliding-window layers, chosen as for Qwen2 (`qwen2.layer_windows`).
"""

from __future__ import annotations

from typing import Any

import torch

from slipstream.models.common import (
    Attention,
    CausalLM,
    DecoderLayer,
    ModelConfig,
    RMSNorm,
    SwiGLU,
    base_config_from_hf,
)
from slipstream.models.qwen2 import layer_windows  # transformers reads Qwen3's windows alike
from slipstream.models.weights import WeightMap


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    cfg = base_config_from_hf(hf)
    layer_windows(cfg)  # a malformed layer_types fails at load, not at build
    return cfg


class Qwen3Attention(Attention):
    """q_norm/k_norm: RMSNorm over each head's Dh features (not over the whole projection)."""

    def __init__(self, cfg: ModelConfig, window: int | None = None) -> None:
        super().__init__(cfg, window)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def project_qkv(self, x_TD: torch.Tensor):
        q_THD, k_TGD, v_TGD = super().project_qkv(x_TD)
        return self.q_norm(q_THD), self.k_norm(k_TGD), v_TGD


def build(cfg: ModelConfig) -> CausalLM:
    layers = [
        DecoderLayer(
            cfg,
            Qwen3Attention(cfg, window),
            SwiGLU(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias),
        )
        for window in layer_windows(cfg)
    ]
    return CausalLM(cfg, layers)


weights = WeightMap  # checkpoint names are Hugging Face's: the identity map
