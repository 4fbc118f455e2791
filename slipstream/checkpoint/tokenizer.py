"""`load_tokenizer`: a model's tokenizer from its folder, a GGUF file, a built-in model or the
hub (the weights: checkpoint/hf.py, checkpoint/gguf.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from slipstream.hub import hub_error, hub_files_only
from slipstream.sources import gguf_type, lora_gguf_error, resolve_model


def load_tokenizer(path: str, what: str = "model.path") -> Any:
    """The checkpoint's tokenizer (from its folder, the one stored in a GGUF file, a built-in
    model's, or the hub's for a hub id)."""
    from transformers import AutoTokenizer

    local = resolve_model(path, what)  # a missing path is said to be one, not a bad hub id
    p = Path(local)
    if p.suffix == ".gguf":
        if not p.is_file():
            raise FileNotFoundError(f"{what}: GGUF file not found: {p}")
        if gguf_type(p) == "adapter":
            raise ValueError(lora_gguf_error(p, what))
        from slipstream.checkpoint.gguf import gguf_tokenizer

        return gguf_tokenizer(p)
    if p.exists() and not (p.is_dir() and any(p.glob("tokenizer*"))):
        raise ValueError(f"{what}: no tokenizer files (tokenizer.json ...) in '{p}'")
    files_only = not p.exists() and hub_files_only(local, what)  # offline: cache, or say so
    try:
        return AutoTokenizer.from_pretrained(local, local_files_only=files_only)
    except OSError as e:
        raise hub_error(what, path, "tokenizer", e) from None
