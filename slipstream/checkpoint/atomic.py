"""Atomic, durable file writes: every file a run leaves in its output dir goes through here.

Temporary file in the target's folder, fsync, the mode a plain `open()` would give (0666 less
the umask: `mkstemp` makes 0600, which left adapters and configs unreadable to the rest of a
group), `os.replace` over the target, fsync of the folder: an interrupted save never leaves
half a file where a reader expects a whole one. A full disk is a `DiskFullError` (exit 2) and
the temporary file is removed (docs/reliability.md). A file written piece by piece
(`staged_file`) grows in `NAME.partial`, renamed over NAME when it is whole.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO


class DiskFullError(OSError):
    """A write ran out of space; the message names the path and the bytes it needed."""

    def __init__(self, path: str | os.PathLike, needed: int, free: int) -> None:
        self.path, self.needed, self.free = Path(path), needed, free
        super().__init__(
            errno.ENOSPC,
            f"disk full: writing {path} needs {format_bytes(needed)} but only "
            f"{format_bytes(free)} is free there; free some space (or pick another "
            "output_dir) and rerun with resume=true",
        )

    def __str__(self) -> str:
        return self.strerror


def format_bytes(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} bytes" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def file_mode() -> int:
    """The mode `open()` gives a new file: 0666 less the process umask."""
    try:  # Linux >= 4.7 reports the umask without changing it (os.umask must set it)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file's (or a folder's entries') data to disk."""
    flags = os.O_RDONLY | (os.O_DIRECTORY if Path(path).is_dir() else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    except OSError as e:  # some file systems cannot fsync a folder; the data is still there
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def free_bytes(folder: str | os.PathLike) -> int:
    return shutil.disk_usage(folder).free


def is_disk_full(e: BaseException, folder: str | os.PathLike) -> bool:
    """ENOSPC/EDQUOT, also when a writer lost the errno: safetensors says it in words, and
    torch.save only "unexpected pos 576 vs 534", so a folder with under 64 KiB left (read
    before the partial file is removed) counts too."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if "No space left on device" in str(e) or "Disk quota exceeded" in str(e):
        return True
    try:
        return isinstance(e, Exception) and free_bytes(folder) < 64 * 1024
    except OSError:
        return False


def check_space(path: str | os.PathLike, needed: int) -> None:
    """DiskFullError before writing `needed` bytes next to `path` when they cannot fit."""
    free = free_bytes(Path(path).parent)
    if needed > free:
        raise DiskFullError(path, needed, free)


def disk_full_error(path: str | os.PathLike, needed: int, written: int) -> DiskFullError:
    """The error for a write that ran out of space after `written` bytes (space given back)."""
    return DiskFullError(path, max(needed, written), free_bytes(Path(path).parent))


def atomic_write(
    path: str | os.PathLike, write: Callable[[str], object], *, size_hint: int = 0
) -> Path:
    """Call `write(tmp_path)`, then fsync, chmod (umask) and rename it over `path`.

    `size_hint`: the bytes the file will take, when known (checked against free space first).
    """
    path = Path(path)
    if size_hint:
        check_space(path, size_hint)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, file_mode())
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        written = os.path.getsize(tmp) if os.path.exists(tmp) else 0
        full = is_disk_full(e, path.parent)
        Path(tmp).unlink(missing_ok=True)
        if full:
            raise disk_full_error(path, size_hint, written) from None
        raise
    fsync_path(path.parent)
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    data = text.encode("utf-8")
    return atomic_write(path, lambda tmp: Path(tmp).write_bytes(data), size_hint=len(data))


def atomic_write_files(folder: str | os.PathLike, write_into: Callable[[Path], object]) -> None:
    """`write_into(tmp_dir)` writes some files (e.g. a tokenizer's `save_pretrained`); each is
    then moved into `folder` as `atomic_write` would (fsync, umask mode, rename, fsync)."""
    folder = Path(folder)
    tmp = Path(tempfile.mkdtemp(dir=folder, prefix=".tmp-files-"))
    try:
        write_into(tmp)
        files = [p for p in sorted(tmp.rglob("*")) if p.is_file()]
        for f in files:
            os.chmod(f, file_mode())
            fsync_path(f)
        for f in files:
            target = folder / f.relative_to(tmp)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(f, target)
            fsync_path(target.parent)
    except BaseException as e:
        written = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file())
        if is_disk_full(e, folder):
            shutil.rmtree(tmp, ignore_errors=True)
            raise disk_full_error(folder, 0, written) from None
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def partial_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".partial")


@contextmanager
def staged_file(path: str | os.PathLike) -> Iterator[TextIO]:
    """A text file written piece by piece into `path`.partial (opened at once: an unwritable
    place fails before any work) and renamed over `path` when the block ends (fsync, rename,
    fsync of the folder). A reader never finds half a file under `path`; after a failure what
    was written stays in `path`.partial (removed when nothing was)."""
    path, tmp = Path(path), partial_path(path)
    f = open(tmp, "w", encoding="utf-8")  # noqa: SIM115 (closed below, on both paths)
    try:
        yield f
        f.close()
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        f.close()
        if tmp.exists() and tmp.stat().st_size == 0:
            tmp.unlink()
        raise
    fsync_path(path.parent)
