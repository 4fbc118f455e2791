"""One run per output dir: a lock file held for the life of a run.

Two runs writing one output dir interleave `metrics.jsonl`, prune each other's checkpoints
and leave whichever adapter was saved last, and both exit 0. So a run holds
`output_dir/.slipstream.lock` from start to end: an exclusive `flock` on it (the kernel
drops it when the process dies, however it dies) and, inside, the holder's pid, host and
start time, for the message the next run prints (exit 2). Stale locks, file systems without
flock and torchrun: docs/reliability.md.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from slipstream import distributed as dist
from slipstream.config import check_output_dir
from slipstream.train.state import remove_partial_writes

LOCK_FILE = ".slipstream.lock"


class OutputDirLocked(ValueError):
    """Another run holds the output dir (exit 2)."""


class OutputDirLock:
    """`with OutputDirLock(out): ...` holds the lock on `out` (rank 0) for the block."""

    def __init__(self, output_dir: str | os.PathLike) -> None:
        self.path = Path(output_dir) / LOCK_FILE
        self.fd: int | None = None
        self.made: list[Path] = []  # folders the lock made, innermost first (removed if empty)

    def __enter__(self) -> OutputDirLock:
        if not dist.is_main():
            return self
        check_output_dir(self.path.parent)
        out = self.path.parent
        self.made = [p for p in [out, *out.parents] if not p.exists()]
        out.mkdir(parents=True, exist_ok=True)
        error = self.acquire()
        if error:
            raise OutputDirLocked(error)
        remove_partial_writes(self.path.parent)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def acquire(self) -> str | None:
        """Take the lock; returns why not (one line) when another run has it."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                held = _try_flock(fd)
            except BaseException:
                os.close(fd)
                raise
            previous = _read_holder(fd)
            if held is False or (held is None and _alive_elsewhere(previous)):
                os.close(fd)
                return self._refusal(previous, held)
            # The file may have been removed (a holder releasing) between open and flock:
            # then we hold a lock on an orphan and must start over on the new file.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        if previous:
            dist.print_main(
                f"slipstream: taking over the stale lock of pid {previous.get('pid')} on "
                f"{previous.get('host')} (that run is gone): {self.path}"
            )
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        os.fsync(fd)
        self.fd = fd
        return None

    def release(self) -> None:
        if self.fd is None:
            return
        # Unlink before closing: a run waiting on the old file notices (inode check above).
        self.path.unlink(missing_ok=True)
        os.close(self.fd)
        self.fd = None
        for folder in self.made:  # a run that wrote nothing leaves no new folder behind
            try:
                folder.rmdir()
            except OSError:  # not empty: the run's results
                break

    def _refusal(self, holder: dict[str, Any], held: bool | None) -> str:
        pid, host = holder.get("pid", "?"), holder.get("host", "?")
        since = holder.get("since")
        started = time.strftime(" since %H:%M:%S", time.localtime(since)) if since else ""
        hint = "wait for it, stop it, or pick another output_dir"
        if held is None and host != socket.gethostname():
            hint = f"if it is no longer running, delete {self.path}"
        return (
            f"output_dir {self.path.parent} is in use by another run (pid {pid} on {host}"
            f"{started}); {hint}"
        )


def _try_flock(fd: int) -> bool | None:
    """True: locked; False: another process holds it; None: no flock on this file system."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
            return None
        raise


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        text = os.pread(fd, 4096, 0).decode("utf-8", "replace")
        holder = json.loads(text) if text.strip() else {}
        return holder if isinstance(holder, dict) else {}
    except ValueError:
        return {}


def _alive_elsewhere(holder: dict[str, Any]) -> bool:
    """Without flock: is the recorded holder a live process (or on another host: unknown)?"""
    if not holder:
        return False
    if holder.get("host") != socket.gethostname():
        return True
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, another user's
    return True
