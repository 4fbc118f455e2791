"""LoRA on stacked experts through the one LoRA API (`apply_lora`, `save_adapter`,
`load_adapter`, `merge_lora`): PEFT `target_parameters` round trip (logits and gradients equal
PEFT's on the transformers model), our own load, merge, target resolution on MoE models, and
per-expert gradient coverage."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.models import shifted_labels
from helpers.moe_models import make_hf_moe_model

import slipstream
from slipstream.checkpoint.adapter import load_adapter, save_adapter
from slipstream.models.moe_block import moe_blocks
from slipstream.ops.packing import SeqInfo
from slipstream.peft import lora
from slipstream.peft.lora import apply_lora, merge_lora
from slipstream.peft.lora_experts import LoRAExperts, expert_lora_modules, expert_lora_tensors
from slipstream.peft.names import ADAPTER_CONFIG

FAMILIES = ["qwen3_moe", "gpt_oss"]


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed))


def _randomise_lora(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_hf_moe_model(request.param, seed=3).save_pretrained(path)
    return request.param, path


EXPERTS = ["gate_up_proj", "down_proj"]
TARGETS = {
    "attn+experts": ["q_proj", "v_proj", *EXPERTS],
    "experts-only": EXPERTS,
    "all-linear": "all-linear",
}


def _with_lora(path, targets, rank: int = 4):
    model = slipstream.load_model(path)
    apply_lora(model, rank=rank, alpha=2 * rank, targets=targets)
    _randomise_lora(model, seed=4)
    return model


@pytest.mark.parametrize("targets", TARGETS.values(), ids=TARGETS.keys())
def test_adapter_loads_in_peft_with_same_logits_and_grads(checkpoint, tmp_path, targets):
    import peft

    family, path = checkpoint
    ours = _with_lora(path, targets)
    save_adapter(ours, tmp_path)
    saved = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
    assert saved["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    hf = make_hf_moe_model(family, seed=3)
    pm = peft.PeftModel.from_pretrained(hf, tmp_path, is_trainable=True)
    ids = _ids(12, 5)
    ref = pm(input_ids=ids[None], labels=ids[None])
    loss = ours.loss(ids, shifted_labels(ids, [12]), SeqInfo.from_lengths([12]))
    with torch.no_grad():
        logits = ours(ids, SeqInfo.from_lengths([12]))
    torch.testing.assert_close(logits, ref.logits[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(loss, ref.loss, atol=1e-5, rtol=1e-5)
    # gradients: ours written in PEFT's layout (by loading the grads as the factors)
    ref.loss.backward()
    loss.backward()
    peft_grads = {
        n.replace(".default", ""): p.grad for n, p in pm.named_parameters() if "lora_" in n
    }
    linear_grads = {
        f"base_model.model.{n}": p.grad
        for n, p in ours.named_parameters()
        if "lora_" in n and ".experts." not in n
    }
    with torch.no_grad():
        for m in expert_lora_modules(ours).values():
            for p in [*m.lora_A.values(), *m.lora_B.values()]:
                p.copy_(p.grad)
    ours_grads = {**expert_lora_tensors(ours), **linear_grads}
    assert set(ours_grads) == set(peft_grads)
    for key, g in ours_grads.items():
        torch.testing.assert_close(g, peft_grads[key], atol=1e-5, rtol=1e-4, msg=key)


def test_own_load_and_merge_give_the_same_logits(checkpoint, tmp_path):
    _, path = checkpoint
    ours = _with_lora(path, TARGETS["attn+experts"])
    save_adapter(ours, tmp_path)
    ids, seq = _ids(10, 6), SeqInfo.from_lengths([6, 4])
    with torch.no_grad():
        ref = ours(ids, seq)
        again = load_adapter(slipstream.load_model(path), tmp_path)
        torch.testing.assert_close(again(ids, seq), ref, atol=1e-6, rtol=1e-6)
        base = slipstream.load_model(path)(ids, seq)
        assert (base - ref).abs().max() > 1e-3  # the adapter does change the outputs
        merged = merge_lora(again)
        assert not expert_lora_modules(merged) and merged.lora_config is None
        torch.testing.assert_close(merged(ids, seq), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rank", [3, 4], ids=["tiled-gemm", "grouped-gemm"])
@pytest.mark.parametrize("random_b", [False, True], ids=["init", "trained"])
def test_every_expert_with_tokens_gets_grad_and_only_those(checkpoint, rank, random_b):
    _, path = checkpoint
    model = slipstream.load_model(path)
    apply_lora(model, rank=rank, alpha=8, targets=EXPERTS)
    if random_b:
        _randomise_lora(model, seed=7)
    counts = {}  # each block's per-expert row counts: row 0 of the router stats it returns
    for block in moe_blocks(model):
        block.register_forward_hook(lambda m, _, out: counts.__setitem__(m, out[1][0]))
    ids = _ids(3, 8)  # 3 tokens x top-2 of 8 experts: some experts get no rows
    labels = _ids(3, 9)  # every position labelled, so every routed row carries a gradient
    model.loss(ids, labels, SeqInfo.from_lengths([3])).backward()
    seen_idle = False
    for block in moe_blocks(model):
        got_rows = counts[block] > 0
        seen_idle |= bool((~got_rows).any())
        experts = block.experts
        assert isinstance(experts, LoRAExperts)
        for name in experts.targets:
            grad_B = experts.lora_B[name].grad.abs().sum(dim=(1, 2))
            grad_A = experts.lora_A[name].grad.abs().sum(dim=(1, 2))
            assert torch.equal(grad_B > 0, got_rows), name
            # with B = 0 (PEFT's init) dL/dA = 0 everywhere; once B moves, A follows B
            assert torch.equal(grad_A > 0, got_rows if random_b else torch.zeros_like(got_rows))
    assert seen_idle, "the test needs an expert with no rows"
    frozen = [n for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n]
    assert not frozen


def test_targets_on_moe_models(tmp_path):
    """all-linear: every nn.Linear but lm_head (routers are not nn.Linear) plus both expert
    parameters; the default's dense MLP names reach the experts, and dense layers as well."""
    make_hf_moe_model("qwen3_moe", seed=3, mlp_only_layers=[0]).save_pretrained(tmp_path)
    model = apply_lora(slipstream.load_model(tmp_path), rank=2, alpha=4, targets="all-linear")
    wrapped = sorted(lora.lora_modules(model))
    attn = [f"self_attn.{m}_proj" for m in "qkvo"]
    dense_mlp = [f"mlp.{m}_proj" for m in ["gate", "up", "down"]]
    assert wrapped == sorted(
        [f"model.layers.{i}.{m}" for i in range(2) for m in attn]
        + [f"model.layers.0.{m}" for m in dense_mlp]
    )
    assert list(expert_lora_modules(model)) == ["model.layers.1.mlp.experts"]
    assert expert_lora_modules(model)["model.layers.1.mlp.experts"].targets == tuple(EXPERTS)
    assert not any("gate." in n for n, p in model.named_parameters() if p.requires_grad)

    model = apply_lora(slipstream.load_model(tmp_path), rank=2, alpha=4)  # default targets
    cfg = model.lora_config
    assert cfg["target_modules"] == sorted(lora.DEFAULT_TARGETS)  # layer 0 is dense
    assert cfg["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    model = apply_lora(slipstream.load_model(tmp_path), rank=2, alpha=4, targets=["up_proj"])
    assert model.lora_config["target_parameters"] == ["mlp.experts.gate_up_proj"]
    assert list(lora.lora_modules(model)) == ["model.layers.0.mlp.up_proj"]


def test_default_targets_on_a_pure_moe_model(checkpoint):
    """No dense MLP at all: the default's gate/up/down names go to the experts, no error."""
    _, path = checkpoint
    cfg = apply_lora(slipstream.load_model(path), rank=2, alpha=4).lora_config
    assert cfg["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert cfg["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def test_user_errors(checkpoint, tmp_path):
    _, path = checkpoint
    model = slipstream.load_model(path)
    with pytest.raises(ValueError, match=r"dropout=0.1 is not supported on MoE experts"):
        apply_lora(model, dropout=0.1, targets="all-linear")
    with pytest.raises(ValueError, match=r"\['gate_proj_x'\] match no.*MoE expert names"):
        apply_lora(model, targets=["q_proj", "gate_proj_x"])
    apply_lora(model, rank=4, alpha=8, targets=["q_proj", "down_proj"])
    with pytest.raises(ValueError, match="already applied"):
        apply_lora(model, rank=4, alpha=8, targets=EXPERTS)
    save_adapter(model, tmp_path)
    dense = slipstream.load_model(path)
    for block in moe_blocks(dense):  # a model without MoE blocks or stacked experts
        block.__class__ = block.experts.__class__ = torch.nn.Module
    with pytest.raises(ValueError, match="need a MoE model"):
        load_adapter(dense, tmp_path)
    with pytest.raises(ValueError, match=r"\['gate_up_proj'\] match no nn.Linear"):
        apply_lora(dense, targets=["gate_up_proj"])
    assert apply_lora(dense, dropout=0.1, targets=["q_proj"]).lora_config["lora_dropout"] == 0.1
    # a PEFT adapter with a bad target_parameters entry: one line naming the file
    cfg = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
    cfg["target_parameters"] = ["mlp.experts.up_proj"]
    (tmp_path / ADAPTER_CONFIG).write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="adapter_config.json: target_parameters"):
        load_adapter(slipstream.load_model(path), tmp_path)
