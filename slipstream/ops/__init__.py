"""Ops: packed metadata, attention, MoE routing, loss. Model code calls these by name."""
