"""A pickle payload for the tests that resume must refuse: unpickling it creates a file."""

from __future__ import annotations

from pathlib import Path


class Planted:
    """Unpickling this creates a file: the proof that a pickle ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))
