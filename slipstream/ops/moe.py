"""Mixture-of-experts routing in one pass: route, plan, permute, grouped GEMMs, unpermute.

A MoE layer here never asks the host anything. Routing is one top-k and one stable argsort of
the flat expert ids; per-expert counts are a `scatter_add_` of ones on the device (not
`bincount`, which syncs on CUDA even with `minlength`), offsets are their `cumsum`; the experts
run as grouped GEMMs over those offsets; the results are gathered back and summed over the k
choices in float32. Dropless: there is no capacity factor and no token is ever lost.

`grouped_mm` picks torch's `_grouped_mm` where it is one sync-free kernel (CUDA bf16 on
sm90/sm100; CPU in torch >= 2.9, where it runs one small GEMM per expert internally, so its cost
still creeps up with E) and otherwise a tiled `bmm` fallback that needs no host sync either.
`moe(x_TD, logits_TE, experts, k)` composes the ops around the family's experts module;
`moe_loop_reference` is the per-expert loop that tests and benchmarks compare against.

Shapes: T tokens, D hidden, E experts, K top-k, I expert intermediate, F = 2I (fused gate+up
width, or any output width in `grouped_mm`), R = T*K routed rows (sorted by expert), B rows of
one tile in the fallback GEMM, P tiles x experts work items in the fallback GEMM.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

ROUTER_KINDS = ("softmax_topk", "topk_softmax")
_GROUPED_DTYPES_CPU = (torch.float32, torch.bfloat16, torch.float16)


def _probe_grouped_mm_cpu() -> bool:
    """Whether this torch runs `torch._grouped_mm` on CPU, forward and backward (torch >= 2.9)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        x_RD = torch.ones(3, 4, requires_grad=True)
        w_EDF = torch.ones(2, 4, 4, requires_grad=True)
        offsets_E = torch.tensor([1, 3], dtype=torch.int32)
        torch._grouped_mm(x_RD, w_EDF, offs=offsets_E).backward(torch.ones(3, 4))
    except (RuntimeError, NotImplementedError):
        return False
    return True


# Feature detection at import: CPU support is probed once (a 3x4 GEMM, microseconds); CUDA
# support is decided per device from its compute capability, without initialising CUDA here.
_HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")
_GROUPED_MM_CPU = _probe_grouped_mm_cpu()


@functools.cache
def _cuda_grouped_mm_fast(device_index: int) -> bool:
    # torch's CUDA `_grouped_mm` has a CUTLASS kernel for bf16 on sm90/sm100 only; every other
    # case falls back to a loop that copies `offs` to the host (a sync per call), so we use
    # our own sync-free fallback there instead.
    return torch.cuda.get_device_capability(device_index)[0] in (9, 10)


