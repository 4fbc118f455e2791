"""Tiled MLP: the loss and every gradient equal the untiled step's (1e-6 relative), dense and
MoE, with and without layer checkpointing, and its (T, F) intermediates are never whole."""

from __future__ import annotations

import pytest
import torch
from helpers.models import make_hf_model, ours_from_hf, randomise_lora_b, shifted_labels
from helpers.moe_models import make_hf_moe_model
from helpers.tiny_hf import quiet, save_tiny  # noqa: F401

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


# The generic path: transformers' layers, their feed-forward blocks over (1, T, D). Dense
# (olmo2), MoE with the router loss on (mixtral), a MoE block returning per-token router
# scores beside its output (gpt_oss forced generic) and a dense-then-MoE stack (deepseek_v3).
GENERIC = ["olmo2", "mixtral", "gpt_oss", "deepseek_v3"]


@pytest.mark.parametrize("model_type", GENERIC)
@pytest.mark.parametrize("mode", ["none", "recompute"])
def test_generic_tiled_equals_untiled(tmp_path, quiet, model_type, mode):  # noqa: F811
    from slipstream.checkpoint.hf import load_model

    save_tiny(tmp_path / "ckpt", model_type, num_hidden_layers=2)
    model = load_model(tmp_path / "ckpt", implementation="transformers")
    if getattr(model, "router_loss", None) is not None:
        set_router_aux_loss_coef(model, 0.01)
        assert model.router_aux_loss_coef == 0.01
    apply_lora(model, rank=4, alpha=8, targets="all-linear")
    randomise_lora_b(model)
    torch.manual_seed(1)
    ids = torch.randint(3, 96, (sum(LENGTHS),))
    labels, seq = shifted_labels(ids, LENGTHS), SeqInfo.from_lengths(LENGTHS)
    if mode != "none":
        apply_checkpointing(model, mode, force=True)
    ref_loss, ref = _step(model, ids, labels, seq)
    assert apply_mlp_tiling(model, 4) == len(model.decoder_layers()) and mlp_tiles(model) == 4
    loss, grads = _step(model, ids, labels, seq)
    _assert_close_rel(loss, ref_loss, "loss")
    assert grads.keys() == ref.keys() and ref
    for name in ref:
        _assert_close_rel(grads[name], ref[name], name)
    assert _block_calls(model, ids, seq) == [4] * len(model.decoder_layers())  # 4 tiles ran
    apply_mlp_tiling(model, None)
    assert mlp_tiles(model) == 1 and _block_calls(model, ids, seq) == [1] * len(
        model.decoder_layers()
    )


def _block_calls(model, ids, seq) -> list[int]:
    """How often each layer's feed-forward block's first submodule ran in one forward."""
    from slipstream.memory.tiled_mlp import feed_forward_of

    layers = model.decoder_layers()
    calls = [0] * len(layers)

    def counter(i):
        return lambda *_: calls.__setitem__(i, calls[i] + 1)

    hooks = [
        next(feed_forward_of(layer).children()).register_forward_hook(counter(i))
        for i, layer in enumerate(layers)
    ]
    with torch.no_grad():
        model(ids, seq)
    for h in hooks:
        h.remove()
    return calls


def test_tiled_extras_are_summed_or_concatenated():
    x = torch.randn(1, 10, 3)

    def block(t):  # an output and a per-token extra (tokens, E): transformers' router logits
        return t * 2, t[0] @ torch.ones(3, 4)

    y, per_token = tiled_call(block, x, 3, token_dim=1, extras="cat")
    torch.testing.assert_close(y, x * 2)
    assert per_token.shape == (10, 4)
    torch.testing.assert_close(per_token, x[0] @ torch.ones(3, 4))
    _, total = tiled_call(lambda t: (t, t.sum()), x, 3, token_dim=1)  # ours: sums over tokens
    torch.testing.assert_close(total, x.sum())
