"""Training checkpoints (atomic, verified, resumable) and clean stops on SIGINT/SIGTERM.

A checkpoint is a folder `output_dir/checkpoints/step-000123/` with one `state.pt`: the
trainable parameters (LoRA weights only, or every weight for full fine-tuning), the
optimizer and scheduler states, the step, and every rank's RNG states (python, torch CPU,
CUDA). The data order needs no state of its own: epoch e visits the packed batches in an order
seeded by (seed, e), so the step number alone says where the data stream resumes. FSDP2
shards are written beside `state.pt` by `torch.distributed.checkpoint` (fsdp_shards.py).

Why a save goes through a temporary folder, fsyncs and a `manifest.json` written last, and
why resume loads with `weights_only=True`: docs/reliability.md. Hashing costs one read of
the checkpoint at save and at resume (~1.5 GB/s a core for SHA-256; LoRA checkpoints are MBs).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import shutil
import signal
import threading
from pathlib import Path
from typing import Any

import torch

import slipstream.train.fsdp_shards as fsdp_shards
from slipstream import distributed as dist
from slipstream.checkpoint.atomic import (
    atomic_write_text,
    check_space,
    disk_full_error,
    fsync_path,
    is_disk_full,
)

CHECKPOINT_DIR = "checkpoints"
MANIFEST = "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from (damaged, or holding more than plain data)."""


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
    keep_step: int | None = None,
) -> Path:
    """Write `checkpoints/step-{step:06d}` atomically; keep only the newest `keep`, and the
    one of `keep_step` (the best eval loss) besides.

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
    needed = 0
    try:
        if dist.is_sharded(model):
            fsdp_shards.save_shards(tmp, model, optimizer)
        else:
            params = model.named_parameters()  # those the optimizer updates, by name
            state["model"] = {n: p.detach() for n, p in params if p.requires_grad}
            state["optimizer"] = optimizer.state_dict()
        if dist.is_main():
            check_plain(state)
            needed = tensor_bytes(state) + 64 * 1024  # the pickled rest is a few KB
            check_space(tmp / "state.pt", needed)
            torch.save(state, tmp / "state.pt")
            write_manifest(tmp, step)  # last: a folder with a manifest is a whole one
            if final.exists():  # the same step saved twice (e.g. a signal right after a save)
                shutil.rmtree(final)
            os.replace(tmp, final)
            fsync_path(root)
            remove_old_checkpoints(output_dir, keep, keep_step)
    except BaseException as e:
        if dist.is_main() and tmp.exists():
            written = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file())
            full = is_disk_full(e, root)
            shutil.rmtree(tmp, ignore_errors=True)  # give the space back
            if full:
                raise disk_full_error(final, needed, written) from None
        raise
    dist.barrier()  # no rank goes on (or resumes) before the checkpoint is in place
    return final


def remove_partial_writes(output_dir: str | os.PathLike) -> list[Path]:
    """Remove what killed runs left half-written: atomic-write temp files, checkpoint folders
    cut mid-write. Call with the output dir locked (no other writer is using them)."""
    out, root = Path(output_dir), Path(output_dir) / CHECKPOINT_DIR
    found = [*out.glob(".*.tmp"), *out.glob(".tmp-files-*"), *out.glob(".write-test-*")]
    found += [*root.glob(".tmp-step-*"), *root.glob(".*.tmp")]
    for p in found:
        shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
    return found


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in a nested dict/list (what `torch.save` will write, roughly)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(tensor_bytes(v) for v in obj)
    return 0


PLAIN = (type(None), bool, int, float, str, torch.Tensor)


def check_plain(obj: Any, where: str = "state") -> None:
    """Our invariant: `state.pt` holds what `weights_only=True` loads (a new field that does
    not would make every checkpoint unresumable, so it fails at the first save instead)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            assert isinstance(k, str | int), f"{where}: key {k!r}"
            check_plain(v, f"{where}.{k}")
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            check_plain(v, f"{where}[{i}]")
    else:
        assert isinstance(obj, PLAIN), f"{where} is a {type(obj).__name__}"


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_manifest(folder: Path, step: int) -> None:
    """fsync every file in `folder`, then write `manifest.json` (sizes and SHA-256) last."""
    files = {}
    for f in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST):
        fsync_path(f)
        files[f.relative_to(folder).as_posix()] = {
            "size": f.stat().st_size,
            "sha256": sha256_file(f),
        }
    for sub in sorted({f.parent for f in folder.rglob("*") if f.is_file()}):
        fsync_path(sub)
    manifest = {"step": step, "files": files}
    atomic_write_text(folder / MANIFEST, json.dumps(manifest, indent=1) + "\n")


