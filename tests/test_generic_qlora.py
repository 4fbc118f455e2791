"""QLoRA on the generic family (models/generic_nf4.py): transformers' own bitsandbytes loader
quantises the decoder layers' linears as native QLoRA does, checked against native NF4,
transformers + bitsandbytes and peft (float32 compute, CPU, tiny random configs)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.models import shifted_labels
from helpers.tiny_hf import quiet as quiet  # noqa: F401 (module fixture)
from helpers.tiny_hf import save_tiny

from slipstream.checkpoint.adapter import save_adapter
from slipstream.checkpoint.hf import load_model
from slipstream.ops.packing import SeqInfo
from slipstream.peft.lora import apply_lora

bnb = pytest.importorskip("bitsandbytes")

LENGTHS = [9, 14, 5]
SIZES = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
             shared_expert_intermediate_size=64)  # fmt: skip


def _batch(seed=1):
    ids = torch.randint(3, 96, (sum(LENGTHS),), generator=torch.Generator().manual_seed(seed))
    return ids, shifted_labels(ids, LENGTHS), SeqInfo.from_lengths(LENGTHS)


def _nf4_names(model) -> list[str]:
    return sorted(n for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit))


def test_generic_nf4_is_native_nf4(tmp_path, quiet):
    """Llama through transformers' code with quantize="nf4": the same linears are NF4 (the
    decoder projections; not the head), holding the same bits, so the logits are native
    QLoRA's; a shared expert's one-output gate (a router) stays full precision."""
    save_tiny(tmp_path / "llama", "llama", **SIZES)
    native = load_model(tmp_path / "llama", quantize="nf4")
    generic = load_model(tmp_path / "llama", quantize="nf4", implementation="transformers")
    assert type(generic).__name__ == "GenericCausalLM"
    assert _nf4_names(generic) == _nf4_names(native) and len(_nf4_names(native)) == 14
    a, b = dict(native.named_parameters()), dict(generic.named_parameters())
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        assert torch.equal(a[name], b[name])  # packed uint8
    ids, _, seq = _batch()
    with torch.no_grad():
        torch.testing.assert_close(generic(ids, seq), native(ids, seq), atol=1e-6, rtol=1e-6)
    save_tiny(tmp_path / "moe", "qwen2_moe", **SIZES)
    moe = load_model(tmp_path / "moe", quantize="nf4")
    names = _nf4_names(moe)
    assert "model.layers.0.mlp.shared_expert.down_proj" in names
    assert not [n for n in names if n.endswith("gate")] and "lm_head" not in names
    assert moe.get_submodule("model.layers.0.mlp.experts").gate_up_proj.dtype == torch.float32


def _hf_nf4(folder, model):
    """transformers + bitsandbytes with native QLoRA's settings and the same full-precision
    modules as ours (its defaults would quantise the routers' linears too)."""
    import transformers

    skip = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    qc = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32, llm_int8_skip_modules=skip,
    )  # fmt: skip
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=qc, device_map="cpu", dtype=torch.float32
    )
    for m in hf.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = False
    return hf


@pytest.mark.parametrize("model_type", ["olmo2", pytest.param("qwen2_moe", marks=pytest.mark.slow)])
def test_qlora_adapter_of_a_generic_model_loads_in_peft(tmp_path, quiet, model_type):
    """Three QLoRA steps on a model with no native family: only the factors move, the
    adapter loads in peft on transformers' NF4 model with our packed logits and LoRA
    gradients (per sequence there), and the merged export (dequantised) loads in
    transformers."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from slipstream.checkpoint.export import export_merged

    folder = save_tiny(tmp_path / "ckpt", model_type, **SIZES)
    model = load_model(folder, quantize="nf4")
    apply_lora(model, rank=4, alpha=8)
    frozen = {n: p.clone() for n, p in model.named_parameters() if not p.requires_grad}
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    ids, labels, seq = _batch()
    for _ in range(3):
        opt.zero_grad()
        model.loss(ids, labels, seq).backward()
        opt.step()
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    save_adapter(model, tmp_path / "adapter")
    ids2, labels2, _ = _batch(seed=5)
    model.zero_grad()
    loss = model.loss(ids2, labels2, seq, reduction="sum")
    loss.backward()
    with torch.no_grad():
        ours = model(ids2, seq)
    ref = PeftModel.from_pretrained(_hf_nf4(folder, model), tmp_path / "adapter", is_trainable=True)
    assert _nf4_names(ref.base_model.model) == _nf4_names(model)
    parts = [ref(input_ids=s[None]).logits[0] for s in ids2.split(LENGTHS)]
    logits = torch.cat(parts)
    keep = labels2 != -100
    ref_loss = torch.nn.functional.cross_entropy(logits[keep], labels2[keep], reduction="sum")
    ref_loss.backward()
    torch.testing.assert_close(ours, logits.detach(), atol=1e-4, rtol=1e-4)
    assert abs(loss.item() - ref_loss.item()) <= 1e-4 * abs(ref_loss.item())
    theirs = {n.replace(".default", ""): p.grad for n, p in ref.named_parameters()}
    grads = {f"base_model.model.{n}": p.grad for n, p in model.named_parameters() if "lora_" in n}
    assert grads and set(grads) <= set(theirs)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, theirs[name], atol=1e-5, rtol=1e-4)
    export_merged(model, tmp_path / "merged")
    cfg = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert "quantization_config" not in cfg
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        got = torch.cat([merged(input_ids=s[None]).logits[0] for s in ids2.split(LENGTHS)])
    torch.testing.assert_close(got, ours, atol=1e-4, rtol=1e-4)
