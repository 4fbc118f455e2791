"""Which parts of an image-text model train: `vision.tower` / `vision.projector` (frozen |
lora | full) applied around LoRA, by `train/setup.py`'s `build_model` and the memory probe's
meta model (memory/probe.py) alike."""

from __future__ import annotations

from typing import Any

import torch


def vision_training(model: Any, vision: Any, finetune: str, before_lora: bool) -> None:
    """`vision.tower` / `vision.projector` of an image-text model: before LoRA, which parts
    LoRA may wrap (lora: yes); after, under full fine-tuning, which parts train (frozen: no).
    `full` beside LoRA (peft's modules_to_save of the tower) is not supported yet."""
    parts = getattr(model, "vision", None) or {}  # {part: module path}: image-text models
    modes = {"tower": vision.tower, "projector": vision.projector}
    asked = {part: mode for part, mode in modes.items() if mode != "frozen"}
    if not parts and asked:
        raise ValueError(
            f"vision.{next(iter(asked))}={next(iter(asked.values()))}: this model has no "
            "vision side; drop the vision settings"
        )
    for part, mode in asked.items():
        if (mode == "lora") != (finetune == "lora"):
            raise ValueError(
                f"vision.{part}={mode} with train.finetune={finetune} is not supported: use "
                f"vision.{part}={'lora' if finetune == 'lora' else 'full'} or frozen"
            )
    if before_lora:
        model.no_lora_prefixes = tuple(f"{parts[p]}." for p in parts if modes[p] != "lora")
    elif finetune == "full":
        for part, path in parts.items():
            model.get_submodule(path).requires_grad_(modes[part] == "full")
    else:
        _check_vision_lora(model, parts, asked)


def _check_vision_lora(model: Any, parts: dict[str, str], asked: dict[str, str]) -> None:
    """A one-line error when `vision.<part>: lora` wrapped none of that part's linears (the
    lora targets name none of them: Gemma 4's tower calls its linears `linear`)."""
    from slipstream.peft.lora import lora_modules

    wrapped = list(lora_modules(model))
    for part in (p for p, mode in asked.items() if mode == "lora"):
        prefix = f"{parts[part]}."
        if any(n.startswith(prefix) for n in wrapped):
            continue
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                        if n.startswith(prefix) and isinstance(m, torch.nn.Linear)})  # fmt: skip
        raise ValueError(
            f"vision.{part}=lora, but lora.targets name none of its linear layers "
            f"({', '.join(names) or 'none'}): add them to lora.targets or use all-linear"
        )
