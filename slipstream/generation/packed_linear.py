"""Prepacked linear layers for generation on CPU (oneDNN's blocked weight layout).

A float32 `F.linear` on CPU hands the weight to a GEMM that repacks it into its blocked
layout on every call; generation calls each weight once a token, so the repacking is most of
the work. Here each `nn.Linear`'s weight (and the LM head's) is packed once per generation
call with `torch.ops.mkldnn._reorder_linear_weight` and multiplied with
`torch.ops.mkldnn._linear_pointwise` (the pair torch's own CPU compiler uses for frozen
linears). Measured, one thread, SmolLM2-135M shapes (benchmarks/bench_generate.py's model):
the 49152 x 576 head at 16 rows 19 -> 6.5 ms, a 1536 x 576 projection at 16 rows 0.38 ->
0.15 ms, at a 1152-token prefill 20 -> 9.7 ms. One row against a small weight is a
matrix-vector product where packing does not pay, so those calls keep `F.linear`, and a
single sequence does not pack those weights at all.

The sums run in another order than F.linear's, so logits differ in the last float32 bits
(~4e-6 relative). Applies only under no_grad to float32 weights on CPU, whose module is a
plain `nn.Linear` (a bitsandbytes NF4 base is not: it keeps its own forward), and only when
a second copy of those weights fits in half the free memory; otherwise nothing changes.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.ops.onednn import SMALL_WEIGHT, available, pack
from slipstream.ops.onednn import free_bytes as _free_bytes


def linear(x: torch.Tensor, W_OI: torch.Tensor, packed: torch.Tensor | None, bias=None):
    """x @ W.T (+ bias) with the packed weight where it pays, else F.linear."""
    if packed is None or (x.shape[0] == 1 and W_OI.numel() < SMALL_WEIGHT):
        return F.linear(x, W_OI, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _eligible(W: torch.Tensor, rows: int) -> bool:
    # A plain tensor: not an FSDP2 shard (a DTensor) nor any other subclass.
    plain = type(W) in (torch.Tensor, nn.Parameter)
    on_cpu = plain and W.device.type == "cpu" and W.dtype == torch.float32
    return on_cpu and (rows > 1 or W.numel() >= SMALL_WEIGHT)


@contextmanager
def packed_linears(model: nn.Module, head_W: torch.Tensor, rows: int):
    """Within: every eligible `nn.Linear` of `model` runs on its packed weight; yields the LM
    head as a function h_BD -> logits_BV (packed too when eligible)."""
    # With one row, decode leaves small weights to F.linear: packing them would pay off only
    # in the prefill's one call, less than it costs.
    linears = [m for m in model.modules()
               if type(m) is nn.Linear and _eligible(m.weight, rows)]  # fmt: skip
    head_ok = _eligible(head_W, rows)
    weights = [m.weight for m in linears] + ([head_W] if head_ok else [])
    need = sum(W.numel() * W.element_size() for W in weights)
    free = _free_bytes()
    if torch.is_grad_enabled() or not weights or not available() or (free and need > free / 2):
        yield lambda h_BD: F.linear(h_BD, head_W)
        return
    for m in linears:
        m.forward = _packed_forward(m, pack(m.weight, rows))
    head_P = pack(head_W, rows) if head_ok else None
    try:
        yield lambda h_BD: linear(h_BD, head_W, head_P)
    finally:
        for m in linears:
            del m.forward  # back to nn.Linear.forward


def _packed_forward(m: nn.Linear, packed: torch.Tensor):
    def forward(x: torch.Tensor) -> torch.Tensor:
        return linear(x, m.weight, packed, m.bias)

    return forward
