"""Qwen3 family (Qwen3ForCausalLM): the Llama decoder plus a per-head RMSNorm on q and k
before RoPE, and optional sliding-window layers, chosen as for Qwen2 (`qwen2.layer_windows`).
"""

from __future__ import annotations

from typing import Any

from slipstream.models.common import (
    Attention,
    Backbone,
    CausalLM,
    DecoderLayer,
    GatedMLP,
    ModelConfig,
    RMSNorm,
    base_config_from_hf,
)
from slipstream.models.qwen2 import layer_windows  # transformers reads Qwen3's windows alike
from slipstream.models.spec import FamilySpec
from slipstream.models.weights import WeightMap


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    cfg = base_config_from_hf(hf)
    layer_windows(cfg)  # a malformed layer_types fails at load, not at build
    return cfg


def attention(cfg: ModelConfig, window: int | None) -> Attention:
    """q_norm/k_norm: RMSNorm over each head's Dh features (not over the whole projection)."""
    q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
    k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
    return Attention(cfg, window, q_norm=q_norm, k_norm=k_norm)


def decoder_layers(cfg: ModelConfig, windows: list[int | None]) -> list[DecoderLayer]:
    """The Qwen3 decoder layers (also Qwen3-VL's language model: models/qwen3_vl.py)."""
    return [
        DecoderLayer(
            cfg,
            attention(cfg, window),
            GatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias),
        )
        for window in windows
    ]


def build(cfg: ModelConfig) -> CausalLM:
    return CausalLM(cfg, Backbone(cfg, decoder_layers(cfg, layer_windows(cfg))))


weights = WeightMap  # checkpoint names are Hugging Face's: the identity map
SPEC = FamilySpec("qwen3", config_from_hf, build, weights)
