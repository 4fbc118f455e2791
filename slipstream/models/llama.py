"""Llama family: LlamaForCausalLM (Llama 3.x with llama3 RoPE scaling, SmolLM2) and
Mistral-style configs without a sliding window.

Everything is the shared pre-norm GQA decoder from `common.py`; the weight names equal the
Hugging Face ones, so loading is the identity map.
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


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    if hf.get("model_type") == "mistral" and hf.get("sliding_window"):
        raise ValueError(
            f"config.json: mistral with sliding_window={hf['sliding_window']} is not supported; "
            "set sliding_window to null for full attention."
        )
    return base_config_from_hf(hf)


def build(cfg: ModelConfig) -> CausalLM:
    layers = [
        DecoderLayer(
            cfg,
            Attention(cfg),
            SwiGLU(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias),
        )
        for _ in range(cfg.num_hidden_layers)
    ]
    return CausalLM(cfg, layers)
