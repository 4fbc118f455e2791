"""PEFT's adapter files: `save_adapter` writes, `load_adapter` reads, `adapter_config.json` +
`adapter_model.safetensors`, so `peft.PeftModel.from_pretrained` loads ours and PEFT's load here.

Keys and `target_modules` are PEFT's names (peft/names.py); expert LoRA goes under PEFT's
`target_parameters` (peft/lora_experts.py). A regex `target_modules` in an adapter we load is
full-matched on transformers' path of each of our linears, as peft does.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from slipstream.checkpoint.atomic import atomic_write
from slipstream.models import weight_map
from slipstream.models.moe_block import moe_blocks
from slipstream.peft.lora import (
    check_hyperparameters,
    linear_children,
    linear_names,
    lora_modules,
    wrap_lora,
)
from slipstream.peft.lora_experts import (
    expert_lora_factors,
    expert_lora_tensors,
    load_expert_lora_tensors,
)
from slipstream.peft.names import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    PEFT_PREFIX,
    adapter_key,
    expert_targets,
    model_layout,
    peft_path,
    target_modules,
)
from slipstream.sources import SOURCE_KEY


def _lora_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """PEFT key -> parameter for the factors (and DoRA magnitudes) of the wrapped linears."""
    found = {}
    layout = model_layout(model)
    for name, module in lora_modules(model).items():
        key = adapter_key(peft_path(name, layout))
        found[f"{key}.lora_A.weight"] = module.lora_A.weight
        found[f"{key}.lora_B.weight"] = module.lora_B.weight
        magnitude = getattr(module, "lora_magnitude_vector", None)
        if magnitude is not None:
            found[f"{key}.lora_magnitude_vector"] = magnitude
    return found


def save_adapter(
    model: nn.Module, dir: str | os.PathLike, base_model_name_or_path: str | None = None
) -> Path:
    """Write adapter_config.json + adapter_model.safetensors in PEFT's layout; returns dir.

    The base recorded is `base_model_name_or_path`, else the one `load_model` noted: the hub
    id when one is known (a GGUF file's source checkpoint), so peft loads it; where slipstream
    loaded it from (a built-in name, a .gguf path) goes in the weights file's metadata under
    `slipstream.base_model`, read back by `slipstream.sources.adapter_base`."""
    cfg = getattr(model, "lora_config", None)
    if cfg is None:
        raise ValueError("save_adapter: the model has no LoRA; call apply_lora(model) first")
    out = Path(dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create adapter dir {out}: {e.strerror}") from None
    tensors = {k: p.detach().cpu().contiguous() for k, p in _lora_tensors(model).items()}
    if cfg.get("target_parameters"):
        tensors.update(expert_lora_tensors(model))
    unwrapped = [name for name, *_ in linear_children(model)]
    if base_model_name_or_path is None:
        base_model_name_or_path = getattr(model, "name_or_path", None) or None
    metadata = {"format": "pt"}
    source = getattr(model, "source", None)
    if source and source != base_model_name_or_path:
        metadata[SOURCE_KEY] = str(source)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": cfg["r"],
        "lora_alpha": cfg["lora_alpha"],
        "lora_dropout": cfg["lora_dropout"],
        "target_modules": target_modules(
            cfg["target_modules"], list(lora_modules(model)), unwrapped, model_layout(model)
        ),
        "use_rslora": cfg["use_rslora"],
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "use_dora": bool(cfg.get("use_dora", False)),
        "revision": None,
    }
    if cfg.get("target_parameters"):  # only then: older PEFT versions lack the key
        config["target_parameters"] = cfg["target_parameters"]
    try:
        atomic_write(out / ADAPTER_WEIGHTS, lambda p: save_file(tensors, p, metadata=metadata))
        text = json.dumps(config, indent=2) + "\n"
        atomic_write(out / ADAPTER_CONFIG, lambda p: Path(p).write_text(text))
    except OSError as e:
        raise ValueError(f"cannot write adapter to {out}: {e.strerror}") from None
    return out


def tokenizer_source(adapter: Path, base: str) -> str:
    """The trainer saves the tokenizer beside the adapter; otherwise take the base model's."""
    return str(adapter) if any(adapter.glob("tokenizer*")) else base


def _read_adapter_config(path: Path) -> dict:
    if not path.is_file():
        raise ValueError(f"{path} not found: not a PEFT adapter directory")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type {cfg['peft_type']!r} is not supported; only LORA")
    unsupported = {
        "bias": "none",
        "fan_in_fan_out": False,
        "rank_pattern": {},
        "alpha_pattern": {},
        "layers_to_transform": None,
        "modules_to_save": None,
        "lora_bias": False,
    }
    for key, ok in unsupported.items():
        if cfg.get(key, ok) not in (ok, None, [], {}):
            raise ValueError(f"{path}: {key}={cfg[key]!r} is not supported (need {ok!r})")
    targets = cfg.get("target_modules")
    if isinstance(targets, str) and targets != "all-linear":
        try:
            re.compile(targets)
        except re.error as e:
            raise ValueError(f"{path}: target_modules {targets!r} is no valid regex: {e}") from None
    if cfg.get("exclude_modules"):
        raise ValueError(f"{path}: exclude_modules={cfg['exclude_modules']!r} is not supported")
    return cfg


def load_adapter(model: nn.Module, dir: str | os.PathLike) -> nn.Module:
    """Load a PEFT LoRA adapter (ours or PEFT's) into `model`, applying LoRA first if needed.
    Expert factors (`target_parameters` on a MoE model) load in the same pass."""
    src = Path(dir)
    _apply_adapter_config(model, _read_adapter_config(src / ADAPTER_CONFIG), src)
    weights_path = src / ADAPTER_WEIGHTS
    if not weights_path.is_file():
        raise ValueError(f"{weights_path} not found: the adapter has no weights")
    tensors = load_file(weights_path)
    expected = _lora_tensors(model)
    has_experts = bool(model.lora_config.get("target_parameters"))
    expert_keys = set(expert_lora_factors(model)) if has_experts else set()
    for key in tensors:
        if key not in expected and key not in expert_keys:
            _unexpected_key(model, key, weights_path)
    with torch.no_grad():
        for key, param in expected.items():
            if key not in tensors:
                raise ValueError(f"{weights_path}: missing tensor {key}")
            if tensors[key].shape != param.shape:
                raise ValueError(
                    f"{weights_path}: tensor {key} has shape {tuple(tensors[key].shape)}, "
                    f"the model expects {tuple(param.shape)}"
                )
            param.copy_(tensors[key])
    if has_experts:
        load_expert_lora_tensors(model, tensors, weights_path)
    return model


def _apply_adapter_config(model: nn.Module, cfg: dict, src: Path) -> None:
    """Wrap `model` as the adapter config says, or check that its LoRA is the same."""
    source = src / ADAPTER_CONFIG
    rank, alpha = int(cfg["r"]), cfg["lora_alpha"]
    use_rslora = bool(cfg.get("use_rslora", False))
    use_dora = bool(cfg.get("use_dora", False))
    experts = _expert_targets(cfg, source, model)
    current = getattr(model, "lora_config", None)
    if current is not None:
        have = (current["r"], current["lora_alpha"], current["use_rslora"], current.get("use_dora"))
        if have != (rank, alpha, use_rslora, use_dora):
            raise ValueError(
                f"{src}: adapter has r={rank}, lora_alpha={alpha}, use_rslora={use_rslora}, "
                f"use_dora={use_dora} but the model's LoRA has r={have[0]}, "
                f"lora_alpha={have[1]}, use_rslora={have[2]}, use_dora={have[3]}"
            )
        return
    dropout = cfg.get("lora_dropout") or 0.0
    check_hyperparameters(rank, alpha, dropout, str(source), experts=bool(experts))
    linear = _linear_targets(cfg.get("target_modules") or [], model, source)
    wrap_lora(model, rank, alpha, dropout, linear, experts, use_rslora, use_dora)


def _linear_targets(targets: list[str] | str, model: nn.Module, source: Path):
    """`target_modules` as `wrap_lora` takes them: "all-linear", a compiled regex or a set."""
    if isinstance(targets, str):
        return targets if targets == "all-linear" else re.compile(targets)
    present = linear_names(model)
    missing = sorted(set(targets) - present)
    if missing:
        raise ValueError(
            f"{source}: target_modules {missing} match no nn.Linear in "
            f"the model; linear module names present: {sorted(present)}"
        )
    return set(targets)


def _unexpected_key(model: nn.Module, key: str, source: Path) -> None:
    cfg = getattr(model, "config", None)
    path = key.removeprefix(PEFT_PREFIX)
    if model_layout(model) and weight_map(cfg).is_passthrough(path):
        raise ValueError(
            f"{source}: tensor {key} is LoRA on the vision side, which slipstream does not "
            "train (only the language model); make the adapter with a target_modules regex "
            r"that only matches the language model, e.g. 'model\.language_model\..*\.q_proj'"
        )
    raise ValueError(f"{source}: tensor {key} matches no LoRA module in the model")


def _expert_targets(cfg: dict, source: Path, model: nn.Module) -> list[str]:
    """The expert parameters an adapter's `target_parameters` names (PEFT's MoE layout)."""
    params = cfg.get("target_parameters") or []
    if isinstance(params, str):
        params = [params]
    names = expert_targets(params)
    if names is None:
        raise ValueError(
            f"{source}: target_parameters {params} are not supported; "
            "use mlp.experts.gate_up_proj and/or mlp.experts.down_proj"
        )
    if names and not moe_blocks(model):
        raise ValueError(f"{source}: target_parameters {params} need a MoE model (no MoE layers)")
    return names
