"""LoRA: parity with peft on a tiny random transformers Llama/Qwen3, save/load both ways."""

import copy
import json
import math

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from slipstream.checkpoint.adapter import load_adapter, save_adapter
from slipstream.debug import count_syncs
from slipstream.peft.lora import DEFAULT_TARGETS, LoRALinear, apply_lora, lora_modules, merge_lora

SMALL = dict(
    vocab_size=61,
    hidden_size=32,
    intermediate_size=40,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def _base(family="llama"):
    torch.manual_seed(0)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**SMALL)).float().eval()
    return Qwen3ForCausalLM(Qwen3Config(head_dim=8, **SMALL)).float().eval()


def _tokens():
    return torch.randint(
        0, SMALL["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(1)
    )


def _logits(model):
    with torch.no_grad():
        return model(input_ids=_tokens()).logits


def _train_a_few_steps(model, steps=3):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for _ in range(steps):
        ids = _tokens()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()


@pytest.mark.parametrize(
    "family,targets,use_rslora",
    [("llama", DEFAULT_TARGETS, False), ("qwen3", "all-linear", True)],
)
def test_saved_adapter_loads_in_peft_with_same_logits(tmp_path, family, targets, use_rslora):
    base = _base(family)
    ours = apply_lora(copy.deepcopy(base), rank=4, alpha=8, targets=targets, use_rslora=use_rslora)
    _train_a_few_steps(ours)
    assert all(m.lora_B.weight.abs().max() > 0 for m in lora_modules(ours).values())
    save_adapter(ours, tmp_path, base_model_name_or_path="tiny-random")

    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 8
    assert cfg["use_rslora"] is use_rslora and cfg["base_model_name_or_path"] == "tiny-random"
    assert "lm_head" not in cfg["target_modules"] and len(cfg["target_modules"]) == 7
    assert not list(tmp_path.glob("*.tmp"))

    peft_model = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path).eval()
    diff = (_logits(peft_model) - _logits(ours)).abs().max()
    assert diff <= 1e-5, diff
    # The adapter changed the output, so the comparison above could fail.
    assert (_logits(base) - _logits(ours)).abs().max() > 1e-3


def test_peft_adapter_loads_into_ours(tmp_path):
    base = _base("llama")
    config = LoraConfig(
        r=4, lora_alpha=12, target_modules=["q_proj", "v_proj", "down_proj"], task_type="CAUSAL_LM"
    )
    peft_model = get_peft_model(copy.deepcopy(base), config)
    torch.manual_seed(2)
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.1)
    peft_model.save_pretrained(tmp_path)
    peft_model.eval()

    ours = load_adapter(copy.deepcopy(base), tmp_path)
    assert ours.lora_config["target_modules"] == ["down_proj", "q_proj", "v_proj"]
    assert len(lora_modules(ours)) == 3 * SMALL["num_hidden_layers"]
    diff = (_logits(peft_model) - _logits(ours)).abs().max()
    assert diff <= 1e-5, diff
    assert (_logits(base) - _logits(ours)).abs().max() > 1e-3

    # Loading again into the already-wrapped model works too.
    again = apply_lora(
        copy.deepcopy(base), rank=4, alpha=12, targets=["q_proj", "v_proj", "down_proj"]
    )
    assert (_logits(load_adapter(again, tmp_path)) - _logits(ours)).abs().max() == 0


def test_merge_gives_same_logits_and_plain_linears(tmp_path):
    base = _base("llama")
    model = apply_lora(copy.deepcopy(base), rank=4, alpha=8)
    _train_a_few_steps(model)
    before = _logits(model)
    merge_lora(model)
    assert not lora_modules(model)
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear
    assert set(model.state_dict()) == set(base.state_dict())
    assert (_logits(model) - before).abs().max() <= 1e-5
    assert (_logits(model) - _logits(base)).abs().max() > 1e-3


