"""A model source's model_type, read before anything heavy loads (no torch, no transformers):
config.json's in a folder (or a hub id's, when the local hub cache holds it), or a GGUF
file's `general.architecture` from its header (`gguf_config.model_type_for` maps it).

`check_model_source` refuses a model slipstream cannot build right when the config is read,
before a tokenizer, the data or a weight loads; which types are supported is decided by
`slipstream.models.check_model_type` alone.
"""

from __future__ import annotations

import json
from pathlib import Path

from slipstream.checkpoint.fp8 import check_quantization
from slipstream.models import check_model_type
from slipstream.sources import gguf_header_string, is_hub_id, resolve_model


def check_model_source(
    source: str, what: str = "model.path", implementation: str = "auto",
    trust_remote_code: bool = False,
) -> str | None:  # fmt: skip
    """A one-line ValueError (the supported types listed) when `source` holds a model type
    slipstream cannot build; else which path it takes and why ("llama: native family ..."),
    or None when only a download could tell."""
    found = model_type_of(source, what)
    if found is None:
        return None
    model_type, where = found
    hf = _config_dict(source, what)
    why = check_model_type(model_type, where, implementation, hf, trust_remote_code)
    check_quantization(hf or {}, where)  # a quantization we cannot load, said before it loads
    return f"{model_type}: {why}"


def model_config(source: str, what: str = "model.path") -> dict | None:
    """A local model source's config.json as a dict (None: not local, or unreadable)."""
    return _config_dict(source, what)


def _config_dict(source: str, what: str) -> dict | None:
    config = Path(resolve_model(source, what)) / "config.json"
    try:
        hf = json.loads(config.read_text(encoding="utf-8")) if config.is_file() else None
    except (OSError, ValueError):
        return None
    return hf if isinstance(hf, dict) else None


def model_type_of(source: str, what: str = "model.path") -> tuple[str | None, str] | None:
    """(model_type, where it was read) of a model source; None when it cannot be told without
    a download (a hub id not in the local cache) or the file does not say."""
    local = Path(resolve_model(source, what))
    if local.suffix.lower() == ".gguf" and local.is_file():
        return gguf_model_type(local)
    config = local / "config.json"
    if not local.exists() and is_hub_id(str(source)):
        cached = _cached_hub_config(str(source))
        if cached is None:
            return None
        config = cached
    if not config.is_file():
        return None  # check_model_path says what is wrong with the folder
    try:
        hf = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{what}: {config} is not readable as JSON ({e})") from None
    return (hf.get("model_type") if isinstance(hf, dict) else None), f"{what}: {config}"


def _cached_hub_config(repo_id: str) -> Path | None:
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except ValueError:  # not a repo id after all
        return None
    return Path(found) if isinstance(found, str) else None


def gguf_model_type(path: Path) -> tuple[str | None, str] | None:
    """The model_type of a GGUF file's architecture (`gguf_config.MODEL_TYPES`), read from
    the first keys of its header."""
    from slipstream.checkpoint.gguf_config import model_type_for

    arch = gguf_header_string(path, "general.architecture")
    if arch is None:
        return None  # the reader says what is wrong with the file
    return model_type_for(arch, path), f"{path} (GGUF architecture {arch!r})"
