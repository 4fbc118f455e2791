"""Reading a GGUF's metadata fields (the gguf package's `GGUFReader`): a key's value or a
default, and a float32 back as the decimal config.json had. numpy only, no torch."""

from __future__ import annotations

from typing import Any

import numpy as np


def field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def decimal(value: Any) -> float:
    """A float32 from the file as the shortest decimal that rounds to it (1e-05, not
    9.99999974e-06): the number config.json had, so configs compare equal after a round trip."""
    return float(str(np.float32(value)))
