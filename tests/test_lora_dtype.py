"""LoRA on a bf16 base (as on GPU, emulated on CPU): float32 factors that keep small updates,
bf16 matmuls in forward, float32 merge, and float32 adapters that PEFT loads."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers.models import make_hf_model
from helpers.moe_models import make_hf_moe_model
from peft import PeftModel
from safetensors.torch import load_file
from torch import nn

import slipstream
from slipstream.checkpoint.adapter import load_adapter, save_adapter
from slipstream.models.moe_block import moe_blocks
from slipstream.ops import moe as moe_ops
from slipstream.ops.packing import SeqInfo
from slipstream.peft import lora_experts
from slipstream.peft.lora import LoRALinear, apply_lora, lora_modules
from slipstream.peft.lora_experts import expert_lora_modules

BF16 = dict(atol=2e-2, rtol=1.6e-2)  # a few bf16 ulps


def _randomise_b(model: nn.Module, seed: int = 2, std: float = 0.05) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(std * torch.randn(p.shape, generator=gen))


def _hf_llama_bf16():
    return make_hf_model("llama", seed=0).to(torch.bfloat16)


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe")
    make_hf_moe_model("qwen3_moe", seed=3).save_pretrained(path)
    return path


@pytest.mark.parametrize(
    "base_dtype,factor_dtype",
    [
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
        (torch.float32, torch.float32),
        (torch.float64, torch.float64),
    ],
)
def test_factor_dtype_follows_the_base(base_dtype, factor_dtype):
    layer = LoRALinear(nn.Linear(12, 7, dtype=base_dtype), rank=4, alpha=8)
    assert layer.lora_A.weight.dtype == layer.lora_B.weight.dtype == factor_dtype
    assert layer.base_layer.weight.dtype == base_dtype
    explicit = LoRALinear(nn.Linear(12, 7, dtype=base_dtype), rank=4, alpha=8, dtype=base_dtype)
    assert explicit.lora_A.weight.dtype == base_dtype


def test_bf16_models_get_trainable_float32_factors(moe_path):
    dense = apply_lora(_hf_llama_bf16(), rank=4, alpha=8, targets="all-linear")
    moe = apply_lora(slipstream.load_model(moe_path, dtype=torch.bfloat16), rank=4, alpha=8)
    for model in (dense, moe):
        trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
        assert trainable and all("lora_" in n for n in trainable)
        assert {p.dtype for p in trainable.values()} == {torch.float32}
        frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
        assert frozen == {torch.bfloat16}
    assert expert_lora_modules(moe)  # the expert factors are among those checked


@pytest.mark.parametrize("use_rslora,dropout", [(False, 0.0), (True, 0.3)])
def test_bf16_forward_and_grads_match_factors_cast_to_bf16(use_rslora, dropout):
    torch.manual_seed(0)
    layer = LoRALinear(nn.Linear(24, 40, dtype=torch.bfloat16), 4, 8, dropout, use_rslora)
    _randomise_b(layer, std=0.2)
    layer.train()
    x = torch.randn(9, 24, dtype=torch.bfloat16)
    torch.manual_seed(5)  # the same dropout mask in both
    out = layer(x)
    A = layer.lora_A.weight.detach().bfloat16().requires_grad_(True)
    B = layer.lora_B.weight.detach().bfloat16().requires_grad_(True)
    torch.manual_seed(5)
    x_drop = F.dropout(x, dropout, training=True) if dropout else x
    want = layer.base_layer(x) + F.linear(F.linear(x_drop, A), B) * layer.scaling
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, want, **BF16)
    # the LoRA term is visible above the tolerance, so the comparison could fail
    assert (want - layer.base_layer(x)).abs().max() > 0.1
    g = torch.randn_like(out)
    out.backward(g)
    want.backward(g)
    for p, ref in ((layer.lora_A.weight, A), (layer.lora_B.weight, B)):
        assert p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad, ref.grad.float(), **BF16)


def test_small_adamw_update_survives_in_the_factors():
    """lr 1e-5 moves each A entry by ~1e-5: kept in float32, rounded away in bf16."""
    model = apply_lora(_hf_llama_bf16(), rank=4, alpha=8)
    _randomise_b(model)  # so that A gets a gradient
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0, foreach=True)
    q = model.model.layers[0].self_attn.q_proj
    before = q.lora_A.weight.detach().clone()
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    assert opt.state[q.lora_A.weight]["exp_avg_sq"].dtype == torch.float32
    step = q.lora_A.weight.detach() - before
    has_grad = q.lora_A.weight.grad != 0
    assert has_grad.float().mean() > 0.9
    assert (step[has_grad] != 0).all()
    assert step.abs().max() < 2e-5  # a step of about lr
    # The same step on bf16 factors is lost (almost) everywhere: the defect this guards.
    in_bf16 = (before.bfloat16() + step.bfloat16()).float() - before.bfloat16().float()
    assert (in_bf16 == 0).float().mean() > 0.95


def test_bf16_merge_adds_the_float32_delta_then_rounds_once():
    model = apply_lora(_hf_llama_bf16(), rank=4, alpha=8)
    _randomise_b(model)
    expected = {}
    for name, m in lora_modules(model).items():
        delta = m.scaling * (m.lora_B.weight.detach() @ m.lora_A.weight.detach())
        expected[name] = (m.base_layer.weight.float() + delta).bfloat16()
        assert not torch.equal(expected[name], m.base_layer.weight)  # the merge changes it
    slipstream.merge_lora(model)
    for name, want in expected.items():
        got = model.get_submodule(name).weight
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), name


def test_bf16_export_and_expert_merge(moe_path, tmp_path):
    model = slipstream.load_model(moe_path, dtype=torch.bfloat16)
    apply_lora(model, rank=4, alpha=8, targets="all-linear")
    _randomise_b(model)
    expected = {}
    for path, m in expert_lora_modules(model).items():
        for name in m.targets:
            delta = torch.bmm(m.lora_B[name].detach(), m.lora_A[name].detach())
            w = getattr(m.base_layer, name)
            expected[f"{path}.{name}"] = (w.float() + m.scaling[name] * delta).bfloat16()
    for name, m in lora_modules(model).items():
        delta = m.lora_B.weight.detach() @ m.lora_A.weight.detach()
        expected[f"{name}.weight"] = (m.base_layer.weight.float() + m.scaling * delta).bfloat16()
    slipstream.export_merged(model, tmp_path / "merged")  # merges in place, then writes
    assert not expert_lora_modules(model) and not lora_modules(model)
    in_memory = dict(model.named_parameters())
    for name, want in expected.items():
        got = in_memory[name]
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), name
    written = load_file(tmp_path / "merged" / "model.safetensors")  # experts split per expert
    for name, want in expected.items():
        if name.endswith("experts.down_proj"):
            stem = name.removesuffix("down_proj")
            for e in range(want.shape[0]):
                assert torch.equal(written[f"{stem}{e}.down_proj.weight"], want[e]), (name, e)
        elif not name.endswith("gate_up_proj"):
            assert torch.equal(written[name], want), name


@pytest.mark.parametrize("rank,grouped", [(8, True), (4, False)], ids=["grouped", "tiled"])
def test_bf16_expert_delta_runs_bf16_gemms(moe_path, monkeypatch, rank, grouped):
    """The expert GEMMs take the cast (bf16) factors; rank 8 meets torch's grouped GEMM
    alignment in bf16 (16 bytes), rank 4 does not and takes the tiled path. Both equal the
    per-row reference with the factors cast to bf16."""
    model = slipstream.load_model(moe_path, dtype=torch.bfloat16)
    apply_lora(model, rank=rank, alpha=8, targets=["gate_up_proj", "down_proj"])
    _randomise_b(model, std=0.2)
    experts = moe_blocks(model)[0].experts
    seen = []

    def spy(x_RD, w_EDF, offsets_E):
        seen.append((x_RD.dtype, w_EDF.dtype, moe_ops._grouped_mm_supported(x_RD, w_EDF)))
        return moe_ops.grouped_mm(x_RD, w_EDF, offsets_E)

    monkeypatch.setattr(lora_experts, "grouped_mm", spy)
    ids_TK = torch.randint(0, 8, (7, 2), generator=torch.Generator().manual_seed(4))
    routing = moe_ops.plan(ids_TK, 8)
    for name in experts.targets:
        in_f, _ = experts.in_out(name)
        x_RI = torch.randn(14, in_f, generator=torch.Generator().manual_seed(6)).bfloat16()
        got = experts.delta(name, x_RI, routing)
        A, B = experts.lora_A[name].bfloat16().float(), experts.lora_B[name].bfloat16().float()
        e = routing.expert_R
        h = torch.einsum("rji,ri->rj", A[e], x_RI.float()).bfloat16().float()
        want = experts.scaling[name] * torch.einsum("roj,rj->ro", B[e], h)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, **BF16)
        assert want.abs().max() > 0.1
    assert {s[:2] for s in seen} == {(torch.bfloat16, torch.bfloat16)}
    if moe_ops._GROUPED_MM_CPU:
        assert all(s[2] is grouped for s in seen), seen


def test_bf16_adapter_saves_float32_and_loads_in_peft(tmp_path):
    base = _hf_llama_bf16()
    ours = apply_lora(copy.deepcopy(base), rank=4, alpha=8, targets="all-linear")
    _randomise_b(ours)
    with torch.no_grad():  # masters that bf16 cannot hold, so the saved dtype matters
        for m in lora_modules(ours).values():
            m.lora_A.weight.add_(1e-5)
    save_adapter(ours, tmp_path)
    saved = load_file(tmp_path / "adapter_model.safetensors")
    assert {t.dtype for t in saved.values()} == {torch.float32}
    q = ours.model.layers[0].self_attn.q_proj
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert torch.equal(saved[key], q.lora_A.weight.detach())

    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = ours(input_ids=ids).logits
        assert (logits - base(input_ids=ids).logits).abs().max() > 0.1  # the adapter matters
        # PEFT's default: float32 adapters on the bf16 base, its LoRA matmuls in float32.
        peft32 = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path).eval()
        peft_dtypes = {p.dtype for n, p in peft32.named_parameters() if "lora_" in n}
        assert peft_dtypes == {torch.float32}
        torch.testing.assert_close(peft32(input_ids=ids).logits, logits, **BF16)
        # bf16 adapters in PEFT: the same bf16 matmuls as ours, so equal to well within 1e-3
        # (LoRA matmuls in float32, as PEFT's default above, differ by ~4e-3 here).
        peft16 = PeftModel.from_pretrained(
            copy.deepcopy(base), tmp_path, autocast_adapter_dtype=False
        ).eval()
        torch.testing.assert_close(peft16(input_ids=ids).logits, logits, atol=1e-3, rtol=1e-3)

        again = load_adapter(copy.deepcopy(base), tmp_path)  # into float32 factors, exactly
        q2 = again.model.layers[0].self_attn.q_proj
        assert q2.lora_A.weight.dtype == torch.float32
        assert torch.equal(q2.lora_A.weight, q.lora_A.weight)
        assert torch.equal(again(input_ids=ids).logits, logits)


def test_bf16_expert_adapter_round_trip(moe_path, tmp_path):
    model = slipstream.load_model(moe_path, dtype=torch.bfloat16)
    apply_lora(model, rank=4, alpha=8, targets=["q_proj", "gate_up_proj", "down_proj"])
    _randomise_b(model)
    save_adapter(model, tmp_path)
    saved = load_file(tmp_path / "adapter_model.safetensors")
    assert {t.dtype for t in saved.values()} == {torch.float32}
    again = load_adapter(slipstream.load_model(moe_path, dtype=torch.bfloat16), tmp_path)
    mine = {n: p for n, p in model.named_parameters() if p.requires_grad}
    theirs = {n: p for n, p in again.named_parameters() if p.requires_grad}
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[n], theirs[n]) for n in mine)
    ids, seq = torch.randint(0, 97, (10,)), SeqInfo.from_lengths([6, 4])
    with torch.no_grad():
        assert torch.equal(model(ids, seq), again(ids, seq))
