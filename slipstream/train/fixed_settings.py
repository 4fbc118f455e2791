"""Settings a run cannot change: those a resumed checkpoint was trained with, and those a
starting adapter (`model.adapter`) brings with it.

A resume with another LoRA shape used to fail deep in the weight copy (`The size of tensor a
(8) must match ... (16)`); it is now one line naming each key, checked from the config the
checkpoint saved before any weights load. An adapter's own r, alpha, targets and dropout
win over `lora`'s (its weights have that shape); a value the user set that it overrides is
said once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from slipstream import distributed as dist
from slipstream.config import RunConfig, moved_keys
from slipstream.train.state import read_state

# What shapes the trained weights or the optimizer's parameter groups. With a starting
# adapter the lora shape keys are the adapter's, so only the adapter itself must match.
ALWAYS = ("model.adapter", "train.finetune", "train.optimizer")
LORA_SHAPE = ("lora.rank", "lora.alpha", "lora.targets", "lora.use_rslora", "lora.use_dora")
LORA_GROUPS = ("lora.plus_ratio",)  # LoRA+ puts the B factors in a group of their own


def resume_keys(config: dict[str, Any]) -> tuple[str, ...]:
    lora = config["train"]["finetune"] == "lora"
    adapter = config["model"].get("adapter") is not None
    return ALWAYS + (LORA_GROUPS if lora else ()) + (LORA_SHAPE if lora and not adapter else ())


def value(config: dict[str, Any], key: str) -> Any:
    section, name = key.split(".")
    found = config.get(section, {}).get(name)
    return sorted(found) if isinstance(found, list) else found


def check_resume_settings(cfg: RunConfig, checkpoint: Path) -> None:
    """One line (ValueError) naming every key whose value differs from the checkpoint's run;
    checkpoints written before the config was saved in them are not checked."""
    saved = read_state(checkpoint, mmap=True)["extra"].get("config")
    if saved is None:
        return
    saved = moved_keys(saved, say=False)  # a checkpoint from before a key moved
    now = cfg.model_dump(mode="json")
    differ = [
        f"{key}: {value(saved, key)!r} in the checkpoint, {value(now, key)!r} now"
        for key in resume_keys(saved)
        if value(saved, key) != value(now, key)
    ]
    if differ:
        raise ValueError(
            f"resume: checkpoint {checkpoint} was trained with other settings "
            f"({'; '.join(differ)}); set them back to resume it, or resume=false to start "
            "over (in another output_dir to keep this run)"
        )


# lora key -> (adapter_config.json key, default when absent)
ADAPTER_KEYS = {
    "rank": ("r", None), "alpha": ("lora_alpha", None), "dropout": ("lora_dropout", 0.0),
    "targets": ("target_modules", None), "use_rslora": ("use_rslora", False),
    "use_dora": ("use_dora", False),
}  # fmt: skip


def adapter_overrides(cfg: RunConfig, adapter: Path) -> list[str]:
    """`lora.KEY=VALUE (the adapter's KEY=VALUE)` for each lora value the user set that the
    starting adapter replaces; empty for full fine-tuning (the adapter is merged)."""
    if cfg.train.finetune != "lora":
        return []
    saved = json.loads((adapter / "adapter_config.json").read_text())
    found = []
    for key in sorted(cfg.lora.model_fields_set & ADAPTER_KEYS.keys()):
        theirs, default = ADAPTER_KEYS[key]
        mine, its = getattr(cfg.lora, key), saved.get(theirs, default)
        same_list = isinstance(mine, list) and isinstance(its, list) and sorted(mine) == sorted(its)
        if mine != its and not same_list:
            found.append(f"lora.{key}={mine!r} (the adapter's {theirs}={its!r})")
    return found


def say_adapter_overrides(cfg: RunConfig, adapter: Path) -> None:
    found = adapter_overrides(cfg, adapter)
    if found:
        dist.print_main(
            f"slipstream: model.adapter {adapter} trains with its own LoRA settings, not "
            f"these from the config: {', '.join(found)}"
        )
