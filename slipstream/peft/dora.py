"""DoRA (Liu et al. 2024, "Weight-Decomposed Low-Rank Adaptation"): LoRA whose adapted
weight is rescaled row by row to a trained magnitude,

    W' = m * (W + s·B·A) / ‖W + s·B·A‖_row,   m: (out,) trained, initialised to ‖W‖_row,

with the row norm treated as a constant in backward (the paper's section 4.3; PEFT does the
same), so a forward is

    y = base(x) + (m/‖·‖ - 1) * (x Wᵀ) + (m/‖·‖) * s·B·A·x.

PEFT's layout: `lora_magnitude_vector` beside `lora_A` / `lora_B`, `use_dora: true`.

Row norms without forming W + s·B·A (PEFT builds that out×in matrix in every forward of every
layer: 117 M values for a Llama-3-8B MLP projection). W is frozen, so

    ‖W_i + s·(BA)_i‖² = ‖W_i‖² + 2s·B_i·(W Aᵀ)_i + s²·B_i (A Aᵀ) B_iᵀ:

‖W_i‖² is computed once, W Aᵀ is the base layer applied to A's r rows (an NF4 base needs no
dequantised copy), and the rest is r×r work.
Shapes: T tokens, I in_features, O out_features, r rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.peft.lora_linear import LoRALinear


def dense_weight(base_layer: nn.Module) -> torch.Tensor:
    """The base weight (O, I) as a float32 matrix (dequantised from NF4 if needed)."""
    w = base_layer.weight
    if w.is_floating_point():
        return w.detach().float()
    from slipstream.peft.qlora import dequantize_weight

    return dequantize_weight(base_layer).float()


class DoRALinear(LoRALinear):
    """LoRALinear plus a trained magnitude per output row (module docstring)."""

    def __init__(self, base_layer: nn.Module, *args, **kwargs) -> None:
        super().__init__(base_layer, *args, **kwargs)
        w_OI = dense_weight(base_layer)
        # ‖W_i‖², fixed with the base: once here instead of in every forward.
        self.register_buffer("base_norm_sq", w_OI.pow(2).sum(1), persistent=False)
        magnitude = self.base_norm_sq.sqrt().to(self.lora_A.weight.dtype)
        self.lora_magnitude_vector = nn.Parameter(magnitude)

    @torch.no_grad()
    def row_norm(self, dtype: torch.dtype) -> torch.Tensor:
        """(O,) float32 ‖W + s·B·A‖ per row, from ‖W‖², W Aᵀ and A Aᵀ (module docstring)."""
        A_rI, B_Or = self.lora_A.weight.float(), self.lora_B.weight.float()
        wa_Or = self.base_layer(A_rI.to(dtype)).float().T
        if self.base_layer.bias is not None:
            wa_Or = wa_Or - self.base_layer.bias.float()[:, None]
        s = self.scaling
        cross_O = (B_Or * wa_Or).sum(1)
        delta_O = ((B_Or @ (A_rI @ A_rI.T)) * B_Or).sum(1)
        return (self.base_norm_sq + 2 * s * cross_O + s * s * delta_O).clamp_min(0).sqrt()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        A, B = self.lora_A.weight.to(x.dtype), self.lora_B.weight.to(x.dtype)
        x_in = self.lora_dropout(x)
        lora = F.linear(F.linear(x_in, A), B) * self.scaling
        # m / ‖W + sBA‖: gradients reach m, not the norm (a constant, as in the paper).
        scale_O = (self.lora_magnitude_vector / self.row_norm(x.dtype)).to(out.dtype)
        # x Wᵀ without the bias; with dropout active PEFT takes it on the dropped x.
        dropped = self.training and not isinstance(self.lora_dropout, nn.Identity)
        base = self.base_layer(x_in) if dropped else out
        if self.base_layer.bias is not None:
            base = base - self.base_layer.bias
        return out + (scale_O - 1) * base + scale_O * lora.to(out.dtype)

    def merged_weight(self) -> torch.Tensor:
        """m * (W + s·B·A) / ‖W + s·B·A‖_row in float32, in the base weight's dtype."""
        w = self.base_layer.weight
        adapted = dense_weight(self.base_layer) + self.scaling * (
            self.lora_B.weight.float() @ self.lora_A.weight.float()
        )
        scale = self.lora_magnitude_vector.float() / adapted.norm(dim=1)
        return (scale[:, None] * adapted).to(w.dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", dora"
