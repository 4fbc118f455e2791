"""Parameter-efficient fine-tuning: LoRA (PEFT-compatible save/load, merge)."""

from slipstream.peft.lora import (
    LoRALinear,
    apply_lora,
    load_adapter,
    lora_modules,
    merge_lora,
    save_adapter,
)

__all__ = ["LoRALinear", "apply_lora", "load_adapter", "lora_modules", "merge_lora", "save_adapter"]
