"""The trainer: `train(config)` (loop.py), AdamW and schedules (optim.py), metrics and
reports (metrics.py), checkpoints, resume and clean stops (state.py)."""

from slipstream.train.loop import train

__all__ = ["train"]
