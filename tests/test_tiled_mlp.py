"""Tiled MLP: the loss and every gradient equal the untiled step's (1e-6 relative), dense and
MoE, with and without layer checkpointing, and its (T, F) intermediates are never whole."""

from __future__ import annotations

import pytest
import torch
from helpers.models import make_hf_model, ours_from_hf, randomise_lora_b, shifted_labels
from helpers.moe_models import make_hf_moe_model

from slipstream.memory.offload import apply_checkpointing
from slipstream.memory.tiled_mlp import apply_mlp_tiling, mlp_tiles, tile_module, tiled_call
from slipstream.memory.tracker import LiveTensors
from slipstream.models.moe_block import set_router_aux_loss_coef
from slipstream.ops.packing import SeqInfo
from slipstream.peft.lora import apply_lora

LENGTHS = [13, 5, 22, 1, 9]


def _model(kind: str, lora: bool):
    if kind == "dense":
        model = ours_from_hf(make_hf_model("llama", num_hidden_layers=3))
    else:
        model = ours_from_hf(make_hf_moe_model(kind, num_hidden_layers=2))
        set_router_aux_loss_coef(model, 0.01)  # the router statistics get a gradient too
    if lora:
        apply_lora(model, rank=4, alpha=8, targets="all-linear")
        randomise_lora_b(model)
    else:
        model.requires_grad_(True)
    return model


def _step(model, ids, labels, seq):
    model.zero_grad(set_to_none=True)
    loss = model.loss(ids, labels, seq, reduction="sum")
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads


def _assert_close_rel(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    # Relative error in the Frobenius norm: float32 sums over tiles in another order.
    assert ((a - b).norm() / b.norm().clamp_min(1e-30)).item() <= 1e-6, what


@pytest.mark.parametrize("kind", ["dense", "qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("mode", ["none", "recompute", "offload"])
@pytest.mark.parametrize("lora", [True, False])
def test_tiled_equals_untiled(kind, mode, lora):
    model = _model(kind, lora)
    torch.manual_seed(1)
    ids = torch.randint(0, 97, (sum(LENGTHS),))
    labels, seq = shifted_labels(ids, LENGTHS), SeqInfo.from_lengths(LENGTHS)
    if mode != "none":
        apply_checkpointing(model, mode, force=True, min_offload_bytes=0)
    ref_loss, ref = _step(model, ids, labels, seq)
    assert apply_mlp_tiling(model, 4) == len(model.model.layers) and mlp_tiles(model) == 4
    loss, grads = _step(model, ids, labels, seq)
    _assert_close_rel(loss, ref_loss, "loss")
    assert grads.keys() == ref.keys()
    for name in ref:
        _assert_close_rel(grads[name], ref[name], name)
    names = [n for n, _ in model.named_parameters()]
    apply_mlp_tiling(model, None)  # undone: the same names, the plain class back
    assert mlp_tiles(model) == 1 and [n for n, _ in model.named_parameters()] == names


def test_tiles_need_not_divide_and_more_tiles_than_tokens():
    mlp = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.GELU(), torch.nn.Linear(10, 6))
    x = torch.randn(2, 7, 6, requires_grad=True)  # (B, S, D): the generic path's layout
    ref = mlp(x)
    tile_module(mlp, 3, token_dim=1)
    torch.testing.assert_close(mlp(x), ref, rtol=0, atol=1e-6)
    assert tiled_call(lambda t: t * 2, x, 50, token_dim=1).shape == x.shape
    with torch.no_grad():
        torch.testing.assert_close(mlp(x), ref, rtol=0, atol=1e-6)


def test_mlp_intermediates_are_tiled():
    """The peak of a dense MLP's forward + backward (live tensors) drops with the tile count:
    4 (T, F) intermediates whole at tiles=1, a quarter of them at tiles=4."""
    T, D, F = 2048, 48, 512
    gated = ours_from_hf(make_hf_model("llama", hidden_size=D, intermediate_size=F)).model
    mlp = gated.layers[0].mlp.requires_grad_(False)
    x = torch.randn(T, D, requires_grad=True)

    def peak(tiles: int) -> int:
        tile_module(mlp, tiles)
        with LiveTensors() as live:
            mlp(x).sum().backward()
        return live.peak - live.start

    untiled, tiled = peak(1), peak(4)
    intermediates = 4 * T * F * 4  # gate, up, act(gate), act * up in float32
    assert untiled > intermediates
    assert untiled - tiled > 0.6 * intermediates
