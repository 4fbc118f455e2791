"""The chunked generalised JSD (ops/jsd.py) against TRL 1.16's own two: GKD's
`generalized_jsd_loss` on full logits and `DistillationTrainer`'s chunked divergence (its
torch path on CPU), for forward KL, reverse KL and mixtures, with a temperature: the summed
divergence, the student entropy and the gradients of the student's hidden states and head
weight, on odd shapes, several chunks."""

from __future__ import annotations

import pytest
import torch

from slipstream.debug import count_syncs
from slipstream.ops.jsd import linear_jsd

trl_gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer")
trl_distill = pytest.importorskip("trl.trainer.distillation_trainer")

N, D, E, V = 13, 24, 40, 197  # teacher wider than the student; a prime vocabulary


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    h_s = torch.randn(N, D, generator=g, dtype=torch.float64).float().requires_grad_()
    w_s = (torch.randn(V, D, generator=g) * 0.3).requires_grad_()
    h_t = torch.randn(N, E, generator=g)
    w_t = torch.randn(V, E, generator=g) * 0.3
    return h_s, w_s, h_t, w_t


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [None, 4])
def test_equals_trl_gkd_loss(beta, temperature, chunk):
    h_s, w_s, h_t, w_t = inputs()
    loss, entropy = linear_jsd(h_s, w_s, h_t, w_t, beta=beta, temperature=temperature,
                               chunk_size=chunk)  # fmt: skip
    g_ours = torch.autograd.grad(loss, (h_s, w_s))
    ref = trl_gkd.GKDTrainer.generalized_jsd_loss(
        (h_s @ w_s.T)[None], (h_t @ w_t.T)[None], labels=torch.zeros(1, N, dtype=torch.long),
        beta=beta, temperature=temperature, reduction="sum",
    )  # fmt: skip
    g_ref = torch.autograd.grad(ref, (h_s, w_s))
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(g_ours, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    p = torch.softmax(h_s.detach() @ w_s.detach().T / temperature, -1)
    torch.testing.assert_close(entropy, -(p * p.log()).sum(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_equals_trl_distillation_trainer_loss(beta):
    """TRL's stable trainer's loss (sum / valid tokens) and its entropy sum."""
    h_s, w_s, h_t, w_t = inputs(1)
    loss, entropy = linear_jsd(h_s, w_s, h_t, w_t, beta=beta, temperature=0.8, chunk_size=5)
    mask = torch.ones(1, N, dtype=torch.long)
    ref, ref_entropy, n = trl_distill._chunked_divergence_loss(
        h_s[None], h_t[None], w_s, w_t, mask, beta, temperature=0.8
    )
    torch.testing.assert_close(loss / N, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(entropy, ref_entropy, rtol=1e-5, atol=1e-5)
    ours = torch.autograd.grad(loss / N, (h_s, w_s))
    for a, b in zip(ours, torch.autograd.grad(ref, (h_s, w_s)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_no_host_sync_and_frozen_student_head():
    h_s, w_s, h_t, w_t = inputs(2)
    w_frozen = w_s.detach()
    with count_syncs() as c:
        loss, _ = linear_jsd(h_s, w_frozen, h_t, w_t, beta=0.5, chunk_size=3)
        loss.backward()
    assert c.total == 0
    assert h_s.grad is not None and w_frozen.grad is None


def test_errors():
    h_s, w_s, h_t, w_t = inputs()
    with pytest.raises(ValueError, match=r"distill.beta = 1.5"):
        linear_jsd(h_s, w_s, h_t, w_t, beta=1.5)
    with pytest.raises(ValueError, match="one vocabulary"):
        linear_jsd(h_s, w_s, h_t, w_t[:-1], beta=0.5)
