"""Frozen linears packed once for oneDNN (ops/frozen_linear.py) and the oneDNN GEMM helpers
(ops/onednn.py): the same loss and gradients as F.linear, the fallbacks, the memory guard."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.models import make_hf_model, ours_from_hf, randomise_lora_b, shifted_labels
from torch import nn

from slipstream.debug import count_syncs
from slipstream.ops import frozen_linear, onednn
from slipstream.ops.frozen_linear import PrepackedLinear, apply_prepacked_linears
from slipstream.ops.loss import linear_cross_entropy
from slipstream.ops.packing import SeqInfo
from slipstream.peft.lora import apply_lora, merge_lora

pytestmark = pytest.mark.skipif(not onednn.available(), reason="torch built without oneDNN")

LENGTHS = [7, 12, 1, 9]


def _lora_model(dtype=torch.float32, targets=("q_proj", "v_proj", "down_proj"), seed=0):
    torch.manual_seed(seed)
    model = ours_from_hf(make_hf_model("llama", seed=seed)).to(dtype)
    apply_lora(model, rank=4, alpha=8, targets=list(targets))
    randomise_lora_b(model)
    return model


def _loss_and_grads(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (sum(LENGTHS),), generator=g)
    loss = model.loss(ids, shifted_labels(ids, LENGTHS), SeqInfo.from_lengths(LENGTHS))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def test_packed_model_has_the_loss_and_gradients_of_f_linear():
    plain = _lora_model()
    packed = copy.deepcopy(plain)
    count, held = apply_prepacked_linears(packed)
    # 2 layers x 7 linears (targeted bases and untargeted projections); not the LM head.
    assert count == 14 and held > 0
    left = [m for m in packed.modules() if type(m) is nn.Linear]  # the factors and the head
    assert all(m.weight.requires_grad or m is packed.lm_head for m in left)
    assert type(packed.lm_head) is nn.Linear
    assert packed.state_dict().keys() == plain.state_dict().keys()
    loss_a, grads_a = _loss_and_grads(plain)
    loss_b, grads_b = _loss_and_grads(packed)
    torch.testing.assert_close(loss_b, loss_a, atol=1e-6, rtol=1e-6)
    assert grads_a.keys() == grads_b.keys() and any("lora_A" in n for n in grads_a)
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], atol=1e-6, rtol=1e-5, msg=name)


def test_layer_gradient_equals_f_linear_on_odd_shapes():
    g = torch.Generator().manual_seed(1)
    layer = nn.Linear(37, 53, bias=True).requires_grad_(False)
    packed = copy.deepcopy(layer)
    apply_prepacked_linears(packed)
    assert type(packed) is PrepackedLinear
    x = torch.randn(3, 11, 37, generator=g, requires_grad=True)  # a leading batch dim too
    y = torch.randn(3, 11, 53, generator=g)
    (ga,) = torch.autograd.grad((layer(x) * y).sum(), x)
    out = packed(x)
    (gb,) = torch.autograd.grad((out * y).sum(), x)
    torch.testing.assert_close(out, layer(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gb, ga, atol=1e-5, rtol=1e-5)


def test_merge_and_unfreeze_are_seen():
    """merge_lora writes into the packed bases (version counter: repacked); a weight made
    trainable again gets its gradient through F.linear."""
    model = _lora_model(targets=("q_proj",))
    apply_prepacked_linears(model)
    ids = torch.arange(20) % 97
    seq = SeqInfo.from_lengths([20])
    before = model(ids, seq)
    merge_lora(model)
    q = model.model.layers[0].self_attn.q_proj
    assert type(q) is PrepackedLinear
    torch.testing.assert_close(model(ids, seq), before, atol=1e-5, rtol=1e-5)
    q.weight.requires_grad_(True)
    model(ids, seq).sum().backward()
    assert q.weight.grad is not None and q.weight.grad.abs().sum() > 0


def test_nothing_packed_in_bf16_without_onednn_or_memory(monkeypatch):
    assert apply_prepacked_linears(_lora_model(torch.bfloat16)) == (0, 0)
    monkeypatch.setattr(onednn, "free_bytes", lambda: 1000)
    assert apply_prepacked_linears(_lora_model()) == (0, 0)
    monkeypatch.undo()
    monkeypatch.setattr(onednn, "available", lambda: False)
    model = _lora_model()
    assert apply_prepacked_linears(model) == (0, 0)
    assert not any(type(m) is PrepackedLinear for m in model.modules())


def test_subclass_weights_are_not_packed():
    """An FSDP2 shard is a DTensor: packing its local shard would compute the wrong product."""

    class Shard(torch.Tensor):
        pass

    layer = nn.Linear(64, 64)
    layer.weight = nn.Parameter(layer.weight.detach().as_subclass(Shard), requires_grad=False)
    layer.bias.requires_grad_(False)
    assert frozen_linear.frozen_linears(layer) == []


def test_packed_training_step_has_no_sync():
    model = _lora_model()
    apply_prepacked_linears(model)
    ids = torch.arange(sum(LENGTHS)) % 97
    with count_syncs() as c:
        model.loss(ids, shifted_labels(ids, LENGTHS), SeqInfo.from_lengths(LENGTHS)).backward()
    assert c.total == 0, str(c)


@pytest.mark.parametrize("enabled", [True, False])
def test_chunked_head_through_onednn_equals_f_linear(enabled, monkeypatch):
    monkeypatch.setattr(onednn, "ENABLED", enabled)
    g = torch.Generator().manual_seed(2)
    h = torch.randn(23, 40, generator=g, requires_grad=True)
    w = torch.randn(301, 40, generator=g, requires_grad=True)
    y = torch.randint(0, 301, (23,), generator=g)
    y[::5] = -100
    loss = linear_cross_entropy(h, w, y, reduction="sum", chunk_size=7)
    ref = torch.nn.functional.cross_entropy(h @ w.T, y, reduction="sum")
    torch.testing.assert_close(loss, ref, atol=1e-4, rtol=1e-5)
    got = torch.autograd.grad(loss, (h, w))
    want = torch.autograd.grad(ref, (h, w))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("frozen", [True, False])
def test_token_logps_through_onednn_equals_f_linear(frozen, monkeypatch):
    """The log-prob path (DPO, GRPO) takes oneDNN for a frozen head; same values and grads."""
    from slipstream.ops.loss import linear_token_logps

    g = torch.Generator().manual_seed(3)
    h = torch.randn(19, 40, generator=g, requires_grad=True)
    w = torch.randn(301, 40, generator=g).requires_grad_(not frozen)
    y = torch.randint(0, 301, (19,), generator=g)
    calls = []
    real = onednn.pointwise
    monkeypatch.setattr(onednn, "pointwise", lambda *a: calls.append(1) or real(*a))
    got = linear_token_logps(h, w, y, chunk_size=8)  # 3 chunks, each recomputed in backward
    ref = torch.log_softmax(h @ w.T, -1).gather(1, y[:, None])[:, 0]
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    inputs = (h, w) if not frozen else (h,)
    for a, b in zip(torch.autograd.grad(got.sum(), inputs), torch.autograd.grad(ref.sum(), inputs)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert bool(calls) == frozen
