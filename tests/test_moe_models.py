"""Qwen3-MoE and GPT-OSS against transformers through load_model: logits, loss, gradients,
aux loss, save round trip, both on-disk expert layouts, MXFP4, and zero host syncs."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.models import assert_loss_and_grads_match, shifted_labels
from helpers.moe_models import make_hf_moe_model
from safetensors.torch import load_file, save_file

import slipstream
from slipstream.debug import count_syncs
from slipstream.models import gpt_oss, qwen3_moe
from slipstream.models.moe_block import set_router_aux_loss_coef
from slipstream.ops.moe import load_balancing_loss
from slipstream.ops.packing import SeqInfo

CASES = {
    "qwen3_moe": ("qwen3_moe", {}),
    # layers 0, 2, 3 dense (sparse step 2, layer 3 in mlp_only_layers), no renormalisation
    "qwen3_moe-dense-layers-tied": (
        "qwen3_moe",
        dict(
            num_hidden_layers=4,
            decoder_sparse_step=2,
            mlp_only_layers=[3],
            norm_topk_prob=False,
            tie_word_embeddings=True,
        ),
    ),
    "gpt_oss": ("gpt_oss", {}),
    "gpt_oss-mqa-window3": (
        "gpt_oss",
        dict(
            num_key_value_heads=1,
            sliding_window=3,
            num_hidden_layers=3,
            layer_types=["full_attention", "sliding_attention"] * 1 + ["sliding_attention"],
        ),
    ),
}
LENGTHS = [7, 3, 12, 1]  # longer and shorter than the sliding windows


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    model_type, overrides = CASES[request.param]
    hf = make_hf_moe_model(model_type, **overrides)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, slipstream.load_model(path), path


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed))


def test_packed_logits_match_transformers_per_sequence(pair):
    hf, ours, _ = pair
    ids = _ids(sum(LENGTHS), 1)
    with torch.no_grad():
        packed = ours(ids, SeqInfo.from_lengths(LENGTHS))
        start = 0
        for n in LENGTHS:
            ref = hf(ids[None, start : start + n]).logits[0]
            alone = ours(ids[start : start + n], SeqInfo.from_lengths([n]))
            torch.testing.assert_close(packed[start : start + n], ref, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(packed[start : start + n], alone, atol=1e-5, rtol=1e-5)
            start += n


def test_loss_and_grads_match_transformers(pair):
    hf, ours, _ = pair
    assert_loss_and_grads_match(hf, ours, _ids(19, 2))
    assert any(p.grad.abs().sum() > 0 for n, p in ours.named_parameters() if "experts" in n)


def test_aux_loss_and_its_router_grads_match_transformers(pair):
    hf, ours, _ = pair
    ids = _ids(15, 3)
    hf.zero_grad()
    ours.zero_grad()
    ref = hf(ids[None], output_router_logits=True).aux_loss
    ref.backward()
    seq = SeqInfo.from_lengths([15])
    _, stats = ours.model(ids, seq)  # the router stats `loss` pools
    aux = load_balancing_loss(stats, 15)
    aux.backward()
    torch.testing.assert_close(aux, ref, atol=1e-5, rtol=1e-5)
    labels = shifted_labels(ids, [15])
    assert "aux_loss" not in ours.loss(ids, labels, seq, return_parts=True)[1]  # coef 0
    set_router_aux_loss_coef(ours, 0.01)
    try:
        with torch.no_grad():
            loss, parts = ours.loss(ids, labels, seq, return_parts=True)
    finally:
        set_router_aux_loss_coef(ours, 0.0)
    torch.testing.assert_close(parts["aux_loss"], ref.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss, parts["lm_loss"] + 0.01 * parts["aux_loss"])
    hf_params = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        if ".mlp.gate." in name or ".mlp.router." in name:
            torch.testing.assert_close(p.grad, hf_params[name].grad, atol=1e-6, rtol=1e-4)


def test_loss_plus_aux_grads_match_transformers_in_every_checkpointing_mode(pair):
    """transformers' `loss + coef * aux` (output_router_logits=True): our loss + coef * aux
    gives the same loss and gradients with no checkpointing, recompute and offload (the CPU
    run of the offload schedule), and the modes agree with each other bitwise."""
    from slipstream.memory.offload import apply_checkpointing

    hf, ours, _ = pair
    coef, ids = 0.2, _ids(17, 12)  # a large coefficient, so the aux gradient is no rounding
    hf.zero_grad()
    hf.router_aux_loss_coef = coef
    try:
        ref = hf(ids[None], labels=ids[None], output_router_logits=True).loss
    finally:
        hf.router_aux_loss_coef = hf.config.router_aux_loss_coef
    ref.backward()
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    seq, labels = SeqInfo.from_lengths([17]), shifted_labels(ids, [17])
    results = {}
    set_router_aux_loss_coef(ours, coef)
    try:
        for mode, kwargs in [
            ("none", {}),
            ("recompute", {}),
            ("offload", dict(force=True, min_offload_bytes=0)),
        ]:
            apply_checkpointing(ours, mode, **kwargs)
            ours.zero_grad()
            loss = ours.loss(ids, labels, seq)  # + coef * aux
            loss.backward()
            results[mode] = loss.detach(), {n: p.grad.clone() for n, p in ours.named_parameters()}
    finally:
        set_router_aux_loss_coef(ours, 0.0)
        apply_checkpointing(ours, "none")
    for mode, (loss, grads) in results.items():
        torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, hf_grads[name], atol=1e-5, rtol=1e-4, msg=name)
            assert torch.equal(grad, results["none"][1][name]), f"{mode}: {name}"
        assert torch.equal(loss, results["none"][0])


def test_round_trip_save_model_loads_in_transformers(pair, tmp_path):
    import transformers

    _, ours, _ = pair
    slipstream.save_model(ours, tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids = _ids(10, 4)
    with torch.no_grad():
        ref = back(ids[None]).logits[0]
        got = ours(ids, SeqInfo.from_lengths([10]))
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    if ours.config.model_type == "qwen3_moe":  # the hub layout: one tensor per expert
        keys = load_file(tmp_path / "model.safetensors")
        assert "model.layers.1.mlp.experts.3.up_proj.weight" in keys
        assert not any(k.endswith("gate_up_proj") for k in keys)


def test_qwen3_moe_loads_fused_layout(tmp_path):
    hf = make_hf_moe_model("qwen3_moe", seed=5)
    hf.config.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}  # fused, as in memory
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, tmp_path / "model.safetensors")
    ours = slipstream.load_model(tmp_path)
    ids = _ids(9, 6)
    with torch.no_grad():
        torch.testing.assert_close(
            ours(ids, SeqInfo.from_lengths([9])), hf(ids[None]).logits[0], atol=1e-4, rtol=1e-4
        )


def test_qwen3_moe_checkpoint_errors(tmp_path):
    hf = make_hf_moe_model("qwen3_moe", seed=6)
    hf.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    missing = dict(state)
    del missing["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(missing, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"experts\.5\.up_proj\.weight"):
        slipstream.load_model(tmp_path)
    extra = dict(state)
    extra["model.layers.0.mlp.experts.8.gate_proj.weight"] = torch.zeros(16, 32)
    save_file(extra, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="expert 8 but config.json has 8 experts"):
        slipstream.load_model(tmp_path)


def _built(model_type: str, num_experts: int):
    import transformers
    from helpers.moe_models import GPT_OSS_BASE, QWEN3_MOE_BASE

    if model_type == "qwen3_moe":
        hf = transformers.Qwen3MoeConfig(**{**QWEN3_MOE_BASE, "num_experts": num_experts})
        family = qwen3_moe
    else:
        hf = transformers.GptOssConfig(**{**GPT_OSS_BASE, "num_local_experts": num_experts})
        family = gpt_oss
    torch.manual_seed(0)
    return family.build(family.config_from_hf(hf.to_dict()))


@pytest.mark.parametrize("num_experts", [4, 64])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_no_host_syncs_forward_backward(model_type, num_experts):
    model = _built(model_type, num_experts)
    set_router_aux_loss_coef(model, 0.01)
    lengths = [9, 5, 13]
    seq = SeqInfo.from_lengths(lengths)
    ids = _ids(sum(lengths), 7)
    labels = shifted_labels(ids, lengths)
    with count_syncs() as c:
        loss = model.loss(ids, labels, seq)  # + 0.01 * aux
        loss.backward()
    assert c.total == 0, c.by_op
    grads = model.model.layers[0].mlp.experts.down_proj.grad
    assert grads is not None and grads.abs().sum() > 0


def test_mxfp4_dequantize_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(8)
    blocks = torch.randint(0, 256, (3, 10, 2, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(110, 140, (3, 10, 2), generator=gen, dtype=torch.uint8)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # (E, G*32, rows)
    ours = gpt_oss.dequantize_mxfp4(blocks, scales)  # (E, rows, G*32)
    assert ours.shape == (3, 10, 64)
    torch.testing.assert_close(ours.transpose(1, 2), ref, atol=0, rtol=0)
    # by hand: byte 0x21 -> low nibble 1 (0.5), high nibble 2 (1.0); scale 128 -> x2
    one = gpt_oss.dequantize_mxfp4(
        torch.full((1, 16), 0x21, dtype=torch.uint8), torch.tensor([128], dtype=torch.uint8)
    )
    assert one[:4].tolist() == [1.0, 2.0, 1.0, 2.0]


def test_mxfp4_checkpoint_dequantised_on_load(tmp_path):
    import transformers
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf = make_hf_moe_model("gpt_oss", seed=9, intermediate_size=32)  # MXFP4 needs 32 | I
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    gen = torch.Generator().manual_seed(10)
    expected = {}
    for name in [k for k in state if k.endswith(("gate_up_proj", "down_proj"))]:
        E, d_in, d_out = state.pop(name).shape
        blocks = torch.randint(0, 256, (E, d_out, d_in // 32, 16), generator=gen).to(torch.uint8)
        scales = torch.randint(118, 126, (E, d_out, d_in // 32), generator=gen).to(torch.uint8)
        state[f"{name}_scales"], state[f"{name}_blocks"] = scales, blocks
        expected[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    save_file(state, tmp_path / "model.safetensors")
    config = hf.config.to_dict()
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn"],
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    ours = slipstream.load_model(tmp_path)
    params = dict(ours.named_parameters())
    for name, ref in expected.items():
        torch.testing.assert_close(params[name], ref, atol=0, rtol=0, msg=name)
    # saved back dequantised, without the quantization_config, and transformers agrees
    out = slipstream.save_model(ours, tmp_path / "out")
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = _ids(8, 11)
    with torch.no_grad():
        torch.testing.assert_close(
            ours(ids, SeqInfo.from_lengths([8])), back(ids[None]).logits[0], atol=1e-4, rtol=1e-4
        )
    del state["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="down_proj_scales"):
        slipstream.load_model(tmp_path)
