"""GGUF export of models built by transformers' modeling code (checkpoint/gguf_generic.py):
OLMo 2 and Mixtral as llama.cpp names and lays them out; Qwen2-MoE read back by transformers'
own GGUF reader; in llama.cpp itself (llama-cpp-python,
the `slipstream[gguf]` extra: skipped where it is not installed) their logits and greedy
tokens are ours; other types are refused in one line naming the type."""

from __future__ import annotations

import pytest
import torch
from helpers.gguf_tokenizer import VOCAB
from helpers.gguf_tokenizer import tokenizer as tokenizer  # noqa: F401 (module fixture)
from helpers.tiny_hf import quiet as quiet  # noqa: F401 (module fixture)
from helpers.tiny_hf import save_tiny

from slipstream.checkpoint.gguf_export import export_gguf
from slipstream.checkpoint.hf import load_model
from slipstream.ops.packing import SeqInfo

SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, head_dim=16)
PROMPT = "Hello, how are you doing today? I went hiking in the mountains."


def _generic(tmp_path, model_type, implementation="auto", **overrides):
    save_tiny(tmp_path / model_type, model_type, **{**SIZES, **overrides})
    return load_model(tmp_path / model_type, implementation=implementation)


def _fields(reader) -> dict:
    out = {}
    for key, f in reader.fields.items():
        if f.data and not key.startswith("tokenizer."):
            part = f.parts[f.data[0]]
            out[key] = bytes(part).decode() if key == "general.architecture" else part.tolist()
    return out


