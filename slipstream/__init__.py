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

from importlib import import_module
from typing import Any

# Every name is imported on first use: `import slipstream` (and so the CLI's --help and its
# config and path errors) costs no torch import (12 s on a busy 2-core machine, 2026-12-01).
_WHERE = {
    "Completion": "slipstream.generation",
    "SeqInfo": "slipstream.ops.packing",
    "apply_checkpointing": "slipstream.memory.offload",
    "apply_lora": "slipstream.peft.lora",
    "count_syncs": "slipstream.debug",
    "export_gguf": "slipstream.checkpoint.gguf_export",
    "export_merged": "slipstream.checkpoint.export",
    "generate": "slipstream.generation",
    "load_adapter": "slipstream.checkpoint.adapter",
    "load_model": "slipstream.checkpoint.hf",
    "merge_lora": "slipstream.peft.lora",
    "save_adapter": "slipstream.checkpoint.adapter",
    "save_model": "slipstream.checkpoint.hf",
    "train": "slipstream.train.loop",
}
__all__ = sorted(_WHERE)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(import_module(_WHERE[name]), name)
        globals()[name] = value  # once: later lookups skip this function
        return value
    raise AttributeError(f"module 'slipstream' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
