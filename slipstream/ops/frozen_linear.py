"""Frozen linear layers packed once for oneDNN: `apply_prepacked_linears(model)` (CPU, float32).

With LoRA or QLoRA the base weights never change, yet every training step multiplies each of
them twice: forward x @ W.T and, in backward, the input gradient g @ W. torch's CPU float32
GEMM repacks W on each call (and on AMD runs without AVX-512: ops/onednn.py). Here each
frozen `nn.Linear` is packed once into oneDNN's blocked layout; forward multiplies with the
packed copy, backward with oneDNN on the plain weight's transposed view (as fast as a packed
transposed copy, measured, and it costs no memory). No weight gradient is ever needed.

What it touches: every `nn.Linear` (LoRA's `base_layer`s and the untargeted projections) whose
weight and bias are frozen, float32, plain CPU tensors (never an FSDP2 DTensor shard, never a
bitsandbytes NF4 base: that is not an `nn.Linear`), except the LM head (the loss reads its
weight directly). The packed copies take as much memory again as those weights, so nothing is
packed when that is more than half the free memory. bf16 weights are left alone: their GEMMs
already run on oneDNN kernels and packing measured no gain (ops/onednn.py).

The module's class becomes `PrepackedLinear` (an `nn.Linear`: names, state_dict, LoRA and
export unchanged). Each call checks that the weight is the one packed, unchanged (its version
counter: `merge_lora` writes into it), still frozen and plain; otherwise it repacks or falls
back to `F.linear`. Gradients equal `F.linear`'s up to float32 summation order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.ops import onednn

# The row count oneDNN is told to expect when packing (a training micro-batch's order);
# packed for 1,024 rows the GEMM ran equally fast at 512..4,096 rows (measured).
PACK_ROWS = 1024


class _FrozenLinear(torch.autograd.Function):
    """y = x @ W.T + b through the packed W; grad x = g @ W through oneDNN; W, b frozen."""

    @staticmethod
    def forward(ctx, x_MI, W_OI, packed, bias_O):
        ctx.save_for_backward(W_OI)  # the parameter itself: no copy
        return onednn.pointwise(x_MI, packed, bias_O)

    @staticmethod
    def backward(ctx, g_MO):
        (W_OI,) = ctx.saved_tensors
        return onednn.grad_input(g_MO.contiguous(), W_OI), None, None, None


def linear_frozen(x_MI: torch.Tensor, W_OI: torch.Tensor) -> torch.Tensor:
    """x @ W.T with autograd for x only, through oneDNN where it wins and W is frozen (an LM
    head under LoRA); F.linear otherwise (a trained W gets its gradient there)."""
    if W_OI.requires_grad or not onednn.wins(x_MI, W_OI):
        return F.linear(x_MI, W_OI)
    return _FrozenLinear.apply(x_MI, W_OI, W_OI, None)


def _frozen_plain_float32(m: nn.Linear) -> bool:
    W, b = m.weight, m.bias
    return (
        type(W) in (torch.Tensor, nn.Parameter)
        and W.device.type == "cpu"
        and W.dtype == torch.float32
        and not W.requires_grad
        and (b is None or (type(b) in (torch.Tensor, nn.Parameter) and not b.requires_grad))
    )


class PrepackedLinear(nn.Linear):
    """An `nn.Linear` whose frozen weight is kept packed for oneDNN (see the module doc)."""

    _packed: torch.Tensor | None
    _packed_key: tuple | None

    def _key(self) -> tuple:
        return (id(self.weight), self.weight._version)

    def repack(self) -> None:
        ok = _frozen_plain_float32(self)
        self._packed = onednn.pack(self.weight.detach(), PACK_ROWS) if ok else None
        self._packed_key = self._key() if ok else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed_key != self._key() or not _frozen_plain_float32(self):
            self.repack()  # merged, reloaded, unfrozen or sharded since it was packed
        x_MI = x.reshape(-1, x.shape[-1])
        small = x_MI.shape[0] == 1 and self.weight.numel() < onednn.SMALL_WEIGHT
        if self._packed is None or small or not onednn.wins(x_MI, self.weight):
            return F.linear(x, self.weight, self.bias)
        y_MO = _FrozenLinear.apply(x_MI, self.weight, self._packed, self.bias)
        return y_MO.view(*x.shape[:-1], self.out_features)


def frozen_linears(model: nn.Module) -> list[nn.Linear]:
    """The plain `nn.Linear`s `apply_prepacked_linears` would pack (the LM head excluded)."""
    head = model.lm_head_weight() if hasattr(model, "lm_head_weight") else None
    return [
        m
        for name, m in model.named_modules()
        if type(m) is nn.Linear
        and _frozen_plain_float32(m)
        and m.weight is not head
        and not name.startswith("lm_head.")  # the base of a head with trained rows
    ]


def apply_prepacked_linears(model: nn.Module) -> tuple[int, int]:
    """Pack every frozen float32 CPU linear of `model` once -> (layers packed, bytes held).

    (0, 0) when oneDNN is missing, nothing qualifies, or the copies would take more than half
    the free memory. Apply after the weights are final (LoRA applied, adapters loaded).
    """
    linears = frozen_linears(model)
    need = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    free = onednn.free_bytes()
    if not linears or not onednn.available() or (free is not None and need > free / 2):
        return 0, 0
    for m in linears:
        m.__class__ = PrepackedLinear
        m.repack()
    return len(linears), need
