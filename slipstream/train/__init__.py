"""The trainer: `train(config)` (loop.py), the data, model and outputs it sets up (setup.py),
AdamW and schedules (optim.py), metrics and reports (metrics.py), FLOPs for MFU (flops.py),
checkpoints, resume and clean stops (state.py)."""

from slipstream.train.loop import train

__all__ = ["train"]
