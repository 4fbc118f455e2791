"""Training checkpoints (atomic, resumable) and clean stops on SIGINT/SIGTERM.

A checkpoint is a folder `output_dir/checkpoints/step-000123/` with one `state.pt`: the
trainable parameters (LoRA weights only, or every weight for full fine-tuning), the
optimizer and scheduler states, the step, and every RNG state (python, torch CPU, CUDA).
The data order needs no state of its own: epoch e visits the packed batches in an order
seeded by (seed, e), so the step number alone says where the data stream resumes.

Writes are atomic: the folder is written under a temporary name and renamed into place, so
a run killed mid-save leaves the previous checkpoint as the latest one, never half a new one.

Under torchrun `state.pt` holds every rank's RNG state and the world size (resume checks it).
DDP replicas are identical, so rank 0 writes the parameters and optimizer as above; FSDP2
shards are written beside `state.pt` by `torch.distributed.checkpoint`, each rank its own.
The output dir must be on a file system every node sees.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import threading
from pathlib import Path
from typing import Any

import torch

from slipstream import distributed as dist

CHECKPOINT_DIR = "checkpoints"


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters the optimizer updates, by name (what a checkpoint must restore)."""
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():  # the training device (train() makes it current) only:
        state["cuda"] = torch.cuda.get_rng_state()  # a resume may see other GPUs
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        # Checkpoints before this change hold a list, one state per visible GPU.
        torch.cuda.set_rng_state(
            cuda[torch.cuda.current_device()] if isinstance(cuda, list) else cuda
        )


def save_checkpoint(
    output_dir: str | os.PathLike,
    *,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    extra: dict[str, Any] | None = None,
    keep: int = 2,
) -> Path:
    """Write `checkpoints/step-{step:06d}` atomically; keep only the newest `keep`.

    Under torchrun every rank calls this; rank 0 writes `state.pt` and renames.
    """
    root = Path(output_dir) / CHECKPOINT_DIR
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-step-{step:06d}"
    if dist.is_main():
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()  # the folder exists before any rank writes its shards into it
    state = {
        "step": step,
        "scheduler": scheduler.state_dict(),
        "rng": dist.gather_objects(rng_state()),  # one per rank: dropout draws differ
        "world_size": dist.world_size(),
        "extra": extra or {},
    }
    if dist.is_sharded(model):
        dist.save_sharded(tmp, model, optimizer)
    else:
        state["model"] = trainable_state(model)
        state["optimizer"] = optimizer.state_dict()
    if dist.is_main():
        torch.save(state, tmp / "state.pt")
        if final.exists():  # the same step saved twice (e.g. a signal right after a save)
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in list_checkpoints(output_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()  # no rank goes on (or resumes) before the checkpoint is in place
    return final


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Finished checkpoints in `output_dir`, oldest first (temporary folders are ignored)."""
    root = Path(output_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step-*") if (p / "state.pt").is_file()]
    return sorted(found, key=lambda p: int(p.name.removeprefix("step-")))


def find_resume_checkpoint(resume: bool | str, output_dir: str | os.PathLike) -> Path | None:
    """The checkpoint `resume` points at: latest in output_dir (true), a path, or None."""
    if resume is False or resume is None:
        return None
    if resume is True:
        found = list_checkpoints(output_dir)
        return found[-1] if found else None
    path = Path(resume)
    if (path / "state.pt").is_file():
        return path
    found = list_checkpoints(path)
    if found:
        return found[-1]
    raise FileNotFoundError(f"resume: no checkpoint at '{path}' (no state.pt, no checkpoints/)")


def load_checkpoint(
    path: str | os.PathLike,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
) -> dict[str, Any]:
    """Restore parameters, optimizer, scheduler and RNG from `path`; returns the raw state."""
    state = torch.load(Path(path) / "state.pt", map_location="cpu", weights_only=False)
    dist.check_world_size(state.get("world_size", 1), path)
    if "model" not in state:  # written sharded (FSDP2)
        if not dist.is_sharded(model):
            raise ValueError(f"resume: {path} is sharded (FSDP); set train.parallel=fsdp")
        dist.load_sharded(Path(path), model, optimizer)
    else:
        if dist.is_sharded(model):
            raise ValueError(f"resume: checkpoint {path} is not sharded; set train.parallel=ddp")
        params = dict(model.named_parameters())
        missing = [n for n in state["model"] if n not in params]
        if missing:
            raise ValueError(
                f"resume: checkpoint {path} has parameter '{missing[0]}' that this model lacks "
                "(was it saved with another model or lora config?)"
            )
        with torch.no_grad():
            for name, value in state["model"].items():
                params[name].copy_(value)
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    rng = state["rng"]
    set_rng_state(rng[dist.rank()] if isinstance(rng, list) else rng)
    return state


class StopSignal:
    """Turns SIGINT/SIGTERM into a flag the loop checks after each optimizer step.

    The loop then saves a checkpoint and returns. The first signal restores the previous
    handlers, so a second Ctrl-C during the save stops the process the usual way.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def handler(self, signum: int, frame: Any = None) -> None:
        self.received = signum
        self.uninstall()

    @property
    def requested(self) -> bool:
        return self.received is not None

    def __enter__(self) -> StopSignal:
        # Handlers can only be installed from the main thread (e.g. not under a notebook
        # worker); elsewhere the run simply has no clean-stop support.
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self.handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
