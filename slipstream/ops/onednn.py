"""CPU GEMMs through oneDNN: x @ W.T and g @ W for a weight held in nn.Linear's (O, I) layout.

A float32 `F.linear` or `@` on CPU goes to MKL's sgemm, which repacks the weight on every
call and, on AMD CPUs, runs without AVX-512. oneDNN's linear (`torch.ops.mkldnn.
_linear_pointwise`, the op torch's own CPU compiler uses for frozen linears) does neither.
Measured, 1 thread, AMD EPYC (AVX-512, AVX512-BF16), 1024 rows (docs/benchmarks.md):

| weight (O x I) | x @ W.T: F.linear | oneDNN | oneDNN, prepacked | g @ W: `@` | oneDNN on W.T |
|---|---|---|---|---|---|
| float32 1536 x 576 | 18.6 ms | 8.2 | 8.0 | 18.8 | 8.3 |
| float32 49152 x 576 (the head) | 1,777 | 744 | - | 593 | 316 |
| bf16 1536 x 576 | 5.3 | 4.4 | 4.0 | 4.3 | 4.1 |
| bf16 49152 x 576 | 182 | 185 | - | 180 | 302 |

So float32 gains 2.2x from the backend and ~2% more from packing the weight once; bf16
already runs on oneDNN kernels (same times), except the transposed head, slower in oneDNN.
`linear` and `grad_input` therefore take oneDNN for float32 only and leave bf16 to torch.

Results differ from MKL's in summation order only (~1e-6 relative in float32).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

# One row against a weight smaller than this: F.linear (a matrix-vector product, where
# packing does not pay: generation/packed_linear.py).
SMALL_WEIGHT = 1 << 21


# Module switch: benchmarks set it False to time torch's own GEMMs for comparison.
ENABLED = True


@functools.cache
def available() -> bool:
    """oneDNN's linear ops are in this torch build (torch 2.11 CPU wheels have them)."""
    mkldnn = torch.ops.mkldnn
    return torch.backends.mkldnn.is_available() and all(
        hasattr(mkldnn, op) for op in ("_reorder_linear_weight", "_linear_pointwise")
    )


def pack(W_OI: torch.Tensor, rows: int) -> torch.Tensor:
    """W in oneDNN's blocked layout for inputs of about `rows` rows (an opaque tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(W_OI, rows)


def pointwise(x_MI: torch.Tensor, W: torch.Tensor, bias: torch.Tensor | None = None):
    """x @ W.T (+ bias) through oneDNN; W plain (O, I), a transposed view, or `pack`ed."""
    return torch.ops.mkldnn._linear_pointwise(x_MI, W, bias, "none", [], "")


def wins(x: torch.Tensor, W: torch.Tensor) -> bool:
    """oneDNN beats torch's own CPU GEMM here: float32 plain tensors on CPU, 2-D input."""
    plain = type(W) in (torch.Tensor, torch.nn.Parameter) and type(x) is torch.Tensor
    return (
        ENABLED
        and plain
        and x.device.type == "cpu"
        and W.device.type == "cpu"
        and x.dtype == W.dtype == torch.float32
        and x.dim() == 2
        and available()
    )


def linear(x_MI: torch.Tensor, W_OI: torch.Tensor) -> torch.Tensor:
    """x @ W.T, through oneDNN where it wins (no autograd: for code computing its own grads)."""
    return pointwise(x_MI, W_OI) if wins(x_MI, W_OI) else F.linear(x_MI, W_OI)


def grad_input(g_MO: torch.Tensor, W_OI: torch.Tensor) -> torch.Tensor:
    """g @ W (the input gradient of x @ W.T), through oneDNN where it wins; no copy of W."""
    return pointwise(g_MO, W_OI.t()) if wins(g_MO, W_OI) else g_MO @ W_OI


def free_bytes() -> int | None:
    """Memory the system has free now, or None where it cannot say."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
