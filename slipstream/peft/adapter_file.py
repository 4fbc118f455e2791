"""PEFT's adapter files: `save_adapter` writes, `load_adapter` reads, `adapter_config.json` +
`adapter_model.safetensors`, so `peft.PeftModel.from_pretrained` loads ours and PEFT's load here.

Keys are `base_model.model.<transformers' module path>.lora_A.weight` / `.lora_B.weight`
(`.lora_magnitude_vector` for DoRA; expert LoRA under PEFT's `target_parameters`, see
lora_experts.py). `target_modules` is the list of short names, or, where peft would wrap more
with them on transformers' model (the vision tower of a multimodal Gemma 3, or same-named
linears left unwrapped), a regex of exactly the wrapped paths; a regex in an adapter we load
is matched by the same rule (lora.py's module docstring).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from slipstream.checkpoint.atomic import atomic_write
from slipstream.peft.lora import (
    _EXPERT_TARGET_OF,
    _PEFT_PREFIX,
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    _adapter_tensors,
    _has_moe_blocks,
    _hf_layout,
    _linear_children,
    _linear_names,
    _peft_path,
    _wrap,
    lora_modules,
)


def _saved_targets(model: nn.Module, names: list[str]) -> list[str] | str:
    """`target_modules` for adapter_config.json: the short names, unless peft would wrap more
    with them on transformers' model (a module tree that holds more than ours, or some
    same-named linears left unwrapped); then a regex of exactly the wrapped paths."""
    layout = _hf_layout(model)
    left = [_peft_path(name, layout) for name, *_ in _linear_children(model)]
    if not layout and not {p.rsplit(".", 1)[-1] for p in left} & set(names):
        return names
    wrapped = [_peft_path(n, layout) for n in lora_modules(model)]
    regex = _paths_regex(wrapped)
    if any(re.fullmatch(regex, p) for p in left):  # some layers were left out: list them all
        regex = "|".join(re.escape(p) for p in wrapped)
    return regex


def _paths_regex(paths: Iterable[str]) -> str:
    """A regex full-matching these module paths at any layer number: one alternative per
    parent path, its last names grouped."""
    groups: dict[str, set[str]] = {}
    for path in paths:
        parts = [r"\d+" if p.isdigit() else re.escape(p) for p in path.split(".")]
        groups.setdefault(r"\.".join(parts[:-1]), set()).add(parts[-1])
    alternatives = []
    for parent, last in sorted(groups.items()):
        tail = next(iter(last)) if len(last) == 1 else f"(?:{'|'.join(sorted(last))})"
        alternatives.append(rf"{parent}\.{tail}" if parent else tail)
    return "|".join(alternatives)


def save_adapter(
    model: nn.Module, dir: str | os.PathLike, base_model_name_or_path: str | None = None
) -> Path:
    """Write adapter_config.json + adapter_model.safetensors in PEFT's layout; returns dir."""
    cfg = getattr(model, "lora_config", None)
    if cfg is None:
        raise ValueError("save_adapter: the model has no LoRA; call apply_lora(model) first")
    out = Path(dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create adapter dir {out}: {e.strerror}") from None
    tensors = {k: p.detach().cpu().contiguous() for k, p in _adapter_tensors(model).items()}
    if cfg.get("target_parameters"):
        from slipstream.peft.lora_experts import expert_lora_tensors

        tensors.update(expert_lora_tensors(model))
    if base_model_name_or_path is None:
        base_model_name_or_path = getattr(model, "name_or_path", None) or None
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": cfg["r"],
        "lora_alpha": cfg["lora_alpha"],
        "lora_dropout": cfg["lora_dropout"],
        "target_modules": _saved_targets(model, cfg["target_modules"]),
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
        atomic_write(
            out / ADAPTER_WEIGHTS, lambda p: save_file(tensors, p, metadata={"format": "pt"})
        )
        text = json.dumps(config, indent=2) + "\n"
        atomic_write(out / ADAPTER_CONFIG, lambda p: Path(p).write_text(text))
    except OSError as e:
        raise ValueError(f"cannot write adapter to {out}: {e.strerror}") from None
    return out


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
    cfg = _read_adapter_config(src / ADAPTER_CONFIG)
    rank, alpha = int(cfg["r"]), cfg["lora_alpha"]
    use_rslora = bool(cfg.get("use_rslora", False))
    use_dora = bool(cfg.get("use_dora", False))
    experts = _expert_targets(cfg, src / ADAPTER_CONFIG, model)
    current = getattr(model, "lora_config", None)
    if current is None:
        _check_hyper(rank, alpha, cfg.get("lora_dropout") or 0.0, src / ADAPTER_CONFIG)
        linear = cfg.get("target_modules") or []
        if isinstance(linear, str) and linear != "all-linear":
            linear = re.compile(linear)
        elif linear != "all-linear":
            present = _linear_names(model)
            missing = sorted(set(linear) - present)
            if missing:
                raise ValueError(
                    f"{src / ADAPTER_CONFIG}: target_modules {missing} match no nn.Linear in "
                    f"the model; linear module names present: {sorted(present)}"
                )
            linear = set(linear)
        dropout = cfg.get("lora_dropout") or 0.0
        if experts and dropout > 0:
            raise ValueError(
                f"{src / ADAPTER_CONFIG}: lora_dropout={dropout} with target_parameters is not "
                "supported (PEFT has no dropout on parameters); set it to 0"
            )
        _wrap(model, rank, alpha, dropout, linear, experts, use_rslora, use_dora)
    else:
        have = (current["r"], current["lora_alpha"], current["use_rslora"], current.get("use_dora"))
        if have != (rank, alpha, use_rslora, use_dora):
            raise ValueError(
                f"{src}: adapter has r={rank}, lora_alpha={alpha}, use_rslora={use_rslora}, "
                f"use_dora={use_dora} but the model's LoRA has r={have[0]}, "
                f"lora_alpha={have[1]}, use_rslora={have[2]}, use_dora={have[3]}"
            )
    weights_path = src / ADAPTER_WEIGHTS
    if not weights_path.is_file():
        raise ValueError(f"{weights_path} not found: the adapter has no weights")
    tensors = load_file(weights_path)
    expected = _adapter_tensors(model)
    expert_keys = set()
    if (getattr(model, "lora_config", None) or {}).get("target_parameters"):
        from slipstream.peft.lora_experts import expert_lora_keys, load_expert_lora_tensors

        expert_keys = expert_lora_keys(model)
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
    if expert_keys:
        load_expert_lora_tensors(
            model, {k: tensors[k] for k in expert_keys & set(tensors)}, weights_path
        )
    return model


def _unexpected_key(model: nn.Module, key: str, source: Path) -> None:
    from slipstream.checkpoint.hf import hf_layouts
    from slipstream.models import family_for

    cfg = getattr(model, "config", None)
    path = key.removeprefix(_PEFT_PREFIX)
    if hf_layouts(cfg) and family_for(cfg.model_type).is_passthrough(cfg, path):
        raise ValueError(
            f"{source}: tensor {key} is LoRA on the vision side, which slipstream does not "
            "train (only the language model); make the adapter with a target_modules regex "
            r"that only matches the language model, e.g. 'model\.language_model\..*\.q_proj'"
        )
    raise ValueError(f"{source}: tensor {key} matches no LoRA module in the model")


def _check_hyper(rank: Any, alpha: Any, dropout: Any, source: Path) -> None:
    if not (isinstance(rank, int) and rank > 0) or not alpha > 0 or not 0 <= dropout < 1:
        raise ValueError(
            f"{source}: r={rank!r}, lora_alpha={alpha!r}, lora_dropout={dropout!r}; need "
            "r a positive integer, lora_alpha > 0 and lora_dropout in [0, 1)"
        )


def _expert_targets(cfg: dict, source: Path, model: nn.Module) -> list[str]:
    """The expert parameters an adapter's `target_parameters` names (PEFT's MoE layout)."""
    params = cfg.get("target_parameters") or []
    if isinstance(params, str):
        params = [params]
    names = [p.rpartition(".")[2] for p in params]
    if any(not p.endswith(f"mlp.experts.{n}") for p, n in zip(params, names, strict=True)) or (
        set(names) - set(_EXPERT_TARGET_OF.values())
    ):
        raise ValueError(
            f"{source}: target_parameters {params} are not supported; "
            "use mlp.experts.gate_up_proj and/or mlp.experts.down_proj"
        )
    if names and not _has_moe_blocks(model):
        raise ValueError(f"{source}: target_parameters {params} need a MoE model (no MoE layers)")
    return sorted(set(names))
