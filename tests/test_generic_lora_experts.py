"""Expert LoRA on the generic family: peft's `target_parameters` on transformers' stacked
experts (`gate_up_proj`, `down_proj`), run through slipstream's one-pass routing
(`generic_hooks.one_pass`). Mixtral's packed logits and expert-factor gradients equal peft's
in tests/test_generic.py (its default targets reach the experts); here: the same adapter as
the native family's, our own load and merge, and a shared expert beside the experts."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.models import shifted_labels
from helpers.peft_grads import lora_grads
from helpers.tiny_hf import quiet as quiet  # noqa: F401 (module fixture)
from helpers.tiny_hf import save_tiny

from slipstream.checkpoint.adapter import load_adapter, save_adapter
from slipstream.checkpoint.hf import load_model
from slipstream.models import generic_hooks
from slipstream.ops.packing import SeqInfo
from slipstream.peft.lora import apply_lora, merge_lora
from slipstream.peft.lora_experts import LoRAStackedExperts, expert_lora_modules

LENGTHS = [7, 11, 3]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _batch(seed=1):
    ids = torch.randint(3, 96, (sum(LENGTHS),), generator=torch.Generator().manual_seed(seed))
    return ids, shifted_labels(ids, LENGTHS), SeqInfo.from_lengths(LENGTHS)


def _randomise(model, seed=4):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))


def test_generic_expert_lora_is_the_native_adapter(tmp_path, quiet, monkeypatch):
    """Qwen3-MoE forced through transformers' code: default LoRA reaches the stacked experts
    as natively (the same adapter_config targets and tensor keys), the native adapter loads
    into it with equal logits and loss, the experts still run our one pass (one routing
    plan per MoE layer and forward), and merging folds the experts' factors in."""
    folder = save_tiny(tmp_path / "ckpt", "qwen3_moe")
    native = load_model(folder)
    apply_lora(native, rank=4, alpha=8)
    _randomise(native)
    save_adapter(native, tmp_path / "native")
    generic = load_model(folder, implementation="transformers")
    apply_lora(generic, rank=4, alpha=8)
    save_adapter(generic, tmp_path / "generic")
    configs = [json.loads((tmp_path / d / "adapter_config.json").read_text()) for d in
               ("native", "generic")]  # fmt: skip
    for key in ("target_modules", "target_parameters"):
        assert configs[0][key] == configs[1][key], key
    assert configs[1]["target_parameters"] == EXPERTS
    from safetensors import safe_open

    keys = []
    for d in ("native", "generic"):
        with safe_open(str(tmp_path / d / "adapter_model.safetensors"), "pt") as f:
            keys.append(sorted(f.keys()))
    assert keys[0] == keys[1]

    fresh = load_model(folder, implementation="transformers")
    load_adapter(fresh, tmp_path / "native")
    experts = expert_lora_modules(fresh)
    assert len(experts) == 2 and all(type(m) is LoRAStackedExperts for m in experts.values())
    plans = []
    real_plan = generic_hooks.plan
    monkeypatch.setattr(generic_hooks, "plan", lambda *a: plans.append(1) or real_plan(*a))
    ids, labels, seq = _batch()
    with torch.no_grad():
        want = native(ids, seq)
        got = fresh(ids, seq)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        loss = fresh.loss(ids, labels, seq)
        torch.testing.assert_close(loss, native.loss(ids, labels, seq), atol=1e-6, rtol=1e-6)
    assert len(plans) == 2 * 2  # one per MoE layer and forward (of ours: native has its own)
    base = load_model(folder, implementation="transformers")
    with torch.no_grad():
        assert (base(ids, seq) - want).abs().max() > 1e-2  # the experts' factors matter
        merge_lora(fresh)
        assert not expert_lora_modules(fresh)
        torch.testing.assert_close(fresh(ids, seq), want, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_all_linear_on_a_shared_expert_model_loads_in_peft(tmp_path, quiet):
    """Qwen2-MoE, `all-linear`: the stacked experts and the attention get LoRA, and so does
    the shared expert's one-output gate; the shared expert's gate/up/down_proj do not (peft
    0.21 reads those names as the experts' parameters on transformers' MoE models), so peft
    loads the adapter with our logits and every factor's gradient."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder = save_tiny(tmp_path / "ckpt", "qwen2_moe")
    ours = load_model(folder)
    apply_lora(ours, rank=4, alpha=8, targets="all-linear")
    _randomise(ours)
    save_adapter(ours, tmp_path / "adapter")
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["target_parameters"] == EXPERTS
    assert cfg["target_modules"] == ["k_proj", "o_proj", "q_proj", "shared_expert_gate", "v_proj"]
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(ref, tmp_path / "adapter", is_trainable=True)
    ids, labels, seq = _batch()
    logits = torch.cat([peft_model(input_ids=s[None]).logits[0] for s in ids.split(LENGTHS)])
    keep = labels != -100
    torch.nn.functional.cross_entropy(logits[keep], labels[keep], reduction="sum").backward()
    ours.loss(ids, labels, seq, reduction="sum").backward()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, seq), logits.detach(), atol=1e-4, rtol=1e-4)
    theirs = {n.replace(".default", ""): p.grad for n, p in peft_model.named_parameters()
              if p.requires_grad}  # fmt: skip
    grads = lora_grads(ours)
    assert set(grads) == set(theirs)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, theirs[name], atol=1e-5, rtol=1e-4, msg=name)