@pytest.mark.parametrize(
    ("model_type", "arch", "experts"), [("olmo2", "olmo2", None), ("mixtral", "llama", 4)]
)
def test_generic_gguf_has_llama_cpps_names_and_layout(tmp_path, quiet, tokenizer, model_type,  # noqa: F811
                                                      arch, experts):  # fmt: skip
    """Every tensor under a name of llama.cpp's table for the architecture, in its layout:
    Mixtral's Q/K rows permuted per head as native llama's are (OLMo 2's NeoX RoPE: not),
    its experts split into stacked gate/up/down, the router f32; the hyperparameters under
    the architecture's keys, RoPE base from config.json's rope_parameters."""
    import gguf

    from slipstream.checkpoint.gguf_spec import permute_rotary

    model = _generic(tmp_path, model_type)
    assert type(model).__name__ == "GenericCausalLM"
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    path = export_gguf(model, tmp_path / "m.gguf", "f32", tokenizer=tokenizer)
    reader = gguf.GGUFReader(str(path))
    fields = _fields(reader)
    assert fields["general.architecture"] == arch
    theta = model.hf.config.rope_parameters["rope_theta"]
    assert fields[f"{arch}.rope.freq_base"] == [pytest.approx(theta)]
    assert fields[f"{arch}.block_count"] == [2] and fields[f"{arch}.attention.head_count_kv"] == [2]
    assert fields.get(f"{arch}.expert_count") == ([experts] if experts else None)
    known = set(gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH[arch.upper()]])
    tensors = {t.name: t for t in reader.tensors}
    for name in tensors:
        stem = name.removesuffix(".weight").removesuffix(".bias")
        assert any(stem == k.format(bid=b) for k in known for b in (0, 1)), name
    q = torch.from_numpy(tensors["blk.1.attn_q.weight"].data.copy())
    hf_q = state["model.layers.1.self_attn.q_proj.weight"]
    want_q = permute_rotary(hf_q, 4) if model_type == "mixtral" else hf_q
    torch.testing.assert_close(q, want_q)
    if experts:
        gate_up = state["model.layers.0.mlp.experts.gate_up_proj"]  # (E, 2I, D), gate first
        up = torch.from_numpy(tensors["blk.0.ffn_up_exps.weight"].data.copy())
        torch.testing.assert_close(up, gate_up[:, gate_up.shape[1] // 2 :])
        assert tensors["blk.0.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32
        # embedding, final norm, head; a layer: q/k/v/o, 2 norms, router, 3 expert stacks
        assert len(tensors) == 3 + 2 * 10
    else:  # a layer: q/k/v/o, q/k norms, gate/up/down, post-attention and post-MLP norms
        assert len(tensors) == 3 + 2 * 11


def test_transformers_reads_a_generic_qwen2_moe_gguf_back(tmp_path, quiet, tokenizer):  # noqa: F811
    """Qwen2-MoE (llama.cpp's qwen2moe: stacked experts split, the shared expert and its gate
    as one vector): transformers' own GGUF reader, written after llama.cpp's converter, gets
    back the config fields it reads and, on the original config, our logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = _generic(tmp_path, "qwen2_moe")
    ids = torch.tensor(tokenizer(PROMPT)["input_ids"])
    with torch.no_grad():
        ref = model(ids, SeqInfo.from_lengths([len(ids)]))
    export_gguf(model, tmp_path / "qwen2_moe" / "m.gguf", "f32", tokenizer=tokenizer)
    folder = tmp_path / "qwen2_moe"
    read = AutoConfig.from_pretrained(folder, gguf_file="m.gguf")
    want = AutoConfig.from_pretrained(folder)
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "num_experts", "num_experts_per_tok", "vocab_size")  # fmt: skip
    assert {k: getattr(read, k) for k in keys} == {k: getattr(want, k) for k in keys}
    assert read.rope_parameters["rope_theta"] == want.rope_parameters["rope_theta"]
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file="m.gguf", config=want,
                                              dtype=torch.float32)  # fmt: skip
    with torch.no_grad():
        torch.testing.assert_close(hf(ids[None]).logits[0], ref, atol=1e-5, rtol=1e-5)


def test_generic_gguf_refusals_name_the_model_type(tmp_path, quiet, tokenizer):  # noqa: F811
    lfm2 = _generic(tmp_path, "lfm2")
    with pytest.raises(ValueError, match="model_type 'lfm2' has no llama.cpp architecture") as e:
        export_gguf(lfm2, tmp_path / "a.gguf", "f32", tokenizer=tokenizer)
    assert "\n" not in str(e.value) and "mixtral" in str(e.value) and "olmo2" in str(e.value)
    llama = _generic(tmp_path, "llama", implementation="transformers")
    with pytest.raises(ValueError, match="'llama' built by transformers' modeling code"):
        export_gguf(llama, tmp_path / "b.gguf", "f32", tokenizer=tokenizer)
    windowed = _generic(tmp_path, "mixtral", sliding_window=8)
    with pytest.raises(ValueError, match="mixtral with sliding_window=8: llama.cpp"):
        export_gguf(windowed, tmp_path / "c.gguf", "f32", tokenizer=tokenizer)
    normed = _generic(tmp_path, "qwen2_moe", norm_topk_prob=True)
    with pytest.raises(ValueError, match="qwen2_moe with norm_topk_prob=true: llama.cpp"):
        export_gguf(normed, tmp_path / "d.gguf", "f32", tokenizer=tokenizer)
    assert not list(tmp_path.glob("*.gguf"))


@pytest.mark.parametrize("model_type", ["olmo2", "mixtral", "qwen2_moe"])
def test_llama_cpp_runs_a_generic_gguf_as_we_do(tmp_path, quiet, tokenizer, model_type):  # noqa: F811
    """llama.cpp's logits (relative 5e-3: it keeps K/V in f16) and 8 greedy tokens equal ours."""
    pytest.importorskip("llama_cpp")
    from test_gguf_llama_cpp import greedy_llama_cpp, greedy_ours, llama_cpp_logits

    model = _generic(tmp_path, model_type)
    ids = tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        ref = model(torch.tensor(ids), SeqInfo.from_lengths([len(ids)]))
    path = export_gguf(model, tmp_path / "m.gguf", "f32", tokenizer=tokenizer)
    llm, got = llama_cpp_logits(path, ids)
    err = (got - ref).abs().max() / ref.abs().max()
    assert err < 5e-3, f"{model_type}: llama.cpp logits differ by {err:.2e} (relative)"
    assert greedy_llama_cpp(llm, ids, 8) == greedy_ours(model, ids, 8)