def test_only_lora_parameters_train():
    model = apply_lora(_base("llama"), rank=4, alpha=8, dropout=0.1)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # 7 targets x 2 layers x (A, B)
    assert len(trainable) == 7 * 2 * 2
    names = dict(model.named_parameters())
    assert "model.layers.0.self_attn.q_proj.base_layer.weight" in names
    assert not names["model.embed_tokens.weight"].requires_grad
    assert type(model.lm_head) is nn.Linear
    q = model.model.layers[0].self_attn.q_proj
    assert isinstance(q.lora_dropout, nn.Dropout) and q.lora_dropout.p == 0.1
    assert q.lora_B.weight.abs().max() == 0 and q.lora_A.weight.abs().max() > 0
    # kaiming_uniform(a=sqrt(5)) bound is 1/sqrt(fan_in).
    assert q.lora_A.weight.abs().max() <= 1 / math.sqrt(SMALL["hidden_size"])


def test_scaling_plain_and_rslora():
    torch.manual_seed(0)
    base = nn.Linear(12, 7)
    plain = LoRALinear(copy.deepcopy(base), rank=4, alpha=8)
    rs = LoRALinear(copy.deepcopy(base), rank=4, alpha=8, use_rslora=True)
    assert plain.scaling == 2.0 and rs.scaling == 4.0
    nn.init.normal_(rs.lora_B.weight)
    x = torch.randn(5, 12)
    want = base(x) + 4.0 * x @ rs.lora_A.weight.T @ rs.lora_B.weight.T
    assert torch.allclose(rs(x), want, atol=1e-5)


def test_bad_arguments_are_one_line_value_errors():
    with pytest.raises(ValueError, match=r"match no nn.Linear.*present: \[.*q_proj") as e:
        apply_lora(_base("llama"), targets=["q_proj", "qkv_proj"])
    assert "qkv_proj" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="rank"):
        apply_lora(_base("llama"), rank=0)
    with pytest.raises(ValueError, match="alpha"):
        apply_lora(_base("llama"), alpha=0)
    model = apply_lora(_base("llama"), rank=2)
    with pytest.raises(ValueError, match="already applied"):
        apply_lora(model)
    with pytest.raises(ValueError, match="no LoRA"):
        save_adapter(_base("llama"), "/tmp/unused")


