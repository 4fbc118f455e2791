"""Parameter-efficient fine-tuning: LoRA and DoRA (lora.py, dora.py), PEFT's adapter files
(adapter_file.py), expert LoRA on MoE blocks (lora_experts.py), QLoRA's NF4 bases (qlora.py)."""

from slipstream.peft.adapter_file import load_adapter, save_adapter
from slipstream.peft.lora import LoRALinear, apply_lora, lora_modules, merge_lora

__all__ = ["LoRALinear", "apply_lora", "load_adapter", "lora_modules", "merge_lora", "save_adapter"]
