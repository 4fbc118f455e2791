"""Regional torch.compile (slipstream/compile.py), on CPU with the aot_eager backend: dynamo
and AOTAutograd as on a GPU, without inductor's minutes of C++ builds on 2 cores."""

from __future__ import annotations

import pytest
import torch
from helpers.models import compiled_graphs, make_hf_model, ours_from_hf
from helpers.moe_models import make_hf_moe_model
from helpers.runs import losses, run_config

import slipstream
from slipstream import compile as regional
from slipstream.config import config_from_dict
from slipstream.memory.offload import apply_checkpointing
from slipstream.ops.packing import SeqInfo
from slipstream.train import train


@pytest.fixture(autouse=True)
def cheap_backend(monkeypatch):
    torch._dynamo.reset()
    monkeypatch.setattr(regional, "BACKEND", "aot_eager")
    yield
    torch._dynamo.reset()


def _grads(model, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (sum(lengths),), generator=g)
    loss = model.loss(ids, ids, SeqInfo.from_lengths(lengths), reduction="sum")
    params = [p for p in model.parameters() if p.requires_grad]
    return loss, torch.autograd.grad(loss, params)


def _assert_matches_eager_without_recompiling(compiled, eager):
    """Loss and grads equal over three batches of new lengths; the first batch's graphs serve
    the other two (dynamic shapes)."""
    graphs_after_first = None
    for i, lengths in enumerate(([5, 9, 2], [17, 4], [3, 3, 3, 3, 11])):
        loss, grads = _grads(compiled, lengths, seed=i)
        ref_loss, ref_grads = _grads(eager, lengths, seed=i)
        torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
        graphs_after_first = graphs_after_first or compiled_graphs()
    assert 0 < graphs_after_first == compiled_graphs()


@pytest.mark.parametrize("mode", [pytest.param("recompute", marks=pytest.mark.slow), "offload"])
def test_compiled_blocks_match_eager_without_recompiling_per_batch(mode):
    """LoRA + checkpointing (offload's schedule forced on CPU) + compiled blocks: the same
    loss and grads as eager, and batches of new lengths reuse the graphs (dynamic shapes)."""
    hf_model = make_hf_model("qwen3", num_hidden_layers=3)
    eager, compiled = ours_from_hf(hf_model), ours_from_hf(hf_model)
    for m in (eager, compiled):
        slipstream.apply_lora(m, rank=4, alpha=8, targets="all-linear")
        m.load_state_dict(eager.state_dict())
        apply_checkpointing(m, mode, force=True)
    assert regional.apply_compile(compiled) == 6
    _assert_matches_eager_without_recompiling(compiled, eager)


def test_moe_layers_compile_attention_only():
    model = ours_from_hf(make_hf_moe_model("qwen3_moe"))
    assert regional.apply_compile(model) == len(model.model.layers)  # self_attn alone


def test_trainer_compile_option_keeps_the_losses(tiny_run, tmp_path):
    outs, graphs = {}, {}
    for flag in (False, True):
        raw = run_config(tiny_run, tmp_path / str(flag), steps=3)
        raw["train"].update(compile=flag, activation_checkpointing="recompute")
        before = compiled_graphs()
        train(config_from_dict(raw))
        outs[flag], graphs[flag] = losses(tmp_path / str(flag)), compiled_graphs() - before
    assert graphs[False] == 0 and graphs[True] > 0  # the option did compile the blocks
    assert outs[True] == pytest.approx(outs[False], abs=1e-5)


@pytest.mark.parametrize("family", ["qwen3", pytest.param("gpt_oss", marks=pytest.mark.slow)])
def test_sliding_and_full_layers_share_the_compiled_attention(family):
    """The window is read outside the compiled graph: alternating sliding/full layers compile
    no more graphs than a model whose layers all attend fully (before: one variant each)."""
    graphs = {}
    for windowed in (False, True):
        torch._dynamo.reset()
        types = ["sliding_attention", "full_attention"] * 2 if windowed else ["full_attention"] * 4
        if family == "qwen3":
            hf = make_hf_model(family, num_hidden_layers=4, use_sliding_window=True,
                               sliding_window=4, layer_types=types)  # fmt: skip
        else:
            hf = make_hf_moe_model(family, num_hidden_layers=4, sliding_window=4, layer_types=types)
        model = ours_from_hf(hf)
        windows = {layer.self_attn.window for layer in model.model.layers}
        assert windows == ({4, None} if windowed else {None})
        slipstream.apply_lora(model, rank=4, alpha=8, targets=["q_proj", "v_proj"])
        regional.apply_compile(model)
        before = compiled_graphs()
        _grads(model, [9, 5], seed=0)
        graphs[windowed] = compiled_graphs() - before
    assert graphs[True] == graphs[False] > 0


@pytest.mark.slow  # ~17 s of compiling
def test_tiled_mlp_under_compile_matches_eager():
    """train.mlp_tiles with train.compile: the compiled tiled MLP (each tile checkpointed
    inside the compiled region) gives eager's tiled loss and gradients, lengths changing
    without a recompile."""
    from slipstream.memory.tiled_mlp import apply_mlp_tiling

    hf_model = make_hf_model("llama", num_hidden_layers=2)
    eager, compiled = ours_from_hf(hf_model), ours_from_hf(hf_model)
    for m in (eager, compiled):
        slipstream.apply_lora(m, rank=4, alpha=8, targets="all-linear")
        m.load_state_dict(eager.state_dict())
        apply_mlp_tiling(m, 3)
        apply_checkpointing(m, "recompute", force=True)
    assert regional.apply_compile(compiled) == 4
    _assert_matches_eager_without_recompiling(compiled, eager)
