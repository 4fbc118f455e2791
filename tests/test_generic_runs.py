"""The generic family (transformers' modeling code) through the rest of the trainer: FSDP2
per decoder layer (the model contract's `decoder_layers()`), 2 gloo ranks (DDP, FSDP2) equal
to one process, exact resume, and regional compile. Tiny OLMo 2 / Mixtral / Qwen3-Next
configs of transformers' own config classes (float32, no network)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers.runs import (
    lora_with_dropout,
    losses,
    make_tiny_type_run,
    one_and_two_rank_runs,
    run_config,
    train_until_signal,
)
from helpers.tiny_hf import quiet as quiet  # noqa: F401 (module fixture)
from helpers.tiny_hf import save_tiny
from helpers.torchrun import free_port

from slipstream import compile as regional
from slipstream.checkpoint.hf import load_model
from slipstream.config import config_from_dict
from slipstream.memory.offload import apply_checkpointing
from slipstream.ops.packing import SeqInfo
from slipstream.peft.lora import apply_lora
from slipstream.train import train


@pytest.fixture(scope="module")
def olmo2_run(tmp_path_factory, quiet):
    """(model folder, train.jsonl): a tiny OLMo 2 (no native family) with a chat tokenizer."""
    return make_tiny_type_run(tmp_path_factory.mktemp("olmo2"), "olmo2")


def _lora_step(model, ids, seq):
    model.zero_grad()
    loss = model.loss(ids, ids, seq, reduction="sum")
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def test_fsdp2_shards_each_transformers_decoder_layer(tmp_path, quiet, monkeypatch):
    """`wrap_model(..., "fsdp")` on a transformers-built model: every decoder layer of the
    contract is its own FSDP2 unit, names are unchanged, and loss and LoRA gradients equal
    the unsharded model's (one gloo rank, in process)."""
    import torch.distributed as tdist
    from torch.distributed.fsdp import FSDPModule

    from slipstream import distributed as sdist

    save_tiny(tmp_path / "ckpt", "olmo2")
    plain, sharded = (load_model(tmp_path / "ckpt") for _ in range(2))
    for m in (plain, sharded):
        torch.manual_seed(1)
        apply_lora(m, rank=4, alpha=8)
    names = [n for n, _ in sharded.named_parameters()]
    ids = torch.randint(3, 96, (21,), generator=torch.Generator().manual_seed(2))
    seq = SeqInfo.from_lengths([7, 11, 3])
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    tdist.init_process_group("gloo", rank=0, world_size=1)
    try:
        sdist.wrap_model(sharded, "fsdp", torch.device("cpu"))
        layers = sharded.decoder_layers()
        assert len(layers) == 2 and all(isinstance(x, FSDPModule) for x in layers)
        assert [n for n, _ in sharded.named_parameters()] == names
        loss, grads = _lora_step(sharded, ids, seq)
        grads = {n: sdist.full_tensor(g) for n, g in grads.items()}
    finally:
        tdist.destroy_process_group()
    want_loss, want = _lora_step(plain, ids, seq)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-5)
    assert grads.keys() == want.keys() and len(want) == 28  # A, B of 7 targets x 2 layers
    for name in want:
        torch.testing.assert_close(grads[name], want[name], rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_two_ranks_match_one_process_on_a_generic_model(olmo2_run, tmp_path):
    """DDP and FSDP2 (2 gloo ranks, grad_accum 2) log the losses and gradient norms and save
    the adapter of one process with grad_accum 4, on a model no native family builds."""
    from safetensors.torch import load_file

    one_and_two_rank_runs(olmo2_run, tmp_path, steps=6, save_every=3)
    single = losses(tmp_path / "single")
    norms = {}
    for name in ("single", "ddp", "fsdp"):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        norms[name] = [r["grad_norm"] for r in map(json.loads, lines) if "grad_norm" in r]
    want = load_file(tmp_path / "single" / "adapter_model.safetensors")
    for mode in ("ddp", "fsdp"):
        got = losses(tmp_path / mode)
        assert sorted(got) == list(range(1, 7))
        assert [got[s] for s in sorted(got)] == pytest.approx(
            [single[s] for s in sorted(single)], abs=1e-5
        )
        assert norms[mode] == pytest.approx(norms["single"], rel=1e-4)
        adapter = load_file(tmp_path / mode / "adapter_model.safetensors")
        assert adapter.keys() == want.keys() and len(want) == 28
        for key in want:
            torch.testing.assert_close(adapter[key], want[key], atol=2e-5, rtol=1e-4)


def test_a_generic_run_resumes_exactly(olmo2_run, tmp_path):
    """4 straight steps == 2 steps, stop, resume from the step-2 checkpoint, 2 more (data
    order, dropout RNG, Adam, schedule) on a transformers-built model."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    kw = dict(steps=4, grad_accum=2, lr=2e-2, save_every=2)
    train(config_from_dict(lora_with_dropout(run_config(olmo2_run, straight, **kw))))
    first = config_from_dict(lora_with_dropout(run_config(olmo2_run, split, **kw)))
    train_until_signal(first, at_step=3)  # stops after step 3; resumes from the step-2 save
    shutil.rmtree(split / "checkpoints" / "step-000003")  # as if killed before that save
    resumed = lora_with_dropout(run_config(olmo2_run, split, **kw))
    summary = train(config_from_dict({**resumed, "resume": True}))
    assert summary["status"] == "completed" and summary["steps"] == 4
    a, b = losses(straight), losses(split)
    assert sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert abs(a[step] - b[step]) < 1e-6, (step, a[step], b[step])
    assert a[4] < a[1] - 0.1  # it trained


@pytest.fixture
def cheap_backend(monkeypatch):
    torch._dynamo.reset()
    monkeypatch.setattr(regional, "BACKEND", "aot_eager")
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize(
    ("model_type", "blocks"),
    [("mixtral", ["layers.0.self_attn", "layers.1.self_attn"]),
     ("qwen3_next", ["layers.1.self_attn"])],
)  # fmt: skip
def test_compile_picks_the_softmax_attention_and_dense_blocks(tmp_path, quiet, model_type, blocks):
    """`train.compile` on a transformers-built model: its softmax-attention blocks and dense
    MLPs compile; MoE blocks (stacked experts) and per-sequence token mixers stay eager
    (Qwen3-Next: linear attention in layer 0, MoE MLPs)."""
    save_tiny(tmp_path / "ckpt", model_type)
    model = load_model(tmp_path / "ckpt")
    assert regional.apply_compile(model, backend="aot_eager") == len(blocks)
    compiled = [n for n, m in model.named_modules() if m._compiled_call_impl is not None]
    assert compiled == [f"model.{b}" for b in blocks]


@pytest.mark.slow
def test_compiled_generic_blocks_match_eager(tmp_path, quiet, cheap_backend):
    """Compiled attention blocks of a transformers-built Mixtral: LoRA loss and grads equal
    eager under checkpointing, and new packed lengths reuse the graphs (dynamic shapes).
    Slow: the first batch compiles for ~35 s on 2 cores."""
    from helpers.models import compiled_graphs

    save_tiny(tmp_path / "ckpt", "mixtral")
    eager, compiled = (load_model(tmp_path / "ckpt") for _ in range(2))
    for m in (eager, compiled):
        torch.manual_seed(1)
        apply_lora(m, rank=4, alpha=8)
        apply_checkpointing(m, "recompute")
    assert regional.apply_compile(compiled) == 2
    graphs_after_first = None
    for i, lengths in enumerate(([5, 9, 3], [17, 4], [3, 3, 3, 3, 11])):
        ids = torch.randint(3, 96, (sum(lengths),), generator=torch.Generator().manual_seed(i))
        seq = SeqInfo.from_lengths(lengths)
        loss, grads = _lora_step(compiled, ids, seq)
        want_loss, want = _lora_step(eager, ids, seq)
        torch.testing.assert_close(loss, want_loss, atol=1e-5, rtol=1e-5)
        assert grads.keys() == want.keys() and grads
        for name in want:
            torch.testing.assert_close(grads[name], want[name], atol=1e-5, rtol=1e-5)
        graphs_after_first = graphs_after_first or compiled_graphs()
    assert 0 < graphs_after_first == compiled_graphs()
