"""Memory techniques applied to a built model: activation checkpointing and offload (offload.py;
its host slots, device buffers and copy stream: pool.py)."""
