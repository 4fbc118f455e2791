"""Hugging Face checkpoints: `load_model` and `save_model`.

Loading streams tensors shard by shard straight into a model allocated once in the target
dtype on the target device (built on the meta device first), so a 16 GB checkpoint never
costs 32 GB: one tensor at a time is in flight. Saving writes the HF layout (config.json,
model.safetensors, sharded with an index above 5 GB) atomically: temp files, then renames.

Names are the family's weight map's (models/weights.py), made once per load or save. Where a
checkpoint holds the model under other names (the text model of a multimodal Gemma 3),
loading maps them to ours and leaves the tensors that are not ours (the vision tower) in the
checkpoint; saving writes ours under the names the source checkpoint used and copies the
others from it (`model.checkpoint_path`, recorded by `load_model`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from slipstream.checkpoint.atomic import atomic_write, atomic_write_text
from slipstream.checkpoint.fp8 import (
    check_fp8_tensors,
    check_quantization,
    dequantized,
    safetensors_headers,
    without_quantization,
)
from slipstream.checkpoint.hf_config import current_config, generation_config
from slipstream.hub import hub_error, hub_files_only
from slipstream.models import choose_family, family_spec, weight_map
from slipstream.models.common import CausalLM
from slipstream.models.weights import WeightMap, check_shape, from_hf_name, to_hf_name
from slipstream.sources import resolve_model

SHARD_BYTES = 5 * 1024**3
# A multimodal checkpoint's image processor files, copied beside the tensors save passes through.
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
# Tensors some checkpoints carry that are derived, not learned.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(
    path_or_repo_id: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    quantize: str | None = None,
    implementation: str = "auto",
    trust_remote_code: bool = False,
) -> CausalLM:
    """Load a local HF folder, a `.gguf` file, or a hub repo id into a slipstream model.

    quantize="nf4": decoder linear weights become bitsandbytes NF4, quantised one tensor at a
    time while loading (slipstream.peft.qlora). Pre-quantised bitsandbytes 4-bit checkpoints
    load in their 4-bit form whatever `quantize` says. implementation: "auto" (the native
    family where there is one, else transformers' modeling code: models/generic.py),
    "native" or "transformers"; `model.load_path` says which was taken and why.
    """
    how = dict(implementation=implementation, trust_remote_code=trust_remote_code)
    device = torch.device(device) if device is not None else torch.device("cpu")
    # float32 on CPU (no native bf16 on most CPUs); bf16 on accelerators.
    dtype = dtype or (torch.float32 if device.type == "cpu" else torch.bfloat16)
    source = str(path_or_repo_id)
    path = Path(resolve_model(source, "load_model"))  # a built-in name becomes its file
    if path.suffix == ".gguf":
        from slipstream.checkpoint.gguf import read_gguf

        hf, tensors = read_gguf(path)
        hub_id = hf.pop("_name_or_path", None)  # the checkpoint it was converted from
        model = _load(hf, tensors, dtype, device, str(path), quantize, None, **how)
    else:
        folder = _resolve_folder(path)
        hf = read_config(folder)
        tensors = _safetensors_tensors(folder)
        model = _load(hf, tensors, dtype, device, str(folder), quantize, folder, **how)
        hub_id = None if path.exists() else source
    # What peft and transformers load as the base (a hub id when one is known), and what
    # slipstream loads it from (a built-in name stays a name: it resolves on any machine).
    model.name_or_path = hub_id or source
    model.source = source
    return model


def load_with_head(
    folder: str | os.PathLike,
    head: str,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> tuple[CausalLM, torch.Tensor]:
    """A checkpoint whose head is not the LM head (transformers' `*ForSequenceClassification`:
    `model.*` and `score.weight`): the backbone as a model without an LM head, and the tensor
    named `head`. The model's config.hf stays the checkpoint's own."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    dtype = dtype or (torch.float32 if device.type == "cpu" else torch.bfloat16)
    folder = _resolve_folder(Path(folder))
    hf = read_config(folder)
    found: dict[str, torch.Tensor] = {}

    def backbone_tensors():
        for name, tensor in _safetensors_tensors(folder):
            if name == head:
                found[name] = tensor
            else:
                yield name, tensor

    # Tied: the model is built without an LM head (the checkpoint has none to load).
    model = _load({**hf, "tie_word_embeddings": True}, backbone_tensors(), dtype, device,
                  str(folder), folder=folder)  # fmt: skip
    if head not in found:  # transformers' own loader (the generic family) read the backbone
        found.update(_safetensors_tensors(folder, only={head}))
    if head not in found:
        raise ValueError(f"{folder}: checkpoint has no {head!r} tensor (not a reward model)")
    model.config.hf = hf
    model.name_or_path = model.source = str(folder)
    return model, found[head]


def read_config(folder: Path) -> dict:
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{cfg_path} not found: a checkpoint folder needs config.json.")
    try:
        return json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path} is not valid JSON: {e}") from None


