"""Model families, one file each, looked up by config.json's `model_type`.

A family module provides `config_from_hf(hf) -> ModelConfig` and `build(cfg) -> CausalLM`,
and, when its weights are not stored under our parameter names (stacked MoE experts),
`load_tensor(model, name, tensor) -> bool` and `hf_tensors(model) -> iterator of (name, t)`.
When a checkpoint holds the model under other names (the text model of a multimodal one):
`hf_layouts(cfg)` -> the layouts it may use, each ((our prefix, its prefix), ...), transformers'
module tree first (peft's adapter keys follow it); and `is_passthrough(cfg, name)` for its
tensors that are not ours (a vision tower): skipped at load, copied from the source at save.
"""

from __future__ import annotations

import importlib
from types import ModuleType

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
# model_types refused with what to do instead of the list above.
REFUSED: dict[str, str] = {}


def family_for(model_type: str | None, source: str = "config.json") -> ModuleType:
    """The family module for `model_type`, or a one-line error listing the supported ones."""
    if model_type in REFUSED:
        raise ValueError(f"{source}: model_type {model_type!r}: {REFUSED[model_type]}")
    if model_type not in FAMILIES:
        supported = ", ".join(sorted(FAMILIES))
        raise ValueError(
            f"{source}: model_type {model_type!r} is not supported; supported: {supported}."
        )
    return importlib.import_module(f"slipstream.models.{FAMILIES[model_type]}")
