"""Checkpoint files: Hugging Face safetensors (hf.py), PEFT adapters (adapter.py), merged export
(export.py), atomic writes (atomic.py); `gguf`: llama-architecture GGUF -> HF config, tensors."""

from slipstream.checkpoint.gguf import gguf_tokenizer, read_gguf, smollm2_gguf_path

__all__ = ["gguf_tokenizer", "read_gguf", "smollm2_gguf_path"]
