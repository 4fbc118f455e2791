"""Parameter-efficient fine-tuning modules: LoRA and DoRA (lora.py, dora.py), expert LoRA on
MoE blocks (lora_experts.py), QLoRA's NF4 bases (qlora.py), and PEFT's names for them
(names.py). PEFT's adapter files are read and written by slipstream.checkpoint.adapter."""
