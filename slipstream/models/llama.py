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
    CausalLM,
    DecoderLayer,
    ModelConfig,
    SwiGLU,
    base_config_from_hf,
)
from slipstream.models.weights import WeightMap


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    window = attention_window(hf)
    if window is not None and not (isinstance(window, int) and window > 0):
        raise ValueError(
            f"config.json: sliding_window={window!r} must be a positive integer or null."
        )
    return base_config_from_hf(hf)


def attention_window(hf: dict[str, Any]) -> int | None:
    """Mistral's `sliding_window` (every layer), else None; Llama has no window."""
    return hf.get("sliding_window") if hf.get("model_type") == "mistral" else None


def build(cfg: ModelConfig) -> CausalLM:
    window = attention_window(cfg.hf)
    layers = [
        DecoderLayer(
            cfg,
            Attention(cfg, window),
            SwiGLU(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias),
        )
        for _ in range(cfg.num_hidden_layers)
    ]
    return CausalLM(cfg, layers)


weights = WeightMap  # checkpoint names are Hugging Face's: the identity map
