"""Qwen3 family (Qwen3ForCausalLM): the Llama decoder plus a per-head RMSNorm on q and k
before RoPE, and optional sliding-window layers named by `layer_types`.
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


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    return base_config_from_hf(hf)


class Qwen3Attention(Attention):
    """q_norm/k_norm: RMSNorm over each head's Dh features (not over the whole projection)."""

    def __init__(self, cfg: ModelConfig, window: int | None = None) -> None:
        super().__init__(cfg, window)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def project_qkv(self, x_TD: torch.Tensor):
        q_THD, k_TGD, v_TGD = super().project_qkv(x_TD)
        return self.q_norm(q_THD), self.k_norm(k_TGD), v_TGD


def layer_windows(cfg: ModelConfig) -> list[int | None]:
    """Per-layer attention window: `sliding_window` where `layer_types` says so, else None."""
    hf = cfg.hf
    types = hf.get("layer_types") or ["full_attention"] * cfg.num_hidden_layers
    use_window = hf.get("use_sliding_window", True) and hf.get("sliding_window")
    return [
        hf["sliding_window"] if use_window and t == "sliding_attention" else None for t in types
    ]


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
