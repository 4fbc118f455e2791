"""LoRA gradients under peft's keys and layouts, to compare with a `PeftModel`'s."""

from __future__ import annotations

import torch
from torch import nn


def lora_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every LoRA factor's gradient keyed as peft names it (`base_model.model.<transformers'
    module path>...`),
    stacked expert factors in peft's `target_parameters` layout (peft/lora_experts.py)."""
    from slipstream.peft.lora_experts import expert_lora_factors
    from slipstream.peft.names import adapter_key, model_layout, peft_path

    experts = expert_lora_factors(model)
    stacked = {id(p) for p, _ in experts.values()}
    layout = model_layout(model)  # a native multimodal family's names -> transformers' tree
    out = {
        adapter_key(peft_path(n, layout)): p.grad
        for n, p in model.named_parameters()
        if "lora_" in n and id(p) not in stacked
    }
    for key, (p, part) in experts.items():  # A (E, r, in) -> (E*r, in); B (E, out, r) -> (out, r*E)
        out[key] = p.grad.flatten(0, 1) if part == "A" else p.grad.permute(1, 2, 0).flatten(1)
    return out
