"""Merged export: fold the LoRA deltas into the base weights and write a plain HF checkpoint.

Expert LoRA on MoE models is folded into the stacked expert weights, which the family's
`hf_tensors` then writes in the hub layout.

A QLoRA base is first dequantised (to the compute dtype, never re-quantised), so the merged
model is a full-precision checkpoint that `transformers` loads unchanged.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from slipstream.checkpoint.hf import save_model
from slipstream.models.common import CausalLM


def export_merged(model: CausalLM, directory: str | os.PathLike, tokenizer: Any = None) -> Path:
    """Merge LoRA (if any) into `model` in place; save it and the tokenizer at `directory`."""
    from slipstream.peft.lora import lora_modules, merge_lora

    if _is_quantized(model):
        from slipstream.peft.qlora import dequantize_model

        dequantize_model(model)
    # merge_lora also folds expert LoRA (MoE `target_parameters`) into the stacked experts.
    if lora_modules(model) or (getattr(model, "lora_config", None) or {}).get("target_parameters"):
        merge_lora(model)
    out = save_model(model, directory)
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(out)
    return out


def _is_quantized(model: CausalLM) -> bool:
    return any(type(m).__name__ in ("Linear4bit", "Params4bit") for m in model.modules()) or any(
        type(p).__name__ == "Params4bit" for p in model.parameters()
    )
