"""`LoRALinear`: a frozen base linear layer plus a trainable low-rank update (the module
itself; applying, wrapping and merging: peft/lora.py, whose docstring gives the maths and
the factor dtype). DoRA (peft/dora.py) subclasses it; expert LoRA (peft/lora_experts.py)
shares its factor dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def lora_factor_dtype(base_weight: torch.Tensor) -> torch.dtype:
    """float32 for a fp16/bf16 or quantized (packed integer) base; float64 stays float64."""
    if base_weight.is_floating_point() and base_weight.element_size() >= 4:
        return base_weight.dtype
    return torch.float32


class LoRALinear(nn.Module):
    """A frozen base linear layer plus a trainable low-rank update; factors in `dtype`
    (default `lora_factor_dtype(base weight)`: float32 for a half-precision base)."""

    def __init__(
        self,
        base_layer: nn.Module,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        use_rslora: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.in_features, self.out_features = base_layer.in_features, base_layer.out_features
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / math.sqrt(rank) if use_rslora else alpha / rank
        weight = base_layer.weight
        if dtype is None:
            dtype = lora_factor_dtype(weight)
        kw = {"device": weight.device, "dtype": dtype}
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, **kw)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, **kw)
        self.reset_lora_parameters()

    def reset_lora_parameters(self) -> None:
        # As PEFT: A like nn.Linear's default init, B zero so the start equals the base.
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    @property
    def weight(self) -> torch.Tensor:
        """The base weight, for code that reads `proj.weight` (dtype, device, shape)."""
        return self.base_layer.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        # The factors come down to x's dtype, not x up to theirs: bf16 matmuls, fp32 masters.
        A, B = self.lora_A.weight.to(x.dtype), self.lora_B.weight.to(x.dtype)
        h = F.linear(self.lora_dropout(x), A)
        if out.dtype == h.dtype and h.element_size() >= 4:
            # out + scale * h @ B.T in one addmm: the separate scale and add were two more
            # passes over the (T, out_features) output, forward and backward (~7% of a CPU
            # SmolLM2 LoRA step, profiled). Not in half precision: there the delta is rounded
            # before the add, as PEFT does (one addmm would round once, differing from it).
            y = torch.addmm(out.reshape(-1, out.shape[-1]), h.reshape(-1, h.shape[-1]), B.t(),
                            alpha=self.scaling)  # fmt: skip
            return y.view(out.shape)
        return out + (F.linear(h, B) * self.scaling).to(out.dtype)

    def merged_weight(self) -> torch.Tensor:
        """base weight + scale * B @ A, computed in float32, in the base weight's dtype."""
        w = self.base_layer.weight
        delta = self.lora_B.weight.float() @ self.lora_A.weight.float()
        return (w.float() + self.scaling * delta).to(w.dtype)

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha}, scaling={self.scaling:g}"


class LoRAHead(LoRALinear):
    """LoRA on the LM head: `.weight` is the effective matrix W + s B A, differentiable in
    the factors, which `lm_head_weight()` and so the chunked loss, log-probs, the JSD and
    generation read (they never call the head as a module). No dropout: it would act on the
    head's input, which those paths do not see."""

    @property
    def weight(self) -> torch.Tensor:
        w = self.base_layer.weight
        delta = self.lora_B.weight @ self.lora_A.weight
        return w + (self.scaling * delta).to(w.dtype)


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """Module path -> LoRALinear, in model order."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}