def _grouped_mm_supported(x_RD: torch.Tensor, w_EDF: torch.Tensor) -> bool:
    if not _HAS_GROUPED_MM or x_RD.dtype != w_EDF.dtype:
        return False
    if x_RD.device.type == "cpu":
        ok_device = _GROUPED_MM_CPU and x_RD.dtype in _GROUPED_DTYPES_CPU
    elif x_RD.device.type == "cuda":
        index = x_RD.device.index if x_RD.device.index is not None else 0
        ok_device = x_RD.dtype == torch.bfloat16 and _cuda_grouped_mm_fast(index)
    else:
        ok_device = False
    # The kernels need 16-byte aligned strides, in forward (D, F) and in backward (F, D), and
    # 16-byte aligned data (not guaranteed for memory-mapped safetensors on CPU).
    size = x_RD.element_size()
    aligned = (x_RD.shape[1] * size) % 16 == 0 and (w_EDF.shape[2] * size) % 16 == 0
    aligned = aligned and x_RD.data_ptr() % 16 == 0 and w_EDF.data_ptr() % 16 == 0
    dense_w = w_EDF.is_contiguous() or w_EDF.transpose(1, 2).is_contiguous()
    return ok_device and aligned and x_RD.is_contiguous() and dense_w


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient dense (the grouped GEMM's backward
    rejects expanded gradients such as the one `y.sum().backward()` produces)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _tiled_grouped_mm(x_RD: torch.Tensor, w_EDF: torch.Tensor, offsets_E: torch.Tensor):
    """Sync-free grouped GEMM from plain ops, for torch/devices without a fast `_grouped_mm`.

    Rows are cut into tiles of B = max(16, ceil(R/E)) rows. Rows are sorted by expert, so tile
    t spans a contiguous run of experts and the (tile, expert) pairs number at most
    P = tiles + E - 1 <= 2E - 1: a bound known from shapes alone, so no host sync. Each pair is
    one slice of a `bmm` over (P, B, D) x (P, D, F) with rows of other experts masked out.
    Cost: at most R + E*B <= 2R + 16E rows of FLOPs (<= ~2x the exact GEMM) and a transient
    gather of at most 2x the expert weights (the price of avoiding the sync).
    """
    R, D = x_RD.shape
    E, _, F_out = w_EDF.shape
    B = max(16, -(-R // E))
    n_tiles = max(1, -(-R // B))
    P = n_tiles + E - 1
    dev = x_RD.device
    # Expert of each (padded) row; rows at or past offsets[-1] get E, matching no item.
    row_ids = torch.arange(n_tiles * B, device=dev, dtype=offsets_E.dtype)
    expert_R = torch.searchsorted(offsets_E, row_ids, right=True)
    expert_tB = expert_R.view(n_tiles, B)
    first_t = expert_tB[:, 0].clamp(max=E - 1)
    last_t = expert_tB.clamp(max=E - 1).amax(dim=1)
    span_t = last_t - first_t + 1
    end_t = span_t.cumsum(0)
    item = torch.arange(P, device=dev)
    tile_P = torch.searchsorted(end_t, item, right=True).clamp(max=n_tiles - 1)
    expert_P = first_t[tile_P] + item - (end_t - span_t)[tile_P]
    valid_P = item < end_t[-1]
    expert_P = torch.where(valid_P, expert_P, 0).clamp(0, E - 1)

    # Rows past the last offset may hold anything (NaN included): zero them so that neither
    # the masked outputs nor the weight gradient (x^T @ dy) ever see them.
    x_RD = torch.where((expert_R[:R] < E)[:, None], x_RD, 0)
    x_tBD = F.pad(x_RD, (0, 0, 0, n_tiles * B - R)).view(n_tiles, B, D)
    y_PBF = torch.bmm(x_tBD[tile_P], w_EDF[expert_P])
    keep_PB = (expert_tB[tile_P] == expert_P[:, None]) & valid_P[:, None]
    y_PBF = torch.where(keep_PB[..., None], y_PBF, 0)
    rows_PB = tile_P[:, None] * B + torch.arange(B, device=dev)
    y_RF = y_PBF.new_zeros(n_tiles * B, F_out).index_add(0, rows_PB.flatten(), y_PBF.flatten(0, 1))
    return y_RF[:R]


def grouped_mm(
    x_RD: torch.Tensor, w_EDF: torch.Tensor, offsets_E: torch.Tensor, *, backend: str = "auto"
) -> torch.Tensor:
    """y_RF[r] = x_RD[r] @ w_EDF[e] for the rows r of expert e (rows offsets[e-1]:offsets[e]).

    offsets_E: (E,) int32 cumulative row counts. For `nn.Linear`-layout weights w_EFD pass
    `w_EFD.transpose(1, 2)` (a view). Rows past offsets[-1] are never read; their outputs are
    unspecified. backend: "auto" (torch's grouped GEMM when supported, else the tiled fallback),
    "torch" or "tiled".
    """
    if backend not in ("auto", "torch", "tiled"):
        raise ValueError(f"grouped_mm backend={backend!r}: use 'auto', 'torch' or 'tiled'")
    if offsets_E.dtype != torch.int32 or offsets_E.shape != w_EDF.shape[:1]:
        raise ValueError(
            f"grouped_mm offsets {offsets_E.dtype} {tuple(offsets_E.shape)}: need int32 "
            f"({w_EDF.shape[0]},), e.g. RoutingPlan.offsets_E"
        )
    if x_RD.shape[1] != w_EDF.shape[1]:
        raise ValueError(f"grouped_mm x {tuple(x_RD.shape)} does not match w {tuple(w_EDF.shape)}")
    use_torch = backend == "torch" or (backend == "auto" and _grouped_mm_supported(x_RD, w_EDF))
    if use_torch:
        return _ContiguousGrad.apply(torch._grouped_mm(x_RD, w_EDF, offs=offsets_E))
    return _tiled_grouped_mm(x_RD, w_EDF, offsets_E)


def route(
    logits_TE: torch.Tensor, k: int, *, kind: str = "softmax_topk", norm_topk_prob: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing -> (weights_TK in the logits' dtype, ids_TK int64).

    "softmax_topk" (Qwen3-MoE): softmax over all E in float32, top-k, optional renormalisation.
    "topk_softmax" (GPT-OSS): top-k of the logits, softmax over the k selected.
    """
    E = logits_TE.shape[-1]
    if not 1 <= k <= E:
        raise ValueError(f"top-k k={k} must be between 1 and num_experts={E}")
    if kind == "softmax_topk":
        probs_TE = torch.softmax(logits_TE.float(), dim=-1)
        weights_TK, ids_TK = torch.topk(probs_TE, k, dim=-1)
        if norm_topk_prob:
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)
    elif kind == "topk_softmax":
        top_TK, ids_TK = torch.topk(logits_TE, k, dim=-1)
        weights_TK = torch.softmax(top_TK.float(), dim=-1)
    else:
        raise ValueError(f"router kind={kind!r}: use one of {ROUTER_KINDS}")
    return weights_TK.to(logits_TE.dtype), ids_TK


@dataclass(frozen=True, eq=False)
class RoutingPlan:
    """Where each routed row goes. Row r of the expert-sorted order holds flat choice
    `perm_R[r]` = t*K + k, i.e. token `token_R[r]`; `inv_R[t*K + k]` is its row."""

    num_experts: int
    k: int
    perm_R: torch.Tensor  # (R,) int64, flat choice index of each sorted row
    inv_R: torch.Tensor  # (R,) int64, sorted row of each flat choice
    token_R: torch.Tensor  # (R,) int64, token of each sorted row
    expert_R: torch.Tensor  # (R,) int64, expert of each sorted row (non-decreasing)
    counts_E: torch.Tensor  # (E,) int64 rows per expert
    offsets_E: torch.Tensor  # (E,) int32 cumulative counts, for grouped GEMMs


def plan(ids_TK: torch.Tensor, num_experts: int) -> RoutingPlan:
    """Sort the T*K choices by expert (one stable sort) and count rows per expert, on device."""
    T, K = ids_TK.shape
    ids_R = ids_TK.reshape(-1)
    expert_R, perm_R = torch.sort(ids_R, stable=True)
    rows = torch.arange(ids_R.numel(), device=ids_R.device)
    inv_R = torch.empty_like(perm_R).scatter_(0, perm_R, rows)
    # scatter_add_ of ones, not bincount: bincount copies its result size to the host on CUDA.
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=ids_R.device)
    counts_E.scatter_add_(0, ids_R, torch.ones_like(ids_R))
    offsets_E = counts_E.cumsum(0).to(torch.int32)
    return RoutingPlan(num_experts, K, perm_R, inv_R, perm_R // K, expert_R, counts_E, offsets_E)


class _GatherRows(torch.autograd.Function):
    """out = x[index]; backward gathers with the inverse permutation and sums `fold` rows per
    output row, so both directions are gathers (no scatter, no atomics, deterministic)."""

    @staticmethod
    def forward(ctx, x, index, inv_index, fold):
        ctx.save_for_backward(inv_index)
        ctx.fold = fold
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inv_index,) = ctx.saved_tensors
        g = grad.index_select(0, inv_index)
        if ctx.fold > 1:
            g = g.view(-1, ctx.fold, g.shape[-1]).float().sum(1).to(grad.dtype)
        return g, None, None, None


def permute(x_TD: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
    """x_RD: token rows gathered in expert order (each token appears K times)."""
    return _GatherRows.apply(x_TD, plan.token_R, plan.inv_R, plan.k)


def unpermute(y_RD: torch.Tensor, plan: RoutingPlan, weights_TK: torch.Tensor) -> torch.Tensor:
    """y_TD[t] = sum_k weights_TK[t, k] * y_RD[inv(t, k)], accumulated in float32."""
    T, K = weights_TK.shape
    y_TKD = _GatherRows.apply(y_RD, plan.inv_R, plan.perm_R, 1).view(T, K, -1)
    y_TD = torch.einsum("tkd,tk->td", y_TKD.float(), weights_TK.float())
    return y_TD.to(y_RD.dtype)


def moe(
    x_TD: torch.Tensor,
    logits_TE: torch.Tensor,
    experts: Callable[[torch.Tensor, RoutingPlan], torch.Tensor],
    k: int,
    *,
    kind: str = "softmax_topk",
    norm_topk_prob: bool = True,
) -> tuple[torch.Tensor, RoutingPlan]:
    """One MoE block from router logits: route -> plan -> permute -> experts -> unpermute.

    `experts(x_RD, plan) -> y_RD` runs every expert on its rows (the family's stacked experts
    module: grouped GEMMs over `plan.offsets_E`). Returns y_TD and the plan.
    """
    weights_TK, ids_TK = route(logits_TE, k, kind=kind, norm_topk_prob=norm_topk_prob)
    p = plan(ids_TK, logits_TE.shape[-1])
    return unpermute(experts(permute(x_TD, p), p), p, weights_TK), p


def router_stats(logits_TE: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
    """(2, E) float32 for the auxiliary loss: rows routed to each expert (no grad), and the
    router softmax summed over tokens (with grad)."""
    probs_sum_E = torch.softmax(logits_TE.float(), dim=-1).sum(0)
    return torch.stack([plan.counts_E.float(), probs_sum_E])


def load_balancing_loss(stats: Sequence[torch.Tensor], tokens: int) -> torch.Tensor:
    """transformers' `load_balancing_loss_func` from L layers' `router_stats`, each over
    `tokens` tokens, pooled over the layers before the product as it does, no host sync:
    E * sum_e (rows routed to e / (L*T)) * (router probabilities of e summed / (L*T))."""
    counts_E, probs_E = torch.stack(list(stats)).sum(0) / (len(stats) * tokens)
    return counts_E.shape[0] * torch.sum(counts_E * probs_E)


def moe_loop_reference(
    x_TD: torch.Tensor,
    weights_TK: torch.Tensor,
    ids_TK: torch.Tensor,
    experts: Callable[[torch.Tensor, RoutingPlan], torch.Tensor],
    num_experts: int,
) -> torch.Tensor:
    """The plain per-expert loop (`torch.where(ids == e)`, a host sync per expert), each
    expert run through `experts` on a plan that sends all its rows to it (so biases and
    expert LoRA apply as in `moe`). Reference for tests and benchmarks; no model uses it."""
    E = num_experts
    y_TD = torch.zeros_like(x_TD)
    for e in range(E):
        tok_R, slot_R = torch.where(ids_TK == e)
        one = plan(torch.full_like(tok_R, e)[:, None], E)
        out_RD = experts(x_TD.index_select(0, tok_R), one)
        weighted = out_RD * weights_TK[tok_R, slot_R, None].to(out_RD.dtype)
        y_TD = y_TD.index_add(0, tok_R, weighted.to(y_TD.dtype))
    return y_TD