def verify_checkpoint(path: Path) -> str | None:
    """None when the checkpoint matches its manifest, else what is wrong, in a few words.
    Checkpoints written before manifests existed pass (their load still checks the zip)."""
    manifest_path = Path(path) / MANIFEST
    if not manifest_path.is_file():
        return None
    try:
        files = json.loads(manifest_path.read_text())["files"]
    except (ValueError, KeyError, TypeError, OSError):
        return f"{MANIFEST} is unreadable"
    for name, want in files.items():
        f = Path(path) / name
        if not f.is_file():
            return f"{name} is missing"
        size = f.stat().st_size
        if size != want["size"]:
            return f"{name} has {size} bytes, the manifest says {want['size']}"
        if sha256_file(f) != want["sha256"]:
            return f"{name} does not match its checksum"
    return None


def remove_old_checkpoints(output_dir: str | os.PathLike, keep: int, keep_step: int | None):
    """All but the newest `keep` checkpoints, and the one of step `keep_step`, go."""
    kept = None if keep_step is None else f"step-{keep_step:06d}"
    for old in list_checkpoints(output_dir)[:-keep]:
        if old.name != kept:
            shutil.rmtree(old, ignore_errors=True)


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Finished checkpoints in `output_dir`, oldest first (temporary folders are ignored)."""
    root = Path(output_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step-*") if (p / "state.pt").is_file()]
    return sorted(found, key=lambda p: int(p.name.removeprefix("step-")))


def find_resume_checkpoint(resume: bool | str, output_dir: str | os.PathLike) -> Path | None:
    """The checkpoint `resume` points at: the newest intact one in output_dir (true: an error
    when there is none; "auto": None then, a fresh start), a path, or None (false). A damaged
    newest checkpoint is said in one line and skipped; none intact, or a damaged one named by
    path, is a CheckpointError (exit 2)."""
    if resume is False or resume is None:
        return None
    if resume is True or resume == "auto":
        found = newest_intact(list_checkpoints(output_dir), output_dir)
        if found is None and resume is True:
            raise ValueError(
                f"resume=true but output_dir '{output_dir}' holds no checkpoint; set "
                "resume=auto to resume when there is one and start fresh otherwise"
            )
        return found
    path = Path(resume)
    if (path / "state.pt").is_file():
        reason = verify_checkpoint(path)
        if reason:
            raise CheckpointError(f"resume: checkpoint {path} is damaged ({reason})")
        return path
    found = list_checkpoints(path)
    if found:
        return newest_intact(found, path)
    raise FileNotFoundError(f"resume: no checkpoint at '{path}' (no state.pt, no checkpoints/)")


def newest_intact(found: list[Path], output_dir: str | os.PathLike) -> Path | None:
    damaged = []
    for path in reversed(found):
        reason = verify_checkpoint(path)
        if reason is None:
            return path
        damaged.append(f"{path.name}: {reason}")
        dist.print_main(
            f"slipstream: checkpoint {path} is damaged ({reason}); trying the one before it"
        )
    if damaged:
        raise CheckpointError(
            f"resume: no intact checkpoint in {Path(output_dir) / CHECKPOINT_DIR} "
            f"({'; '.join(damaged)}); set resume=false to start over"
        )
    return None


def read_state(path: str | os.PathLike, *, mmap: bool = False) -> dict[str, Any]:
    """`state.pt` loaded with weights_only=True; anything else is a one-line CheckpointError.
    `mmap`: tensors stay on disk until read (to look at the rest of a large checkpoint)."""
    file = Path(path) / "state.pt"
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise refused(file, fsdp_shards.what_it_calls(e)) from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise CheckpointError(f"resume: {file} is damaged ({str(e).splitlines()[0]})") from None


def refused(file: str | os.PathLike, what: str) -> CheckpointError:
    return CheckpointError(
        f"resume: refused {file}: it holds a pickled object, not only tensors and plain "
        f"data ({what}); it was not run. Resume only from checkpoints you trust"
    )


def load_checkpoint(
    path: str | os.PathLike,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
) -> dict[str, Any]:
    """Restore parameters, optimizer, scheduler and RNG from `path`; returns the raw state."""
    state = read_state(path)
    fsdp_shards.check_world_size(state.get("world_size", 1), path)
    if "model" not in state:  # written sharded (FSDP2)
        if not dist.is_sharded(model):
            raise ValueError(f"resume: {path} is sharded (FSDP); set train.parallel=fsdp")
        try:
            fsdp_shards.load_shards(Path(path), model, optimizer)
        except fsdp_shards.UnsafePickle as e:
            raise refused(*e.args) from None
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
        for name, value in state["model"].items():
            if value.shape != params[name].shape:
                raise ValueError(
                    f"resume: checkpoint {path} has '{name}' of shape {tuple(value.shape)}, "
                    f"this model's is {tuple(params[name].shape)} (was it saved with another "
                    "model or lora config?)"
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

    @property
    def name(self) -> str | None:
        """The signal received, as shells name it ("SIGINT"), or None."""
        return signal.Signals(self.received).name if self.received else None

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
