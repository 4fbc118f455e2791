"""Memory techniques applied to a built model: activation checkpointing and offload."""

from slipstream.memory.offload import (
    OffloadPool,
    OffloadStats,
    apply_checkpointing,
    get_offload_pool,
)

__all__ = ["OffloadPool", "OffloadStats", "apply_checkpointing", "get_offload_pool"]
