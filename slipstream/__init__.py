"""slipstream: fast LLM fine-tuning (LoRA, QLoRA, full) for PyTorch.

Public API:
    load_model, save_model, export_merged      HF checkpoints in, HF checkpoints out
    export_gguf                                 one GGUF for llama.cpp / Ollama (f16 ... q4_k_m)
    SeqInfo                                     packed-batch metadata, built once per batch
    apply_lora, save_adapter, load_adapter, merge_lora    PEFT-compatible adapters
    apply_checkpointing                         recompute / CPU offload of layer inputs
    count_syncs                                 host-sync audit
    generate, Completion                        batched generation with a KV cache
    train                                       the training job (a RunConfig in, a summary out)
"""

from __future__ import annotations

from typing import Any

from slipstream.checkpoint.adapter import load_adapter, save_adapter
from slipstream.checkpoint.export import export_merged
from slipstream.checkpoint.hf import load_model, save_model
from slipstream.debug import count_syncs
from slipstream.generation import Completion, generate
from slipstream.ops.packing import SeqInfo
from slipstream.peft.lora import apply_lora, merge_lora

__all__ = [
    "Completion",
    "SeqInfo",
    "apply_checkpointing",
    "apply_lora",
    "count_syncs",
    "export_gguf",
    "export_merged",
    "generate",
    "load_adapter",
    "load_model",
    "merge_lora",
    "save_adapter",
    "save_model",
    "train",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Imported on first use: the trainer pulls in pydantic/datasets, offload its own state.
    if name == "train":
        from slipstream.train.loop import train

        return train
    if name == "export_gguf":
        from slipstream.checkpoint.gguf_export import export_gguf

        return export_gguf
    if name == "apply_checkpointing":
        from slipstream.memory.offload import apply_checkpointing

        return apply_checkpointing
    raise AttributeError(f"module 'slipstream' has no attribute {name!r}")
