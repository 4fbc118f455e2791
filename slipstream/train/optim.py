"""AdamW over the trainable parameters and the learning-rate schedule.

AdamW is fused on CUDA (one kernel for the whole update instead of a few per parameter) and
uses the foreach implementation elsewhere. Weight decay applies to matrices only: norms and
biases (1-D parameters) are not decayed. The schedule is linear warmup from 0 to the peak
learning rate, then linear or cosine decay to 0 (or constant), as a `LambdaLR` so its state
is a single step counter that a checkpoint restores exactly.

`adamw_8bit` is bitsandbytes' block-wise 8-bit AdamW: both moments in uint8 with a float32
scale per 256-value block, 2 bytes a parameter instead of 8 (float32 states) or 4 (bf16
states), which is what full fine-tuning on one GPU runs out of first (Llama-3-8B: 16 GB of
states instead of 32 in bf16). Tensors under 4,096 values keep 32-bit states (bitsandbytes'
default). LoRA's states are small either way (rank 16 on Llama-3-8B: 42M parameters).

`lora_plus_ratio` (LoRA+, Hayou et al. 2024) gives the LoRA B factors that multiple of the
learning rate: B starts at zero and, at one shared lr, learns too slowly for A's scale (the
paper suggests 16; peft's `loraplus_lr_ratio`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def build_optimizer(
    named_params: Iterable[tuple[str, torch.nn.Parameter]],
    *,
    lr: float,
    weight_decay: float,
    device: torch.device,
    betas: tuple[float, float] = (0.9, 0.999),
    kind: str = "adamw",
    lora_plus_ratio: float | None = None,
) -> torch.optim.Optimizer:
    """AdamW (`kind`: adamw | adamw_8bit) over the parameters that require grad; no decay on
    1-D parameters; LoRA B factors at `lora_plus_ratio` x lr when given. The first group is
    the one at `lr` (the trainer logs its rate)."""
    decay, no_decay, lora_b = [], [], []
    for name, p in named_params:
        if not p.requires_grad:
            continue
        if lora_plus_ratio is not None and name.endswith("lora_B.weight"):
            lora_b.append(p)
        else:
            (decay if p.ndim >= 2 else no_decay).append(p)
    if not decay and not no_decay and not lora_b:
        raise ValueError("nothing to train: no parameter requires grad (check lora.targets)")
    if lora_plus_ratio is not None and not lora_b:
        raise ValueError("lora.plus_ratio is set but the model has no LoRA B factors to speed up")
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if lora_b:
        groups.append({"params": lora_b, "weight_decay": weight_decay, "lr": lr * lora_plus_ratio})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    if kind == "adamw_8bit":
        from slipstream.peft.qlora import require_bitsandbytes

        bnb = require_bitsandbytes("train.optimizer=adamw_8bit")
        return bnb.optim.AdamW8bit(groups, lr=lr, betas=betas)
    if kind != "adamw":
        raise ValueError(f"train.optimizer: unknown optimizer '{kind}' (adamw, adamw_8bit)")
    kwargs = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(groups, lr=lr, betas=betas, **kwargs)


def warmup_steps_for(warmup: int | float, total_steps: int) -> int:
    """`train.warmup_steps` in steps: a whole number as is, a fraction < 1 of `total_steps`
    rounded down (transformers rounds up: on a 5-step run, 0.05 would halve the first step's
    lr, which is what a short try of a long config should not do)."""
    return int(warmup) if warmup >= 1 else int(warmup * total_steps)


def lr_factor(step: int, *, schedule: str, warmup_steps: int, total_steps: int) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return 1.0
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if schedule == "linear":
        return 1.0 - progress
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"train.schedule: unknown schedule '{schedule}' (linear, cosine, constant)")


def build_schedule(
    optimizer: torch.optim.Optimizer, *, schedule: str, warmup_steps: int, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(step: int) -> float:
        return lr_factor(
            step, schedule=schedule, warmup_steps=warmup_steps, total_steps=total_steps
        )

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
