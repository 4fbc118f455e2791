"""What a run reports: metrics JSONL, TensorBoard, progress bar, loss plot, run summary.

`metrics.jsonl` in the output dir gets one line per logged step (`loss`, `lr`, `grad_norm`,
`tokens`, `tokens_per_s`, `peak_mem_gb`, and `mfu` on a GPU whose peak is known) and one
line per evaluation (`eval_loss`, `eval_ppl`); the same numbers go to TensorBoard and W&B as
`train.report_to` says (train/report_to.py). The loss-curve PNG (and for GRPO the
reward-curve PNG) is drawn when matplotlib is installed.
"""

from __future__ import annotations

import datetime
import json
import math
import sys
import time
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
from slipstream.train.report_to import open_reporters

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
    """metrics.jsonl, the reporters (`train.report_to`) and the progress bar of one run.

    Nothing is written before the first record (or `open()`): then the output dir is made
    and `first_files` written ({name: text}, the resolved config.yaml), so a run that fails
    before its first result leaves no folder behind. Off a terminal (no progress bar) each
    line starts with the step, the total and the time left.
    """

    def __init__(
        self, output_dir: Path, *, total_steps: int, start_step: int, enabled: bool = True,
        report_to: list[str] = (), first_files: dict[str, str] | None = None,
        config: dict[str, Any] | None = None,
    ) -> None:  # fmt: skip
        """`enabled=False` (every rank but 0 under torchrun): writes and shows nothing."""
        self.dir, self.path = output_dir, output_dir / "metrics.jsonl"
        self.enabled, self.start_step, self.total_steps = enabled, start_step, total_steps
        self.report_to, self.first_files, self.config = report_to, first_files or {}, config
        self._file, self._reporters = None, []
        self.bar = tqdm(
            total=total_steps, initial=start_step, desc="train", unit="step",
            disable=None if enabled else True,
        )  # fmt: skip
        self._started = time.perf_counter()

    def open(self) -> None:
        """Make the output dir and start the files (once; a no-op off rank 0)."""
        if not self.enabled or self._file is not None:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        for name, text in self.first_files.items():
            atomic_write_text(self.dir / name, text)
        _truncate_after(self.path, self.start_step)
        self._file = self.path.open("a", encoding="utf-8")
        self._reporters = open_reporters(self.report_to, self.dir, self.config or {})

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.open()
        line = json.dumps(record) + "\n"
        try:  # appended, not renamed: a log; a torn last line is dropped on resume
            self._file.write(line)
            self._file.flush()
        except OSError as e:
            if is_disk_full(e, self.path.parent):
                raise DiskFullError(self.path, len(line), free_bytes(self.path.parent)) from None
            raise
        numbers = {k: v for k, v in record.items() if k != "step" and _is_number(v)}
        for reporter in self._reporters:
            reporter.log(record["step"], numbers)
        if "loss" in record:
            tok_s = f"{record['tokens_per_s']:.0f}"
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=tok_s)
        text = " ".join(f"{k}={_fmt(v)}" for k, v in record.items() if v is not None)
        if self.bar.disable:
            print(f"{self._progress(record['step'])} {text}", file=sys.stderr, flush=True)
        else:
            self.bar.write(text)

    def _progress(self, step: int) -> str:
        """`[step/total eta H:MM:SS]`: the time left at the mean pace of this process."""
        done = step - self.start_step
        if done <= 0:
            return f"[{step}/{self.total_steps}]"
        left = (time.perf_counter() - self._started) / done * (self.total_steps - step)
        return f"[{step}/{self.total_steps} eta {datetime.timedelta(seconds=round(left))}]"

    def close(self) -> None:
        self.bar.close()
        if self._file is not None:
            self._file.close()
        for reporter in self._reporters:
            reporter.close()


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
    plt = _pyplot()
    if plt is None:
        return None
    records = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(6, 4))
    if train:
        ax.plot(*zip(*train), label="train")
    if evals:  # a few points, each an evaluation: markers, no line between them
        ax.plot(*zip(*evals), "o", label="eval")
    return _save_plot(plt, fig, ax, "loss", out_png)


def plot_rewards(metrics_path: Path, out_png: Path, window: int = 5) -> Path | None:
    """GRPO: the mean reward of each logged step (and its running mean over `window` logged
    steps) and each reward function's mean, against step; None without matplotlib or
    rewards."""
    plt = _pyplot()
    if plt is None:
        return None
    everything = read_metrics(metrics_path)
    records = [r for r in everything if "reward" in r]
    if not records:
        return None
    steps = [r["step"] for r in records]
    total = [r["reward"] for r in records]
    running = [sum(total[max(0, i - window + 1) : i + 1]) / min(i + 1, window)
               for i in range(len(total))]  # fmt: skip
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, total, color="C0", alpha=0.35, label="reward (weighted total)")
    ax.plot(steps, running, color="C0", lw=2, label=f"reward, running mean of {window}")
    names = sorted({k[len("rewards/") : -len("/mean")] for r in records for k in r
                    if k.startswith("rewards/") and k.endswith("/mean")})  # fmt: skip
    for i, name in enumerate(names, start=1):
        key = f"rewards/{name}/mean"
        ax.plot(*zip(*[(r["step"], r[key]) for r in records if key in r]), color=f"C{i}",
                lw=1, ls="--", label=name)  # fmt: skip
    held_out = [(r["step"], r["eval_reward"]) for r in everything if "eval_reward" in r]
    if held_out:
        ax.plot(*zip(*held_out), color="k", marker="o", label="held-out reward (greedy)")
    return _save_plot(plt, fig, ax, "mean reward of the step's completions", out_png)


def _pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _save_plot(plt: Any, fig: Any, ax: Any, ylabel: str, out_png: Path) -> Path:
    """Label a plot against step (whole numbers), write it atomically as a PNG, close it."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
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


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)
