"""Model families, one file each, looked up by config.json's `model_type`.

A family module provides `config_from_hf(hf) -> ModelConfig`, `build(cfg) -> CausalLM` and
`weights(cfg) -> WeightMap`: how its parameters are named and laid out in a checkpoint
(models/weights.py; the identity map where the names are Hugging Face's).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # not imported here: `check_model_type` answers before torch loads
    from slipstream.models.weights import WeightMap

# model_type -> module name under slipstream.models
FAMILIES: dict[str, str] = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "phi3": "phi3",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "gpt_oss": "gpt_oss",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",  # Gemma3ForConditionalGeneration: its text model
}


def check_model_type(model_type: str | None, source: str = "config.json") -> None:
    """A one-line error, listing the supported types, for a model_type slipstream cannot build.
    The one place that decides it: `family_for` and the early checks before data or weights
    load (`checkpoint.model_type.check_model_source`) all call it."""
    if model_type not in FAMILIES:
        supported = ", ".join(sorted(FAMILIES))
        raise ValueError(
            f"{source}: model_type {model_type!r} is not supported; supported: {supported}."
        )


def family_for(model_type: str | None, source: str = "config.json") -> ModuleType:
    """The family module for `model_type`, or a one-line error listing the supported ones."""
    check_model_type(model_type, source)
    return importlib.import_module(f"slipstream.models.{FAMILIES[model_type]}")


def weight_map(cfg) -> WeightMap:
    """A fresh weight map for a model of `cfg` (one per load or save: it holds load state)."""
    return family_for(cfg.model_type).weights(cfg)
