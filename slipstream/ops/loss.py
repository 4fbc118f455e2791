"""Cross-entropy of a linear head without materialising the full float32 logits.

Shapes: T tokens (flat, packed), D hidden size, V vocabulary, C rows in one chunk.
`hidden_TD @ weight_VD.T` as float32 is T*V*4 bytes: 9.7 GB for 16k tokens of Qwen3's
151,936-word vocabulary, more than the rest of a LoRA step. Two backends:
- "torch": `torch.nn.functional.linear_cross_entropy` with `LinearCrossEntropyOptions`
  (its chunked path; torch >= 2.13), used for CUDA tensors where the installed torch has it.
  Not on CPU: there it measured 5.9 / 6.4 / 6.6 s for 196 / 512 / 1024 rows of SmolLM2's
  49,152-word head against 0.62 / 1.27 / 2.31 s for "chunked" (torch 2.13, 2 cores);
- "chunked": our `torch.autograd.Function` over chunks of T rows. Forward computes, per
  chunk, float32 logits, the loss, and the gradients w.r.t. hidden, weight and bias; only
  the gradients are kept (T*D + V*D floats), so backward is a scale by the upstream grad.

Both reduce with a sum on the device; "mean" divides by the count of labels != ignore_index
clamped to 1, so a batch with no labels gives 0, not NaN, and nothing reads back to the host.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from slipstream.ops import onednn
from slipstream.ops.frozen_linear import linear_frozen


def _torch_has_chunked_lce() -> bool:
    fn = getattr(F, "linear_cross_entropy", None)
    if fn is None or not hasattr(torch.nn, "LinearCrossEntropyOptions"):
        return False
    # Without `options` torch's op is linear + cross_entropy: full logits, no saving.
    params = inspect.signature(fn).parameters
    return all(p in params for p in ("options", "ignore_index", "reduction", "linear_bias"))


# Module-level switch: tests and benchmarks set it to False to force the chunked fallback.
USE_TORCH_LCE: bool = _torch_has_chunked_lce()

# Rows per chunk in the fallback: 2**26 float32 logits (256 MB) per chunk at most.
_CHUNK_ELEMENTS = 1 << 26


def linear_cross_entropy(
    hidden_TD: torch.Tensor,
    weight_VD: torch.Tensor,
    labels_T: torch.Tensor,
    *,
    reduction: str = "mean",
    ignore_index: int = -100,
    bias: torch.Tensor | None = None,
    backend: str | None = None,
    chunk_size: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Cross-entropy of `hidden_TD @ weight_VD.T (+ bias)` against `labels_T`, in float32.

    reduction "sum" or "mean" (over labels != ignore_index; 0 when there are none).
    backend None picks "torch" for CUDA tensors where available (USE_TORCH_LCE), else
    "chunked". softcap: logits become softcap * tanh(logits / softcap) (Gemma 2's final
    logit softcapping; "chunked" only).
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction={reduction!r} is not supported; use 'mean' or 'sum'")
    torch_ok = USE_TORCH_LCE and hidden_TD.is_cuda and softcap is None
    backend = backend or ("torch" if torch_ok else "chunked")
    if backend == "torch" and softcap is not None:
        raise ValueError("softcap needs backend='chunked'")
    if backend not in ("torch", "chunked"):
        raise ValueError(f"backend={backend!r} is not supported; use 'torch' or 'chunked'")
    if hidden_TD.shape[:-1] != labels_T.shape:
        raise ValueError(
            f"hidden shape {tuple(hidden_TD.shape)} does not match labels shape "
            f"{tuple(labels_T.shape)}: expected hidden (..., D) and labels (...)"
        )
    hidden_TD = hidden_TD.reshape(-1, hidden_TD.shape[-1])
    labels_T = labels_T.reshape(-1).long()
    if backend == "torch":
        loss_sum = F.linear_cross_entropy(
            hidden_TD,
            weight_VD,
            labels_T,
            linear_bias=bias,
            reduction="sum",
            ignore_index=ignore_index,
            options=torch.nn.LinearCrossEntropyOptions(),
        ).float()
    else:
        rows = chunk_size or max(1, _CHUNK_ELEMENTS // weight_VD.shape[0])
        loss_sum = _ChunkedLinearCrossEntropy.apply(
            hidden_TD, weight_VD, labels_T, bias, ignore_index, rows, torch.is_grad_enabled(),
            softcap,
        )  # fmt: skip
    if reduction == "sum":
        return loss_sum
    count = (labels_T != ignore_index).sum().clamp(min=1)
    return loss_sum / count


def _head_logits(h_CD, weight_VD, bias_V):
    # On CPU in float32 through oneDNN: SmolLM2's 49,152 x 576 head at 1,024 rows took
    # 744 ms there against 1,777 ms in F.linear (MKL), and g @ W 316 against 593 ms
    # (ops/onednn.py); elsewhere, and with a bias, F.linear.
    if bias_V is None:
        return onednn.linear(h_CD, weight_VD)
    return F.linear(h_CD, weight_VD, bias_V)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy; gradients computed chunk by chunk in forward and kept."""

    @staticmethod
    def forward(
        ctx, hidden_TD, weight_VD, labels_T, bias_V, ignore_index, rows, grad_enabled, softcap
    ):
        # Inside forward autograd is off; whether grads are wanted comes from the caller.
        need_h = grad_enabled and hidden_TD.requires_grad
        need_w = grad_enabled and weight_VD.requires_grad
        need_b = grad_enabled and bias_V is not None and bias_V.requires_grad
        T = hidden_TD.shape[0]
        loss = torch.zeros((), dtype=torch.float32, device=hidden_TD.device)
        grad_h_TD = torch.empty_like(hidden_TD) if need_h else None
        # Weight/bias grads accumulate over chunks in float32, cast once at the end.
        grad_w_VD = torch.zeros_like(weight_VD, dtype=torch.float32) if need_w else None
        grad_b_V = torch.zeros_like(bias_V, dtype=torch.float32) if need_b else None
        for start in range(0, T, rows):
            h_CD = hidden_TD[start : start + rows]
            y_C = labels_T[start : start + rows]
            logits_CV = _head_logits(h_CD, weight_VD, bias_V).float()
            if softcap is not None:  # c = s tanh(z / s): dc/dz = 1 - tanh^2
                tanh_CV = torch.tanh(logits_CV / softcap)
                logits_CV = tanh_CV * softcap
            valid_C = y_C != ignore_index
            target_C = torch.where(valid_C, y_C, 0)
            picked_C = logits_CV.gather(1, target_C[:, None]).squeeze(1)
            # log-sum-exp in place: torch.logsumexp allocates a (C, V) temporary the size of
            # the logits (201 MB at 1,024 rows of a 49,152-word head), unseen by the memory
            # planner's tracker and held by the host heap after. exp_CV is the logits' buffer.
            max_C = logits_CV.amax(dim=-1)
            exp_CV = logits_CV.sub_(max_C[:, None]).exp_()
            sum_C = exp_CV.sum(dim=-1)
            lse_C = max_C + sum_C.log()
            loss += ((lse_C - picked_C) * valid_C).sum()
            if not (need_h or need_w or need_b):
                continue
            # d loss / d logits = softmax - onehot(target), zero on ignored rows.
            grad_CV = exp_CV.div_(sum_C[:, None])
            grad_CV.scatter_add_(1, target_C[:, None], -torch.ones_like(lse_C[:, None]))
            grad_CV.mul_(valid_C[:, None])
            if softcap is not None:
                grad_CV.mul_(1 - tanh_CV.square_())
            if need_b:
                grad_b_V += grad_CV.sum(0)
            grad_CV = grad_CV.to(hidden_TD.dtype)
            if need_h:
                grad_h_TD[start : start + rows] = onednn.grad_input(grad_CV, weight_VD)
            if need_w:
                grad_w_VD += (grad_CV.t() @ h_CD).float()
        ctx.save_for_backward(
            *(g if g is not None else torch.empty(0) for g in (grad_h_TD, grad_w_VD, grad_b_V))
        )
        ctx.has = (need_h, need_w, need_b)
        ctx.dtypes = (weight_VD.dtype, None if bias_V is None else bias_V.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h_TD, grad_w_VD, grad_b_V = ctx.saved_tensors
        need_h, need_w, need_b = ctx.has
        w_dtype, b_dtype = ctx.dtypes
        # grad_loss is a device scalar: scaling by it keeps backward sync-free.
        gh = (grad_h_TD * grad_loss.to(grad_h_TD.dtype)) if need_h else None
        gw = (grad_w_VD * grad_loss).to(w_dtype) if need_w else None
        gb = (grad_b_V * grad_loss).to(b_dtype) if need_b else None
        return gh, gw, None, gb, None, None, None, None


def linear_token_logps(
    hidden_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    targets_N: torch.Tensor,
    *,
    chunk_size: int | None = None,
    softcap: float | None = None,
    with_stats: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """log softmax(hidden_ND @ weight_VD.T)[n, targets_N[n]] for each row, in float32: (N,).
    softcap: of softcap * tanh(logits / softcap), as `linear_cross_entropy`. `with_stats`:
    -> (log-probs, {"entropy": each row's entropy of that softmax, "mean_logit": its logits'
    mean over the vocabulary}, (N,) each, detached), from the same chunk of logits (TRL's
    trainers log them: `entropy`, KTO's `logits/*`).

    For objectives that need each token's log-prob (per-sequence sums in DPO, ratios in RL),
    not one summed loss. Rows go through the head in chunks of at most 2**26 float32 logits;
    with more than one chunk each is recomputed in backward (activation checkpointing), so
    the peak is one chunk's logits, not N*V floats, for one more head matmul per chunk.
    """
    if hidden_ND.shape[:-1] != targets_N.shape or hidden_ND.dim() != 2:
        raise ValueError(
            f"hidden shape {tuple(hidden_ND.shape)} and targets shape {tuple(targets_N.shape)}: "
            "expected hidden (N, D) and targets (N,)"
        )
    rows = chunk_size or max(1, _CHUNK_ELEMENTS // weight_VD.shape[0])
    targets_N = targets_N.long()
    fn = _token_logps_stats if with_stats else _token_logps
    if hidden_ND.shape[0] <= rows:
        return fn(hidden_ND, weight_VD, targets_N, softcap)
    from torch.utils.checkpoint import checkpoint

    parts = [
        checkpoint(fn, h, weight_VD, y, softcap, use_reentrant=False)
        if torch.is_grad_enabled()
        else fn(h, weight_VD, y, softcap)
        for h, y in zip(hidden_ND.split(rows), targets_N.split(rows), strict=True)
    ]
    if with_stats:
        stats = {k: torch.cat([p[1][k] for p in parts]) for k in parts[0][1]}
        return torch.cat([p[0] for p in parts]), stats
    return torch.cat(parts)


def _token_logps(h_CD: torch.Tensor, w_VD: torch.Tensor, y_C: torch.Tensor, softcap=None):
    logits_CV = linear_frozen(h_CD, w_VD).float()  # a frozen float32 CPU head: oneDNN
    if softcap is not None:
        logits_CV = torch.tanh(logits_CV / softcap) * softcap
    picked_C = logits_CV.gather(1, y_C[:, None]).squeeze(1)
    return picked_C - torch.logsumexp(logits_CV, dim=-1)


_STATS_ELEMENTS = 1 << 22


def _token_logps_stats(h_CD: torch.Tensor, w_VD: torch.Tensor, y_C: torch.Tensor, softcap=None):
    """`_token_logps` and each row's softmax entropy, -sum_v p_v log p_v (TRL's
    `entropy_from_logits`: lse - sum_v p_v z_v would cancel on confident rows), and its mean
    logit, both detached."""
    logits_CV = linear_frozen(h_CD, w_VD).float()
    if softcap is not None:
        logits_CV = torch.tanh(logits_CV / softcap) * softcap
    picked_C = logits_CV.gather(1, y_C[:, None]).squeeze(1)
    lse_C = torch.logsumexp(logits_CV, dim=-1)
    with torch.no_grad():
        z_CV, m_C = logits_CV.detach(), lse_C.detach()
        # log p and p for a block of rows at a time: two (B, V) arrays of ~2**22 floats
        # (32 MB) beside the chunk's logits, not two more of the chunk's size.
        block = max(1, _STATS_ELEMENTS // z_CV.shape[1])
        entropy_C = torch.cat([
            -torch.einsum("cv,cv->c", lp.exp(), lp)
            for lp in (z - m[:, None] for z, m in zip(z_CV.split(block), m_C.split(block)))
        ])  # fmt: skip
        stats = {"entropy": entropy_C, "mean_logit": z_CV.mean(dim=-1)}
    return picked_C - lse_C, stats