def _resolve_folder(path_or_repo_id: str | os.PathLike) -> Path:
    """A local folder as it is; a hub id fetched; a path that does not exist said to be one."""
    path = Path(resolve_model(str(path_or_repo_id), "model"))
    if path.exists():
        return path
    from huggingface_hub import snapshot_download

    files_only = hub_files_only(str(path), "load_model")  # offline: the cache, or say so
    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
    try:
        return Path(
            snapshot_download(str(path), allow_patterns=patterns, local_files_only=files_only)
        )
    except Exception as e:  # offline, unknown repo, gated: huggingface_hub's own words
        raise hub_error("load_model", str(path), "model", e) from None


def _safetensors_files(folder: Path) -> list[str]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    if (folder / "model.safetensors").is_file():
        return ["model.safetensors"]
    raise ValueError(f"{folder}: no model.safetensors or model.safetensors.index.json found.")


def _safetensors_tensors(
    folder: Path, only: set[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, one at a time (or those named in `only`)."""
    for name in _safetensors_files(folder):
        with safe_open(str(folder / name), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if only is None or key in only:
                    yield key, f.get_tensor(key)


def _safetensors_names(folder: Path) -> list[str]:
    names = []
    for name in _safetensors_files(folder):
        with safe_open(str(folder / name), framework="pt", device="cpu") as f:
            names.extend(f.keys())
    return names


@contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _load(
    hf: dict, tensors, dtype: torch.dtype, device: torch.device, source: str, quantize=None,
    folder: Path | None = None, implementation: str = "auto", trust_remote_code: bool = False,
) -> CausalLM:  # fmt: skip
    from slipstream.peft import qlora

    where = f"{source}/config.json"
    fp8, base_quantization = check_quantization(hf, where), None
    if fp8 is not None:  # checked from the headers before a weight loads; dequantised as read
        count = check_fp8_tensors(safetensors_headers(folder, _safetensors_files(folder)), fp8,
                                  source)  # fmt: skip
        hf = without_quantization(hf)
        tensors = dequantized(tensors, dtype, device, source)
        base_quantization = _dequantized_from(fp8, count, dtype)
    name, why = choose_family(hf.get("model_type"), where, implementation, hf, trust_remote_code)
    family = family_spec(hf.get("model_type"), where, implementation, hf, trust_remote_code)
    if family.load is not None:
        quantize = qlora.check_quantize(quantize, hf, source)
        if quantize:
            qlora.require_bitsandbytes()
        model = family.load(hf, folder, dtype, device, quantize, source, trust_remote_code)
        model.load_path = f"{hf.get('model_type')}: {why}"
        model.checkpoint_path = Path(source)
        model.base_quantization = base_quantization
        return model
    cfg = family.config_from_hf(hf)
    weights = family.weights(cfg)
    nf4 = None
    if qlora.check_quantize(quantize, hf, source) == "nf4":
        nf4 = qlora.NF4Loader(hf, dtype, source)
    with _default_dtype(dtype), torch.device("meta"):
        model = family.build(cfg)
    if nf4 is not None:  # before to_empty: target weights are never allocated in full precision
        nf4.replace_targets(model)
    model.to_empty(device=device)
    model.reset_buffers()
    loaded = _load_tensors(model, weights, nf4, tensors, source)
    missing = [n for n in weights.expected_names(model) if n not in loaded]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{source}: checkpoint is missing tensor {missing[0]!r}{more}.")
    model.checkpoint_path = Path(source)  # where save_model finds the tensors it passes through
    model.load_path = f"{hf.get('model_type')}: {why}"
    model.base_quantization = base_quantization
    return model


def _dequantized_from(fp8, count: int, dtype: torch.dtype) -> str:
    """What an export says of an FP8 base (checkpoint/export.py)."""
    return f"{fp8.describe()}: {count} weights dequantised to {str(dtype).removeprefix('torch.')}"


@torch.no_grad()
def _load_tensors(model: CausalLM, weights: WeightMap, nf4, tensors, source: str) -> set[str]:
    """Put each checkpoint tensor in its place; returns the names filled."""
    cfg = model.config
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for hf_name, tensor in tensors:
        name = weights.our_name(hf_name)
        if name is None:
            continue  # never held by our model: save/export copy it from the source
        if nf4 is not None and nf4.take(name, tensor):
            continue
        if weights.load(model, name, tensor):
            loaded.add(name)
            continue
        if name.endswith(IGNORED_SUFFIXES) or (
            name == "lm_head.weight" and cfg.tie_word_embeddings
        ):
            continue
        if name not in params:
            raise ValueError(f"{source}: unexpected tensor {name!r} for {cfg.model_type}.")
        check_shape(name, tensor.shape, params[name].shape, source)
        params[name].copy_(tensor)
        loaded.add(name)
    if nf4 is not None:
        loaded.update(nf4.finish())
    return loaded


def hf_state(model: CausalLM) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs in the on-disk layout; a multimodal checkpoint's other tensors
    (vision tower, projector) read from the source checkpoint, unchanged."""
    weights = weight_map(model.config)
    state = weights.hf_state(model)
    if not weights.layouts:
        yield from state
        return
    folder, names = _source_names(model)
    # The source's layout (ties: the last, transformers' save layout): a name counts for a
    # layout that reads it as `our_name` does (Qwen-VL's older layout's `model.` prefix also
    # matches the module tree's `model.language_model.` names, which it reads wrongly).
    layouts = weights.layouts
    ours = [from_hf_name(n, layouts) for n in names]
    counts = [
        sum(o is not None and from_hf_name(n, (lay,)) == o for n, o in zip(names, ours))
        for lay in layouts
    ]
    layout = layouts[max(reversed(range(len(layouts))), key=counts.__getitem__)]
    others = [n for n in names if weights.is_passthrough(n)]
    if any(".weight." in n for n in others):  # bitsandbytes pieces: weight.absmax, ...
        raise ValueError(
            f"save_model: the vision tower in {folder} is stored 4-bit (bitsandbytes) and "
            "cannot go into a full-precision checkpoint; save from the original checkpoint "
            "(e.g. slipstream export ADAPTER --base ORIGINAL)."
        )
    for name, t in state:
        yield to_hf_name(name, layout), t
    copied = _safetensors_tensors(folder, only=set(others))
    if getattr(model, "base_quantization", None):  # an FP8 vision tower: as the model's dtype
        copied = dequantized(copied, next(model.parameters()).dtype, source=str(folder))
    yield from copied


def passthrough_names(model: CausalLM) -> list[str]:
    """The source checkpoint's tensors that save copies unchanged ([] for most families)."""
    weights = weight_map(model.config)
    if not weights.layouts:
        return []
    return [n for n in _source_names(model)[1] if weights.is_passthrough(n)]


def _source_names(model: CausalLM) -> tuple[Path, list[str]]:
    """The source checkpoint's folder and tensor names, for the tensors save passes through."""
    kind = model.config.model_type
    folder = getattr(model, "checkpoint_path", None)
    if folder is None:
        raise ValueError(
            f"save_model: a {kind} checkpoint holds tensors this model does not (the vision "
            "tower), copied from the checkpoint it was loaded from; load it with load_model()."
        )
    try:
        return folder, _safetensors_names(folder)
    except (ValueError, OSError):
        raise ValueError(
            f"save_model: the {kind} checkpoint this model was loaded from ({folder}) is gone; "
            "its vision tower and projector are copied from there: restore it, then save."
        ) from None


def save_model(model: CausalLM, directory: str | os.PathLike, *, tokenizer: Any = None) -> Path:
    """Write config.json, generation_config.json and safetensors in the HF layout that
    `transformers` loads unchanged (hf_config.py: current keys, the source's sampling
    defaults; `tokenizer` supplies eos/pad ids the config lacks)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    from slipstream.peft.qlora import has_4bit_weights

    if getattr(model.config, "implementation", "native") == "transformers":
        return _save_generic(model, out)

    if has_4bit_weights(model):
        raise ValueError(
            "save_model: the model has 4-bit (NF4) weights; use export_merged() "
            "(or peft.qlora.dequantize_model) to write a full-precision checkpoint."
        )
    state = dict(hf_state(model))
    lora = [n for n in state if "lora_" in n or ".base_layer." in n]
    if lora:
        raise ValueError(
            f"save_model: the model still has LoRA layers ({lora[0]}); "
            "use export_merged() (or merge_lora) to fold them in first."
        )
    dtype = next(iter(state.values())).dtype
    write_tensors(state, out)
    hf = current_config(model.config.hf, str(dtype).removeprefix("torch."))
    atomic_write_text(out / "config.json", json.dumps(hf, indent=2, sort_keys=True))
    folder = getattr(model, "checkpoint_path", None)
    source = Path(folder) if folder is not None and Path(folder).is_dir() else None
    gen = generation_config(model.config.hf, source, tokenizer)
    atomic_write_text(out / "generation_config.json", json.dumps(gen, indent=2) + "\n")
    if weight_map(model.config).layouts:
        copy_processor_files(model, out)
    return out


def copy_processor_files(model: Any, out: Path) -> None:
    """The checkpoint's image-processor files (PROCESSOR_FILES), copied into `out`."""
    folder = getattr(model, "checkpoint_path", None)
    for name in PROCESSOR_FILES if folder is not None else ():
        src = Path(folder) / name
        if src.is_file() and src.resolve() != (out / name).resolve():
            atomic_write_text(out / name, src.read_text())


def write_tensors(state: dict[str, torch.Tensor], out: Path) -> None:
    """`state` as model.safetensors, or shards with their index past SHARD_BYTES (atomic)."""
    shards = _shard(state)
    if len(shards) == 1:
        _atomic_save(shards[0], out / "model.safetensors")
        return
    file_of = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _atomic_save(shard, out / fname)
        file_of.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": file_of}
    atomic_write_text(out / "model.safetensors.index.json", json.dumps(index, indent=2))


def _save_generic(model, out: Path) -> Path:
    """transformers' save_pretrained for a model of its modeling code (models/generic.py)."""
    from slipstream.models import generic

    lora = [n for n, _ in model.named_parameters() if "lora_" in n]
    if lora:
        raise ValueError(
            f"save_model: the model still has LoRA layers ({lora[0]}); "
            "use export_merged() (or merge_lora) to fold them in first."
        )
    generic.save(model, out)
    copy_processor_files(model, out)  # an image-text model's: a complete checkpoint
    return out


def _shard(state: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous().cpu()
        size += nbytes
    return shards


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
