"""The decode-speed path of generation on CPU gives the plain path's numbers: linear layers and
the LM head on prepacked (oneDNN) weights equal F.linear to float32 rounding, the modules are
restored afterwards, and greedy generation through them equals transformers' `generate`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.models import make_hf_model
from torch import nn

import slipstream
from slipstream.generation import packed_linear
from slipstream.generation.packed_linear import linear, pack, packed_linears

pytestmark = pytest.mark.skipif(not packed_linear.available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("rows", [1, 2, 16, 40])
@pytest.mark.parametrize("shape", [(129, 72), (1536, 576), (49152, 64)])
def test_packed_linear_equals_f_linear(rows, shape):
    g = torch.Generator().manual_seed(rows)
    W_OI, b_O = torch.randn(*shape, generator=g), torch.randn(shape[0], generator=g)
    x_BI = torch.randn(rows, shape[1], generator=g)
    packed = pack(W_OI, 16)  # packed for 16 rows, used at every row count
    for bias in (None, b_O):
        got = linear(x_BI, W_OI, packed, bias)
        want = F.linear(x_BI, W_OI, bias)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * shape[1] ** 0.5)


def test_modules_are_packed_inside_and_restored_after():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(5, 8)
    want = model(x)
    with torch.no_grad(), packed_linears(model, model[2].weight, 5) as head:
        assert all("forward" in vars(m) for m in (model[0], model[2]))
        torch.testing.assert_close(model(x), want)
        h = torch.ones(3, 16)
        torch.testing.assert_close(head(h), F.linear(h, model[2].weight))
    assert not any("forward" in vars(m) for m in model)
    with packed_linears(model, model[2].weight, 5):  # grad enabled: nothing is swapped
        assert not any("forward" in vars(m) for m in model)


def test_no_packing_when_the_copy_would_not_fit(monkeypatch):
    monkeypatch.setattr(packed_linear, "_free_bytes", lambda: 1000)
    model = nn.Linear(64, 64)
    with torch.no_grad(), packed_linears(model, model.weight, 4):
        assert "forward" not in vars(model)
    monkeypatch.undo()
    with torch.no_grad(), packed_linears(model, model.weight, 4):
        assert "forward" in vars(model)


def test_one_row_packs_only_big_weights():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, packed_linear.SMALL_WEIGHT // 64))
    with torch.no_grad(), packed_linears(model, model[1].weight, 1):
        assert "forward" not in vars(model[0]) and "forward" in vars(model[1])


@pytest.mark.parametrize("lora", [False, True])
def test_greedy_through_packed_weights_equals_transformers(tmp_path, lora):
    hf = make_hf_model("llama")
    hf.save_pretrained(tmp_path)
    ours = slipstream.load_model(tmp_path)
    if lora:  # adapters unmerged: their small linears are packed too
        from slipstream.peft.lora import apply_lora

        apply_lora(ours, rank=4, alpha=8, targets="all-linear")
        for name, p in ours.named_parameters():
            if "lora_B" in name:
                nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(len(name)))
        hf = _hf_with_merged(ours, hf)
    prompts = [[5, 17, 3], [44, 9, 21, 60, 3, 8, 13, 71, 30, 12, 6], [88, 4, 50, 7, 19]]
    got = slipstream.generate(ours, prompts, max_new_tokens=10)
    for p, c in zip(prompts, got, strict=True):
        out = hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, pad_token_id=0)
        assert c.token_ids == out[0, len(p) :].tolist()


def _hf_with_merged(ours, hf):
    """transformers' model with our adapter merged into its weights (the reference)."""
    from slipstream.peft.lora import LoRALinear

    state = hf.state_dict()
    for name, m in ours.named_modules():
        if isinstance(m, LoRALinear):
            delta = (m.lora_B.weight @ m.lora_A.weight) * m.scaling
            state[name + ".weight"] = state[name + ".weight"] + delta
    hf.load_state_dict(state)
    return hf


def test_tensor_subclasses_are_not_packed():
    """An FSDP2 shard is a DTensor: packing its local shard would compute the wrong product."""

    class Shard(torch.Tensor):
        pass

    model = nn.Linear(64, 64)
    model.weight = nn.Parameter(model.weight.detach().as_subclass(Shard), requires_grad=False)
    assert not packed_linear._eligible(model.weight, 4)
    with torch.no_grad(), packed_linears(model, model.weight, 4):
        assert "forward" not in vars(model)
