"""Generalised Jensen-Shannon divergence between a student's and a teacher's linear heads,
chunked over tokens, for distillation (Agarwal et al. 2024, GKD; TRL 1.16's
`generalized_jsd_loss` and `DistillationTrainer`'s chunked divergence).

Shapes: N scored rows (flat), D student hidden size, E teacher hidden size, V the shared
vocabulary, C rows in one chunk. With p = softmax(h_s W_s^T / tau), q = softmax(h_t W_t^T /
tau) and m = (1 - beta) p + beta q, per row:

    beta = 0:  KL(q || p)                                (forward KL)
    beta = 1:  KL(p || q)                                (reverse KL)
    else:      beta KL(q || m) + (1 - beta) KL(p || m)

(TRL's special cases and mixture, in its argument order). Both models' (N, V) float32 logits
never exist at once: per chunk of C rows the two (C, V) logits, the divergence and its
gradient with respect to the student's logits are computed, then folded into the gradients
of the student hidden states and head weight (kept; backward only scales them by the
upstream gradient), as the chunked cross-entropy (ops/loss.py) does. The gradient with
respect to the student's tempered logits z (TRL's kernel):

    beta = 0:  p - q
    beta = 1:  p (log p - log q - KL(p || q))
    else:      (1 - beta) p (log p - log m - KL(p || m))

times 1 / tau for the logits. The teacher gets no gradient (it is frozen). Also returned,
detached: the sum of the student's per-row entropy of p (TRL's `entropy` metric).
"""

from __future__ import annotations

import math

import torch

from slipstream.ops import onednn
from slipstream.ops.frozen_linear import linear_frozen

# Rows per chunk: about 2**25 float32 logits (128 MB) per (C, V) array; a chunk holds about
# five of them (two models' logits, log-mixture, probabilities, gradient).
_CHUNK_ELEMENTS = 1 << 25


def linear_jsd(
    hidden_s_ND: torch.Tensor,
    weight_s_VD: torch.Tensor,
    hidden_t_NE: torch.Tensor,
    weight_t_VE: torch.Tensor,
    *,
    beta: float,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(divergence summed over the N rows, student entropy summed over them (detached)),
    0-d float32 device tensors; module docstring for the formula."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"distill.beta = {beta}: it must be in [0, 1]")
    if not temperature > 0:
        raise ValueError(f"distill.temperature = {temperature}: it must be > 0")
    if (
        hidden_s_ND.dim() != 2
        or hidden_t_NE.dim() != 2
        or (hidden_s_ND.shape[0] != hidden_t_NE.shape[0])
    ):
        raise ValueError(
            f"student hidden {tuple(hidden_s_ND.shape)} and teacher hidden "
            f"{tuple(hidden_t_NE.shape)}: expected (N, D) and (N, E) for the same N rows"
        )
    if weight_s_VD.shape[0] != weight_t_VE.shape[0]:
        raise ValueError(
            f"student head has {weight_s_VD.shape[0]} rows, the teacher's "
            f"{weight_t_VE.shape[0]}: distillation needs one vocabulary"
        )
    rows = chunk_size or max(1, _CHUNK_ELEMENTS // weight_s_VD.shape[0])
    return _ChunkedJSD.apply(
        hidden_s_ND, weight_s_VD, hidden_t_NE.detach(), weight_t_VE.detach(),
        float(beta), float(temperature), rows, torch.is_grad_enabled(),
    )  # fmt: skip


def _chunk_terms(zs_CV: torch.Tensor, zt_CV: torch.Tensor, beta: float):
    """(divergence_C, entropy_C, grad wrt zs_CV) of tempered float32 logits."""
    log_p = torch.log_softmax(zs_CV, dim=-1)
    log_q = torch.log_softmax(zt_CV, dim=-1)
    p = log_p.exp()
    entropy_C = -(p * log_p).sum(-1)
    if beta == 0.0:
        q = log_q.exp()
        div_C = (q * (log_q - log_p)).sum(-1)
        return div_C, entropy_C, p - q
    if beta == 1.0:
        diff = log_p - log_q
        div_C = (p * diff).sum(-1)
        return div_C, entropy_C, p * (diff - div_C[:, None])
    log_m = torch.logaddexp(log_p + math.log1p(-beta), log_q + math.log(beta))
    q = log_q.exp()
    kl_p_C = (p * (log_p - log_m)).sum(-1)
    div_C = beta * (q * (log_q - log_m)).sum(-1) + (1 - beta) * kl_p_C
    grad = (1 - beta) * p * (log_p - log_m - kl_p_C[:, None])
    return div_C, entropy_C, grad


class _ChunkedJSD(torch.autograd.Function):
    """Summed divergence; the student's gradients computed chunk by chunk in forward."""

    @staticmethod
    def forward(ctx, h_s_ND, w_s_VD, h_t_NE, w_t_VE, beta, tau, rows, grad_enabled):
        need_h = grad_enabled and h_s_ND.requires_grad
        need_w = grad_enabled and w_s_VD.requires_grad
        N = h_s_ND.shape[0]
        loss = torch.zeros((), dtype=torch.float32, device=h_s_ND.device)
        entropy = torch.zeros((), dtype=torch.float32, device=h_s_ND.device)
        grad_h_ND = torch.empty_like(h_s_ND) if need_h else None
        grad_w_VD = torch.zeros_like(w_s_VD, dtype=torch.float32) if need_w else None
        for start in range(0, N, rows):
            h_CD = h_s_ND[start : start + rows]
            zs_CV = _logits(h_CD, w_s_VD).float().div_(tau)
            zt_CV = linear_frozen(h_t_NE[start : start + rows], w_t_VE).float().div_(tau)
            div_C, ent_C, grad_CV = _chunk_terms(zs_CV, zt_CV, beta)
            del zs_CV, zt_CV
            loss += div_C.sum()
            entropy += ent_C.sum()
            if not (need_h or need_w):
                continue
            grad_CV = grad_CV.div_(tau).to(h_s_ND.dtype)
            if need_h:
                grad_h_ND[start : start + rows] = onednn.grad_input(grad_CV, w_s_VD)
            if need_w:
                grad_w_VD += (grad_CV.t() @ h_CD).float()
        ctx.save_for_backward(
            *(g if g is not None else torch.empty(0) for g in (grad_h_ND, grad_w_VD))
        )
        ctx.has = (need_h, need_w)
        ctx.w_dtype = w_s_VD.dtype
        ctx.mark_non_differentiable(entropy)
        return loss, entropy

    @staticmethod
    def backward(ctx, grad_loss, _grad_entropy):
        grad_h_ND, grad_w_VD = ctx.saved_tensors
        need_h, need_w = ctx.has
        # grad_loss is a device scalar: scaling by it keeps backward sync-free.
        gh = grad_h_ND * grad_loss.to(grad_h_ND.dtype) if need_h else None
        gw = (grad_w_VD * grad_loss).to(ctx.w_dtype) if need_w else None
        return gh, gw, None, None, None, None, None, None


def _logits(h_CD: torch.Tensor, w_VD: torch.Tensor) -> torch.Tensor:
    # A trainable head's weight changes every step: oneDNN without prepacking (ops/loss.py).
    return onednn.linear(h_CD, w_VD)
