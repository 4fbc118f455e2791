"""DoRA against peft (use_dora=True): logits and gradients both ways through the saved
adapter, LoRA dropout in training, the row-norm identity, merged export, an NF4 base."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.models import make_hf_model, per_sequence_logits, shifted_labels
from peft import LoraConfig, PeftModel, get_peft_model

import slipstream
from slipstream.checkpoint.adapter import load_adapter, save_adapter
from slipstream.ops.packing import SeqInfo
from slipstream.peft.dora import DoRALinear
from slipstream.peft.lora import apply_lora, lora_modules

LENGTHS = [7, 11]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _ids(seed=1):
    return torch.randint(0, 97, (sum(LENGTHS),), generator=torch.Generator().manual_seed(seed))


def _perturb(named_params):
    """Nonzero B and magnitudes off their ‖W‖ init, so every DoRA term is exercised."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in named_params:
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif "lora_magnitude_vector" in name:
                p.mul_(1 + 0.2 * torch.randn(p.shape, generator=g))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("base")
    make_hf_model("qwen3", attention_bias=True).save_pretrained(path)
    return path


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_our_dora_adapter_loads_in_peft_with_same_logits_and_grads(base, tmp_path):
    ours = slipstream.load_model(base)
    apply_lora(ours, rank=4, alpha=8, targets="all-linear", use_dora=True)
    assert all(isinstance(m, DoRALinear) for m in lora_modules(ours).values())
    _perturb(ours.named_parameters())
    save_adapter(ours, tmp_path)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert cfg["use_dora"] is True
    peft_model = PeftModel.from_pretrained(_hf(base), tmp_path, is_trainable=True)
    ids, seq = _ids(), SeqInfo.from_lengths(LENGTHS)
    ref = per_sequence_logits(peft_model, ids, LENGTHS)
    got = ours(ids, seq)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        assert (got - slipstream.load_model(base)(ids, seq)).abs().max() > 1e-2  # DoRA acted

    # Gradients: the norm is a constant in both (DoRA section 4.3), so A, B and m agree.
    labels = shifted_labels(ids, LENGTHS)
    ours.loss(ids, labels, seq, reduction="sum").backward()
    loss = torch.nn.functional.cross_entropy(ref, labels, ignore_index=-100, reduction="sum")
    loss.backward()
    peft_grads = {
        n.replace(".default", ""): p.grad
        for n, p in peft_model.named_parameters()
        if p.requires_grad
    }
    checked = 0
    for name, p in ours.named_parameters():
        if p.requires_grad:
            key = "base_model.model." + name.replace(
                "lora_magnitude_vector", "lora_magnitude_vector.weight"
            )
            torch.testing.assert_close(p.grad, peft_grads[key], atol=1e-4, rtol=1e-4)
            checked += 1
    assert checked == len(peft_grads) and any("magnitude" in k for k in peft_grads)


def test_peft_dora_adapter_loads_here_with_same_logits(base, tmp_path):
    hf = _hf(base)
    peft_model = get_peft_model(
        hf, LoraConfig(r=4, lora_alpha=16, target_modules=TARGETS, use_dora=True)
    )
    _perturb(peft_model.named_parameters())
    peft_model.save_pretrained(tmp_path)
    ours = load_adapter(slipstream.load_model(base), tmp_path)
    ids = _ids(3)
    with torch.no_grad():
        got = ours(ids, SeqInfo.from_lengths(LENGTHS))
        want = per_sequence_logits(peft_model.eval(), ids, LENGTHS)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_dropout_in_training_matches_peft(base, tmp_path):
    """With dropout active PEFT rescales x·Wᵀ of the dropped input: same draws, same logits."""
    ours = slipstream.load_model(base)
    apply_lora(ours, rank=4, alpha=8, dropout=0.3, targets=TARGETS, use_dora=True)
    _perturb(ours.named_parameters())
    save_adapter(ours, tmp_path)
    peft_model = PeftModel.from_pretrained(_hf(base), tmp_path, is_trainable=True).train()
    ours.train()
    ids, n = _ids(4), sum(LENGTHS)
    torch.manual_seed(11)
    got = ours(ids, SeqInfo.from_lengths([n]))
    torch.manual_seed(11)
    ref = peft_model(input_ids=ids[None]).logits[0]
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    torch.manual_seed(12)
    assert (ours(ids, SeqInfo.from_lengths([n])) - got).abs().max() > 1e-3  # dropout did act


