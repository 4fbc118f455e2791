"""What a run reports: metrics JSONL, TensorBoard, progress bar, loss plot, run summary.

`metrics.jsonl` in the output dir gets one line per logged step (`loss`, `lr`, `grad_norm`,
`tokens`, `tokens_per_s`, `peak_mem_gb`, and `mfu` on a GPU whose peak is known) and one
line per evaluation (`eval_loss`, `eval_ppl`). TensorBoard events are written when the
`tensorboard` package is installed; the loss-curve PNG when matplotlib is.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from slipstream.checkpoint.atomic import (
    DiskFullError,
    atomic_write,
    atomic_write_text,
    free_bytes,
    is_disk_full,
)

# Dense bf16 peak FLOP/s by device name (vendor datasheets, without sparsity).
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def peak_memory_gb(device: torch.device) -> float | None:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return None


class MetricsLog:
    """Writes metrics lines, TensorBoard scalars and the progress bar for one run."""

    def __init__(
        self, output_dir: Path, *, total_steps: int, start_step: int, enabled: bool = True
    ) -> None:
        """`enabled=False` (every rank but 0 under torchrun): writes and shows nothing."""
        self.path = output_dir / "metrics.jsonl"
        self._file = self._tb = None
        if enabled:
            _truncate_after(self.path, start_step)
            self._file = self.path.open("a", encoding="utf-8")
            self._tb = _tensorboard_writer(output_dir / "tensorboard")
        self.bar = tqdm(
            total=total_steps, initial=start_step, desc="train", unit="step",
            disable=None if enabled else True,
        )  # fmt: skip

    def log(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        line = json.dumps(record) + "\n"
        try:  # appended, not renamed: a log; a torn last line is dropped on resume
            self._file.write(line)
            self._file.flush()
        except OSError as e:
            if is_disk_full(e, self.path.parent):
                raise DiskFullError(self.path, len(line), free_bytes(self.path.parent)) from None
            raise
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, int | float):
                    self._tb.add_scalar(key, value, record["step"])
        if "loss" in record:
            tok_s = f"{record['tokens_per_s']:.0f}"
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=tok_s)
        text = " ".join(f"{k}={_fmt(v)}" for k, v in record.items() if v is not None)
        if self.bar.disable:
            print(text, file=sys.stderr, flush=True)
        else:
            self.bar.write(text)

    def close(self) -> None:
        self.bar.close()
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records in a metrics file; a line cut short by a kill mid-write is skipped."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def plot_losses(metrics_path: Path, out_png: Path) -> Path | None:
    """Train (and eval) loss against step as a PNG; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    records = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(6, 4))
    if train:
        ax.plot(*zip(*train), label="train")
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    atomic_write(out_png, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    plt.close(fig)
    return out_png


def write_json(path: Path, data: dict[str, Any]) -> Path:
    return atomic_write_text(path, json.dumps(data, indent=2, default=str) + "\n")


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 50 else float("inf")


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _truncate_after(path: Path, step: int) -> None:
    """Drop lines past `step` (left by an interrupted run that is now resumed from `step`)."""
    if not path.is_file():
        return
    keep = [r for r in read_metrics(path) if r.get("step", 0) <= step] if step > 0 else []
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in keep))


def _tensorboard_writer(log_dir: Path) -> Any:
    try:
        import tensorboard  # noqa: F401  (torch's writer needs it)
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(log_dir=str(log_dir))
