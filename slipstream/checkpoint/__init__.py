"""Checkpoint import/export. `gguf`: llama-architecture GGUF files -> HF config and tensors."""

from slipstream.checkpoint.gguf import gguf_tokenizer, read_gguf, smollm2_gguf_path

__all__ = ["gguf_tokenizer", "read_gguf", "smollm2_gguf_path"]
