"""Where a run computes and in which dtype: `resolve_device` (train.device, generate's
--device) and `choose_dtype` (model.dtype; auto picks by device and CPU, slipstream/cpu.py)."""

from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"train.device: unknown device '{name}' (auto, cpu, cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"train.device={name} but no CUDA device is available; use auto or cpu")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    return choose_dtype(name, device)[0]


def choose_dtype(name: str, device: torch.device) -> tuple[torch.dtype, str]:
    """(dtype, why) for model.dtype `name`. auto: bf16 on accelerators, and on CPUs with a
    native bf16 matrix unit (slipstream/cpu.py); float32 on other CPUs, where bf16 is emulated
    and slower. The precision rules are the same in both: float32 LoRA factors and optimizer
    states, float32 norms and cross-entropy (peft/lora.py, models/common.py, ops/loss.py)."""
    if name != "auto":
        return getattr(torch, name), "model.dtype"
    if device.type != "cpu":
        return torch.bfloat16, f"auto on {device.type}"
    from slipstream.cpu import bf16_unit

    unit = bf16_unit()
    if unit is None:
        return torch.float32, "auto: this CPU has no native bf16 unit (AMX or AVX512-BF16)"
    return torch.bfloat16, f"auto: this CPU has {unit}"
