"""slipstream: fast LLM fine-tuning for PyTorch.

Public API: load_model, save_model, SeqInfo, count_syncs (and, as documented in the README,
apply_lora, save_adapter, load_adapter, export_merged, apply_checkpointing, train).
"""

from slipstream.checkpoint.hf import load_model, save_model
from slipstream.ops.packing import SeqInfo

__all__ = ["SeqInfo", "load_model", "save_model"]
__version__ = "0.1.0"
