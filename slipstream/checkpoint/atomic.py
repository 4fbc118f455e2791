"""Atomic file writes: write a temp file in the target's folder, then rename over the target.

An interrupted save (Ctrl-C, OOM kill, full disk) never leaves half a file where a reader
expects a whole one: `os.replace` within one file system is atomic.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def atomic_write(path: str | os.PathLike, write: Callable[[str], object]) -> Path:
    """Call `write(tmp_path)`, then rename the temp file over `path`; returns `path`."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