@pytest.mark.parametrize("bias", [False, True])
def test_row_norm_equals_the_norm_of_the_adapted_weight(bias):
    torch.manual_seed(0)
    layer = DoRALinear(torch.nn.Linear(37, 23, bias=bias), rank=5, alpha=3.0)
    torch.nn.init.normal_(layer.lora_B.weight)
    adapted = layer.base_layer.weight + layer.scaling * layer.lora_B.weight @ layer.lora_A.weight
    torch.testing.assert_close(layer.row_norm(torch.float32), adapted.norm(dim=1))
    torch.testing.assert_close(layer.lora_magnitude_vector, layer.base_layer.weight.norm(dim=1))


def test_merged_export_loads_in_transformers(base, tmp_path):
    ours = slipstream.load_model(base)
    apply_lora(ours, rank=4, alpha=8, targets="all-linear", use_dora=True)
    _perturb(ours.named_parameters())
    ids, seq = _ids(5), SeqInfo.from_lengths(LENGTHS)
    with torch.no_grad():
        want = ours(ids, seq)
    slipstream.export_merged(ours, tmp_path)
    with torch.no_grad():
        got = per_sequence_logits(_hf(tmp_path), ids, LENGTHS)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_nf4_base_computes_as_its_dequantised_weights(tmp_path):
    pytest.importorskip("bitsandbytes")
    from slipstream.peft.qlora import dequantize_model

    dims = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    make_hf_model("llama", **dims).save_pretrained(tmp_path)
    ours = slipstream.load_model(tmp_path, quantize="nf4")
    apply_lora(ours, rank=4, alpha=8, use_dora=True)
    _perturb(ours.named_parameters())
    ids, seq = _ids(6), SeqInfo.from_lengths(LENGTHS)
    with torch.no_grad():
        got = ours(ids, seq)
        want = dequantize_model(ours)(ids, seq)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_dora_is_refused_on_moe_experts():
    from helpers.models import ours_from_hf
    from helpers.moe_models import make_hf_moe_model

    model = ours_from_hf(make_hf_moe_model("qwen3_moe"))
    with pytest.raises(ValueError, match="DoRA on MoE experts .* is not supported"):
        apply_lora(model, rank=4, alpha=8, targets="all-linear", use_dora=True)
    apply_lora(model, rank=4, alpha=8, targets=["q_proj", "v_proj"], use_dora=True)


def test_trainer_runs_dora_without_host_syncs(tiny_run, tmp_path):
    from helpers.runs import run_config

    from slipstream.config import config_from_dict
    from slipstream.train import train

    raw = run_config(tiny_run, tmp_path / "run", steps=6, lr=2e-2)
    raw["train"]["finetune"] = "lora"
    raw["lora"] = {"rank": 4, "alpha": 8, "use_dora": True}
    summary = train(config_from_dict(raw))
    assert summary["eval_loss_after"] < summary["eval_loss_before"] - 0.3
    saved = json.loads((tmp_path / "run" / "adapter_config.json").read_text())
    assert saved["use_dora"] is True

    model = slipstream.load_model(tiny_run[0])
    load_adapter(model, tmp_path / "run")
    ids = torch.randint(0, 300, (sum(LENGTHS),), generator=torch.Generator().manual_seed(2))
    seq = SeqInfo.from_lengths(LENGTHS)
    with slipstream.count_syncs() as syncs:
        model.loss(ids, shifted_labels(ids, LENGTHS), seq).backward()
    assert syncs.total == 0, str(syncs)
    assert all(m.lora_magnitude_vector.grad is not None for m in lora_modules(model).values())
