"""Where metrics go besides `metrics.jsonl` (`train.report_to`): TensorBoard event files in
`output_dir/tensorboard/`, and Weights & Biases (its own settings: `WANDB_PROJECT`, default
"slipstream"; `WANDB_MODE=offline` keeps the run in `output_dir/wandb/` for `wandb sync`).

`report_to` unset: TensorBoard when the package is installed, as before the key existed. A
list: exactly those, each checked installed before anything slow (one line naming the pip
install); `[]`: none. Each reporter takes the numeric values of each record at its step.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

REPORTERS = {"tensorboard": "tensorboard", "wandb": "wandb"}  # name -> package to install


def resolve_report_to(names: list[str] | None) -> list[str]:
    """The reporters a run uses; ValueError when one asked for is not installed."""
    if names is None:
        return ["tensorboard"] if importlib.util.find_spec("tensorboard") else []
    for name in names:
        if importlib.util.find_spec(REPORTERS[name]) is None:
            raise ValueError(
                f"train.report_to lists {name} but it is not installed: pip install "
                f"{REPORTERS[name]} (or drop it from train.report_to)"
            )
    return list(names)


def open_reporters(names: list[str], output_dir: Path, config: dict[str, Any]) -> list[Any]:
    return [_OPEN[name](output_dir, config) for name in names]


class TensorBoard:
    def __init__(self, output_dir: Path, config: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(output_dir / "tensorboard"))

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class WandB:
    def __init__(self, output_dir: Path, config: dict[str, Any]) -> None:
        import os

        import wandb

        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "slipstream"),
            name=output_dir.resolve().name,
            dir=str(output_dir),
            config=config,
        )

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


_OPEN = {"tensorboard": TensorBoard, "wandb": WandB}
