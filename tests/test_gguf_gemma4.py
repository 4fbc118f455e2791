"""Gemma 4's text GGUF (checkpoint/gguf_gemma4.py) as the writer puts it in the file, read back
with the `gguf` package (no llama.cpp needed): llama.cpp's gemma4 keys and tensor names, the
per-layer arrays, the full layers' RoPE divisors, tensors kept as they are (Gemma 4 norms
unshifted), the multimodal checkpoint's text side; and what llama.cpp would run differently,
refused in one line before anything is written. llama.cpp running the files:
tests/test_gguf_llama_cpp.py (gemma4_text, gemma4_text_moe)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.tiny_hf import tiny_config

from slipstream.checkpoint.gguf_export import export_gguf
from slipstream.checkpoint.hf import load_model
from tests.helpers import gguf_tokenizer
from tests.helpers.gguf_tokenizer import VOCAB

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
tokenizer = gguf_tokenizer.tokenizer  # the module-scoped fixture

SIZES = dict(vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=2)
MOE = dict(hidden_size_per_layer_input=8, use_double_wide_mlp=True, tie_word_embeddings=True)


def saved(tmp_path, kind: str = "gemma4_text", **overrides):
    """A tiny Gemma 4 (tests/helpers/tiny_hf.py: 4 layers, sliding/full, layers 2-3 sharing
    0-1's K/V) saved and loaded back by the production loader; norms etc. randomised."""
    torch.manual_seed(0)
    extra = MOE if kind.endswith("_moe") else {}
    cfg = tiny_config(kind, 4, **{**SIZES, **extra, **overrides})
    hf = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, t in [*hf.named_parameters(), *hf.named_buffers()]:
            if name.endswith(("norm.weight", "layer_scalar", "router.scale", "per_expert_scale")):
                t.copy_(1 + 0.2 * torch.randn_like(t))
    hf.save_pretrained(tmp_path / "hf")
    return hf, load_model(tmp_path / "hf")


def read(path):
    reader = gguf.GGUFReader(str(path))
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    return meta, {t.name: np.array(t.data) for t in reader.tensors}


def test_dense_keys_names_and_values(tmp_path, tokenizer):
    hf, ours = saved(tmp_path)
    meta, t = read(export_gguf(ours, tmp_path / "m.gguf", "f32", tokenizer=tokenizer))
    p = "gemma4."
    assert meta["general.architecture"] == "gemma4"
    assert meta[p + "attention.sliding_window_pattern"] == [True, False, True, False]
    assert meta[p + "attention.sliding_window"] == 4
    assert (meta[p + "attention.key_length"], meta[p + "attention.key_length_swa"]) == (16, 8)
    assert (meta[p + "attention.value_length"], meta[p + "attention.value_length_swa"]) == (16, 8)
    assert meta[p + "attention.head_count_kv"] == [2, 1, 2, 1]  # full layers: 1 KV head
    assert meta[p + "feed_forward_length"] == [48, 48, 96, 96]  # shared layers: double wide
    assert meta[p + "attention.shared_kv_layers"] == 2
    assert meta[p + "embedding_length_per_layer_input"] == 8
    assert (meta[p + "rope.freq_base"], meta[p + "rope.freq_base_swa"]) == (1e6, 1e4)
    assert (meta[p + "rope.dimension_count"], meta[p + "rope.dimension_count_swa"]) == (16, 8)
    assert meta[p + "final_logit_softcapping"] == 30.0
    assert p + "expert_count" not in meta
    # proportional RoPE, factor 0.25 of a 16-dim head: 2 of 8 pairs turn, at theta^(-2i/16)
    np.testing.assert_allclose(t["rope_freqs.weight"], [1, 1] + [1e30] * 6, rtol=1e-6)
    # shared layers (2, 3) have no K/V tensors; full layers (1, 3) no V (k = v)
    assert {n for n in t if ".attn_k." in n} == {"blk.0.attn_k.weight", "blk.1.attn_k.weight"}
    assert {n for n in t if ".attn_v." in n} == {"blk.0.attn_v.weight"}
    state = {**dict(hf.named_parameters()), **dict(hf.named_buffers())}
    for gguf_name, hf_name in [
        ("blk.3.post_ffw_norm.weight", "model.layers.3.post_feedforward_layernorm.weight"),
        ("blk.1.attn_q_norm.weight", "model.layers.1.self_attn.q_norm.weight"),
        ("blk.2.layer_output_scale.weight", "model.layers.2.layer_scalar"),
        ("per_layer_token_embd.weight", "model.embed_tokens_per_layer.weight"),
        ("per_layer_model_proj.weight", "model.per_layer_model_projection.weight"),
        ("per_layer_proj_norm.weight", "model.per_layer_projection_norm.weight"),
        ("blk.2.inp_gate.weight", "model.layers.2.per_layer_input_gate.weight"),
        ("blk.2.proj.weight", "model.layers.2.per_layer_projection.weight"),
        ("blk.2.post_norm.weight", "model.layers.2.post_per_layer_input_norm.weight"),
        ("output_norm.weight", "model.norm.weight"),  # Gemma 4 scales by w: no 1 + w
        ("output.weight", "lm_head.weight"),
    ]:
        np.testing.assert_array_equal(t[gguf_name], state[hf_name].detach().numpy(), gguf_name)


def test_moe_experts_and_router_scales(tmp_path, tokenizer):
    hf, ours = saved(tmp_path, "gemma4_text_moe")
    meta, t = read(export_gguf(ours, tmp_path / "m.gguf", "f32", tokenizer=tokenizer))
    p = "gemma4."
    assert (meta[p + "expert_count"], meta[p + "expert_used_count"]) == (4, 2)
    assert meta[p + "expert_feed_forward_length"] == 16
    assert "output.weight" not in t  # tied
    layer = hf.model.layers[1]
    for gguf_name, x in [
        ("blk.1.ffn_gate_inp.weight", layer.router.proj.weight),
        ("blk.1.ffn_gate_inp.scale", layer.router.scale),
        ("blk.1.ffn_down_exps.scale", layer.router.per_expert_scale),
        ("blk.1.ffn_gate_up_exps.weight", layer.experts.gate_up_proj),  # (E, 2F, D)
        ("blk.1.ffn_down_exps.weight", layer.experts.down_proj),  # (E, D, F)
        ("blk.1.pre_ffw_norm_2.weight", layer.pre_feedforward_layernorm_2.weight),
        ("blk.1.post_ffw_norm_1.weight", layer.post_feedforward_layernorm_1.weight),
    ]:
        np.testing.assert_array_equal(t[gguf_name], x.detach().numpy(), gguf_name)


def test_multimodal_checkpoint_writes_its_text_model(tmp_path):
    """`gemma4` with a vision tower: the language model's keys (from text_config) and tensors
    only; the tower and embedder are the mmproj's."""
    from helpers.tiny_vlm import vlm_folder

    folder = vlm_folder(tmp_path / "vlm", "gemma4")
    model = load_model(folder)
    meta, t = read(export_gguf(model, tmp_path / "m.gguf", "f32", tokenizer=str(folder)))
    text = model.config.hf["text_config"]
    assert meta["general.architecture"] == "gemma4"
    assert meta["gemma4.context_length"] == text["max_position_embeddings"]
    assert meta["gemma4.block_count"] == 2 and "blk.1.attn_q.weight" in t
    assert not [n for n in t if n.startswith(("v.", "mm.")) or "vision" in n]


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(hidden_activation="gelu"), "tanh GELU"),
        (dict(attention_bias=True), "attention biases"),
        (dict(vocab_size_per_layer_input=64), "vocab_size_per_layer_input=64"),
        # layers 2-3 share, but layer 1 is sliding: llama.cpp's layer 3 would reuse layer 1
        (dict(layer_types=["full_attention", "sliding_attention"] * 2), "K/V sources"),
        (dict(rope_parameters={
            "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                               "rope_theta": 1e6}}), "sliding-layer RoPE"),
        (dict(num_kv_shared_layers=3, layer_types=["full_attention"] * 4),
         "fewer than 2 layers computing K/V"),
    ],
)  # fmt: skip
def test_what_llama_cpp_would_compute_differently_is_refused(tmp_path, tokenizer, overrides,
                                                             match):  # fmt: skip
    _, ours = saved(tmp_path, **overrides)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ValueError, match=match) as e:
        export_gguf(ours, out / "m.gguf", "f16", tokenizer=tokenizer)
    assert "\n" not in str(e.value) and list(out.iterdir()) == []


def test_gguf_lora_on_the_per_layer_input_projection_is_refused(tmp_path):
    """llama.cpp multiplies per_layer_model_projection without its LoRA hook."""
    from slipstream.checkpoint.adapter import save_adapter
    from slipstream.checkpoint.gguf_lora import export_adapter_gguf
    from slipstream.peft.lora import apply_lora

    _, model = saved(tmp_path)
    apply_lora(model, rank=2, alpha=4, targets=["q_proj", "per_layer_model_projection"])
    save_adapter(model, tmp_path / "run", base_model_name_or_path=str(tmp_path / "hf"))
    with pytest.raises(ValueError, match="applies no LoRA to 'model.per_layer_model_") as e:
        export_adapter_gguf(tmp_path / "run", tmp_path / "lora.gguf")
    assert "\n" not in str(e.value) and not (tmp_path / "lora.gguf").exists()
