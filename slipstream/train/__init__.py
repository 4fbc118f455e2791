"""The trainer: `train(config)` (loop.py), the run it prepares and finishes (run.py) from the
data, model and outputs (setup.py), the step meter (meter.py), AdamW and schedules
(optim.py), metrics and reports (metrics.py), FLOPs for MFU (flops.py), checkpoints, resume
and clean stops (state.py; FSDP2 shards: sharded.py). The loss is the objective's
(slipstream/objectives/)."""

from slipstream.train.loop import train

__all__ = ["train"]
