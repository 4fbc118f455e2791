"""The trainer: `train(config)` (loop.py), the run it prepares and finishes (run.py) from the
data, model and outputs (setup.py), the step meter (meter.py), AdamW and schedules
(optim.py), metrics and reports (metrics.py), FLOPs for MFU (flops.py), checkpoints, resume
and clean stops (state.py; FSDP2 shards: fsdp_shards.py). The loss is the objective's
(slipstream/objectives/)."""

import sys
import types

from slipstream.train.loop import train

__all__ = ["train"]


class _CallablePackage(types.ModuleType):
    """Once any module of this package is imported, Python sets `slipstream.train` to the
    package, shadowing the public function `slipstream.train(config)`; calling the package
    calls the function, so `slipstream.train(cfg)` works whatever was imported first."""

    def __call__(self, *args, **kwargs):
        return train(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
