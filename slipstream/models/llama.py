"""Llama family: LlamaForCausalLM (Llama 3.x with llama3 RoPE scaling, SmolLM2) and
MistralForCausalLM, with or without its sliding window.

Everything is the shared pre-norm GQA decoder from `common.py`; the weight names equal the
Hugging Face ones, so loading is the identity map. Mistral's `sliding_window` W applies to
every layer: a query sees the last W keys of its sequence, itself included (transformers'
mask keeps key s for query t when s > t - W).
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
    cfg = base_config_from_hf(hf)
    layer_windows(cfg)  # a malformed sliding_window fails at load, not at build
    return cfg


def layer_windows(cfg: ModelConfig) -> list[int | None]:
    """Mistral's `sliding_window` on every layer; Llama has none."""
    window = cfg.hf.get("sliding_window") if cfg.model_type == "mistral" else None
    L = cfg.num_hidden_layers
    return sliding_windows(window, ["sliding_attention"] * L, L)


def build(cfg: ModelConfig) -> CausalLM:
    layers = [
        DecoderLayer(
            cfg,
            Attention(cfg, window),
            GatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias),
        )
        for window in layer_windows(cfg)
    ]
    return CausalLM(cfg, Backbone(cfg, layers))


weights = WeightMap  # checkpoint names are Hugging Face's: the identity map
SPEC = FamilySpec("llama", config_from_hf, build, weights)