def test_lora_on_lm_head_loads_in_peft_with_equal_loss_and_gradients(tmp_path):
    """LoRA on an untied head (LoRAHead: `.weight` is the effective W + s B A, which the
    chunked loss reads through lm_head_weight()): the adapter loads in peft with our logits,
    loss and every factor's gradient; ours loads it back; the merged export equals it."""
    from helpers.models import make_hf_model
    from transformers import AutoModelForCausalLM

    from slipstream.checkpoint.hf import load_model, save_model
    from slipstream.ops.packing import SeqInfo

    make_hf_model("llama", tie_word_embeddings=False, vocab_size=300, hidden_size=32,
                  intermediate_size=64, num_attention_heads=4,
                  initializer_range=0.2).save_pretrained(tmp_path / "base")  # fmt: skip
    model = load_model(tmp_path / "base", dtype=torch.float32)
    apply_lora(model, rank=4, alpha=8, targets=["q_proj", "lm_head"])
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # trained factors: a head adapter that did nothing would show
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    ids = torch.randint(0, 300, (2, 9), generator=g)
    seq = SeqInfo.from_lengths([9, 9])
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1).reshape(-1)
    loss = model.loss(ids.reshape(-1), labels, seq)
    loss.backward()
    assert model.lm_head.lora_B.weight.grad.abs().sum() > 0
    out = save_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(tmp_path / "base"))
    assert "lm_head" in json.loads((out / "adapter_config.json").read_text())["target_modules"]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    theirs = PeftModel.from_pretrained(hf, out, is_trainable=True)
    got = theirs(input_ids=ids, labels=ids)
    logits = model(ids.reshape(-1), seq).detach()
    torch.testing.assert_close(got.logits.reshape(18, -1), logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.loss, loss, atol=1e-6, rtol=1e-5)
    got.loss.backward()
    peft_grads = {n.removeprefix("base_model.model.").replace(".default", ""): p.grad
                  for n, p in theirs.named_parameters() if p.requires_grad}  # fmt: skip
    our_grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert peft_grads.keys() == our_grads.keys() and "lm_head.lora_A.weight" in our_grads
    for name, grad in our_grads.items():
        torch.testing.assert_close(grad, peft_grads[name], atol=1e-6, rtol=1e-4, msg=name)
    again = load_adapter(load_model(tmp_path / "base", dtype=torch.float32), out)
    torch.testing.assert_close(again(ids.reshape(-1), seq), logits, atol=1e-6, rtol=1e-6)
    save_model(merge_lora(again), tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    torch.testing.assert_close(merged(input_ids=ids).logits.reshape(18, -1), logits,
                               atol=1e-5, rtol=1e-5)  # fmt: skip


def test_lora_on_lm_head_refusals_are_one_line(tmp_path):
    """A tied head (no module of its own), dropout or DoRA on the head: one line each."""
    from helpers.models import make_hf_model

    from slipstream.checkpoint.hf import load_model

    tied = make_hf_model("llama", tie_word_embeddings=True, vocab_size=64, hidden_size=32,
                         intermediate_size=64, num_attention_heads=4)  # fmt: skip
    tied.save_pretrained(tmp_path)
    cases = [(load_model(tmp_path), {}, "ties its head to embed_tokens"),
             (_base("llama"), {"dropout": 0.1}, "lm_head takes no lora.dropout"),
             (_base("llama"), {"use_dora": True}, "lm_head takes no use_dora")]  # fmt: skip
    for model, options, message in cases:
        with pytest.raises(ValueError, match=message) as e:
            apply_lora(model, targets=["q_proj", "lm_head"], **options)
        assert "\n" not in str(e.value)


def test_load_errors_name_the_tensor_or_file(tmp_path):
    base = _base("llama")
    with pytest.raises(ValueError, match="adapter_config.json not found"):
        load_adapter(copy.deepcopy(base), tmp_path)
    save_adapter(apply_lora(copy.deepcopy(base), rank=2, alpha=4), tmp_path)
    weights = tmp_path / "adapter_model.safetensors"
    tensors = load_file(weights)
    key = "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"
    del tensors[key]
    save_file(tensors, weights)
    with pytest.raises(ValueError, match=f"missing tensor {key}"):
        load_adapter(copy.deepcopy(base), tmp_path)
    tensors[key] = torch.zeros(3, 3)
    save_file(tensors, weights)
    with pytest.raises(ValueError, match=r"up_proj.lora_B.weight has shape \(3, 3\)"):
        load_adapter(copy.deepcopy(base), tmp_path)
    mismatched = apply_lora(copy.deepcopy(base), rank=8, alpha=4)
    with pytest.raises(ValueError, match="r=2"):
        load_adapter(mismatched, tmp_path)


def test_lora_linear_forward_backward_is_sync_free():
    layer = LoRALinear(nn.Linear(16, 24), rank=4, alpha=8, dropout=0.1)
    x = torch.randn(9, 16, requires_grad=True)
    with count_syncs() as c:
        layer(x).square().mean().backward()
    assert c.total == 0, str(c)
    assert layer.lora_A.weight.grad is not None and x.grad is not None


def test_default_targets_are_the_fused_projections_on_phi3(tmp_path):
    """apply_lora's default (no targets) on Phi-3 wraps its fused qkv_proj / gate_up_proj,
    and peft, given the adapter, targets the same modules of the transformers model."""
    from helpers.models import make_hf_model

    import slipstream

    hf = make_hf_model("phi3")
    hf.save_pretrained(tmp_path / "base")
    model = slipstream.load_model(tmp_path / "base")
    apply_lora(model)
    wrapped = {name.rsplit(".", 1)[-1] for name in lora_modules(model)}
    assert wrapped == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    save_adapter(model, tmp_path / "adapter")
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["target_modules"] == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "adapter")
    assert len([n for n, _ in peft_model.named_modules() if n.endswith("qkv_proj.lora_A")]) == 2
