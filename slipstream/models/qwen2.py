"""Qwen2 family (Qwen2ForCausalLM: Qwen2, Qwen2.5): the Llama decoder with biases on
q_proj/k_proj/v_proj (o_proj has none), and optional sliding-window layers.

Windows, as transformers 5 reads a Qwen2 config.json: `sliding_window` counts only when
`use_sliding_window` is true (it is false on the published Qwen2.5 checkpoints); then the
layers `layer_types` marks `sliding_attention` are windowed, or, without `layer_types` (configs
written by transformers 4), the layers from index `max_window_layers` (default 28) on.
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
    base_config_from_hf,
    sliding_windows,
)
from slipstream.models.spec import FamilySpec
from slipstream.models.weights import WeightMap


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    cfg = base_config_from_hf(hf, attention_bias=True)
    layer_windows(cfg)  # a malformed layer_types fails at load, not at build
    return cfg


def layer_windows(cfg: ModelConfig) -> list[int | None]:
    """Per-layer attention window (None: full causal attention); see the module docstring."""
    hf, L = cfg.hf, cfg.num_hidden_layers
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    first_windowed = hf.get("max_window_layers", 28)
    types = hf.get("layer_types") or [
        "sliding_attention" if window and i >= first_windowed else "full_attention"
        for i in range(L)
    ]
    return sliding_windows(window, types, L)


def decoder_layers(cfg: ModelConfig, windows: list[int | None]) -> list[DecoderLayer]:
    """The Qwen2 decoder layers (also Qwen2.5-VL's language model: models/qwen2_5_vl.py)."""
    return [
        DecoderLayer(
            cfg,
            Attention(cfg, window, o_bias=False),
            GatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias),
        )
        for window in windows
    ]


def build(cfg: ModelConfig) -> CausalLM:
    return CausalLM(cfg, Backbone(cfg, decoder_layers(cfg, layer_windows(cfg))))


weights = WeightMap  # checkpoint names are Hugging Face's: the identity map
SPEC = FamilySpec("qwen2", config_from_hf, build, weights)
