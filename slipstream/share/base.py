"""What a run was trained from, for its model card: the base model's hub id and license.

The run records its base as it was given (adapter_config.json's `base_model_name_or_path`,
the adapter weights' `slipstream.base_model`, config.yaml's `model.path`): a hub id, a
built-in name, a local folder or a GGUF file. The hub id is the first of them that is one, or
that names one (a built-in model's, a GGUF's `general.source.huggingface.repository`, a
folder in the hub cache `models--ORG--NAME/snapshots/...`). The license is read where it is
found without a network first (the local folder's README.md, the GGUF's `general.license`,
the hub cache's README.md), then, only when asked (`online`), from the hub's model info.

No torch import here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from slipstream.share.files import read_json
from slipstream.sources import SOURCE_KEY, builtin_hub_id, is_hub_id, resolve_model

_CACHE_DIR = re.compile(r"models--([\w.-]+?)--([\w.-]+)$")


@dataclass(frozen=True)
class Base:
    hub_id: str | None  # None: trained from a local model the hub does not know by name
    given: str  # as the run recorded it (for the card when there is no hub id)
    license: str | None


def run_base(run: Path, config: dict, *, online: bool = False) -> Base:
    """The base model of `run` (config: its config.yaml, read)."""
    from slipstream.sources import safetensors_metadata

    adapter = read_json(run / "adapter_config.json")
    given = [adapter.get("base_model_name_or_path"),
             safetensors_metadata(run / "adapter_model.safetensors").get(SOURCE_KEY)
             if adapter else None,
             (config.get("model") or {}).get("path")]  # fmt: skip
    given = [g for g in given if isinstance(g, str) and g]
    if not given:
        return Base(None, "unknown", None)
    hub_id = next((h for h in map(_hub_id, given) if h), None)
    license = next((lic for lic in map(_local_license, given) if lic), None)
    if license is None and hub_id is not None:
        license = _cached_license(hub_id) or (_hub_license(hub_id) if online else None)
    return Base(hub_id, given[0], license)


def _local(text: str) -> Path | None:
    """The local file or folder `text` names (a built-in name: its file), else None."""
    try:
        path = Path(resolve_model(text, "base"))
    except ValueError:
        return None
    return path if path.exists() else None


def _hub_id(text: str) -> str | None:
    if builtin_hub_id(text):
        return builtin_hub_id(text)
    path = _local(text)
    if path is None:
        return text if is_hub_id(text) else None
    if path.suffix == ".gguf":
        repo = _gguf_field(path, "general.source.huggingface.repository")
        return repo if isinstance(repo, str) and is_hub_id(repo) and "/" in repo else None
    for part in path.resolve().parts:  # a snapshot folder of the hub cache
        m = _CACHE_DIR.fullmatch(part)
        if m:
            return f"{m.group(1)}/{m.group(2)}"
    return None


def _local_license(text: str) -> str | None:
    path = _local(text)
    if path is None:
        return None
    if path.suffix == ".gguf":
        value = _gguf_field(path, "general.license")
        return value if isinstance(value, str) and value else None
    return card_license(path / "README.md") if path.is_dir() else None


def card_license(readme: Path) -> str | None:
    """The `license` of a model card's YAML metadata, None without one."""
    if not readme.is_file():
        return None
    from huggingface_hub import metadata_load

    try:
        value = (metadata_load(readme) or {}).get("license")
    except ValueError:  # malformed YAML in someone else's card: no license from it
        return None
    return value if isinstance(value, str) and value else None


def _cached_license(hub_id: str) -> str | None:
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(hub_id, "README.md")
    return card_license(Path(cached)) if isinstance(cached, str) else None


def _hub_license(hub_id: str) -> str | None:
    """The base's license from the hub's model info; None when the hub does not say."""
    from huggingface_hub import HfApi

    try:
        info = HfApi().model_info(hub_id, timeout=10)
    except Exception:  # gated, missing, no answer (any client's error): a card without it
        return None
    card = getattr(info, "card_data", None)
    value = getattr(card, "license", None) if card is not None else None
    return value if isinstance(value, str) and value else None


def _gguf_field(path: Path, key: str) -> object:
    """One metadata field of a GGUF header (gguf's reader; numpy, no torch)."""
    import gguf

    try:
        field = gguf.GGUFReader(str(path)).fields.get(key)
    except (OSError, ValueError):
        return None
    return field.contents() if field is not None else None
