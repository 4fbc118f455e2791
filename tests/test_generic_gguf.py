"""GGUF export of models built by transformers' modeling code (checkpoint/gguf_generic.py):
every exporting type (LAYOUT) as llama.cpp names and lays it out; some read back by
transformers' own GGUF reader (its inverse of llama.cpp's converter) to our logits; in
llama.cpp itself (llama-cpp-python, the `slipstream[gguf]` extra: skipped where it is not
installed) every one's logits and greedy tokens are ours; other types are refused in one line."""

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
            if key == "general.architecture":
                out[key] = bytes(f.parts[f.data[0]]).decode()
            else:  # every element of an array (lfm2's per-layer K/V heads)
                out[key] = [x for i in f.data for x in f.parts[i].tolist()]
    return out


GRANITE = dict(
    attention_multiplier=0.3, embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=4.0
)  # not 1: a scale left out or swapped shows
# Llama 4 as llama.cpp fixes it: chunked layers of 8192, RoPE skipped on every 4th layer
# (none of 2), experts on every 2nd layer (a dense one of intermediate_size_mlp before)
LLAMA4 = dict(layer_types=["chunked_attention"] * 2, no_rope_layers=[1, 1],
              interleave_moe_layer_step=2, moe_layers=[1], intermediate_size_mlp=96)  # fmt: skip
# Falcon-H1 with every muP multiplier away from 1 (a fold left out or misplaced shows), two
# SSM groups and its gated grouped norm (llama.cpp's order: gate, then norm)
FALCON_H1 = dict(embedding_multiplier=2.0, lm_head_multiplier=0.5, attention_in_multiplier=0.7,
                 key_multiplier=1.3, attention_out_multiplier=0.9, ssm_in_multiplier=1.1,
                 ssm_out_multiplier=0.8, ssm_multipliers=[1.2, 0.9, 1.1, 0.8, 1.3],
                 mlp_multipliers=[0.6, 1.4], mamba_n_groups=2, mamba_rms_norm=True,
                 mamba_norm_before_gate=False)  # fmt: skip
NEMOTRON = dict(moe_shared_expert_intermediate_size=32, n_groups=2)
# model_type -> (llama.cpp architecture, experts, tensors per layer, Q/K permuted, overrides)
LAYOUT = {
    "olmo2": ("olmo2", None, 11, False, {}),  # q/k/v/o, q/k norms, gate/up/down, 2 post-norms
    "mixtral": ("llama", 4, 10, True, {}),  # q/k/v/o, 2 norms, router, 3 expert stacks
    "gemma2": ("gemma2", None, 11, False, {"tie_word_embeddings": True,
                                           "query_pre_attn_scalar": 16}),  # 4 norms
    "starcoder2": ("starcoder2", None, 16, False, {"sliding_window": None}),  # + 8 biases
    "stablelm": ("stablelm", None, 11, False, {}),  # q/k/v/o, gate/up/down, 2 LayerNorms
    "phi": ("phi2", None, 14, False, {"num_key_value_heads": 4}),  # + biases, 1 LayerNorm
    "granite": ("granite", None, 9, True, GRANITE),
    "granitemoe": ("granitemoe", 4, 10, True, GRANITE),  # mixtral's
    "smollm3": ("smollm3", None, 9, True, {}),
    "lfm2": ("lfm2", None, 8, False, {}),  # conv layer: 3 shortconv, gate/up/down, 2 norms
    "olmo3": ("olmo2", None, 11, False, {"sliding_window": 8}),  # as olmo2
    "minimax_m2": ("minimax-m2", 4, 13, False, {}),  # mixtral's + q/k norms, router bias
    # glm4_moe: a dense layer 0 (q/k/v/o + 3 biases, q/k norms, gate/up/down, 2 norms: 14),
    # a MoE layer 1 (19: router, its bias, 3 expert stacks, 3 shared-expert projections)
    "glm4_moe": ("glm4moe", 4, 14, False, {"attention_bias": True, "use_qk_norm": True,
                                           "n_group": 2, "topk_group": 1}),  # 2 groups of 2
    # ernie4_5_moe: a dense layer 0 (9), a MoE layer 1 (14: router, bias, 3 + 3 projections)
    "ernie4_5_moe": ("ernie4_5-moe", 4, 9, False, {}),
    "cohere2": ("cohere2", None, 8, False, {"tie_word_embeddings": True,  # 1 LayerNorm;
                "layer_types": ["sliding_attention"] * 2}),  # llama.cpp's: every 4th full
    # llama4_text: a dense layer 0 (9), a MoE layer 1 (13: router, 3 expert stacks, 3 shared)
    "llama4_text": ("llama4", 4, 9, False, LLAMA4),
    # deepseek_v3: a dense layer 0 (13: q_a/q_a_norm/q_b, kv_a_mqa/kv_a_norm, k_b, v_b, o, 2
    # norms, gate/up/down), a MoE layer 1 (18: router, its bias, 3 expert stacks, 3 shared);
    # expert groups (2 of 2 experts, 1 used): llama.cpp's group-limited routing runs too
    # falcon_h1: norm, q/k/v/o, ssm in/conv (+ bias)/dt bias/A/D/norm/out, ffn norm + 3 (17)
    "falcon_h1": ("falcon-h1", None, 17, False, FALCON_H1),
    # nemotron_h: a MoE layer 0 (norm, router, bias, 2 gateless expert stacks, 2 shared: 7),
    # an attention layer 1 (norm, q/k/v/o: 5); its Mamba-2 layers run in the llama.cpp test
    "nemotron_h": ("nemotron_h_moe", 4, 7, False,
                   {**NEMOTRON, "layers_block_type": ["moe", "full_attention"]}),
    # qwen3_next: a Gated DeltaNet layer 0 (2 norms, qkv, gate, conv, dt bias, A, ba, norm, out;
    # router, 3 expert stacks, shared expert's 3 + its gate: 18), an attention layer 1 (16)
    "qwen3_next": ("qwen3next", 4, 18, False, {}),
    "deepseek_v3": ("deepseek2", 4, 13, False, {"head_dim": 4, "n_group": 2, "topk_group": 1}),
}  # fmt: skip


def _arch_enum(name: str):
    """The gguf.MODEL_ARCH member whose llama.cpp name is `name` ("minimax-m2")."""
    import gguf

    return next(arch for arch, n in gguf.MODEL_ARCH_NAMES.items() if n == name)


# The tensors outside the layers: embedding, final norm, head (a LayerNorm's bias, the head's)
OUTSIDE = {"gemma2": 2, "starcoder2": 4, "stablelm": 4, "phi": 5, "lfm2": 3 + 3, "cohere2": 2,
           "glm4_moe": 3 + 5, "ernie4_5_moe": 3 + 5, "llama4_text": 3 + 4,
           "deepseek_v3": 3 + 5,
           "nemotron_h": 3 - 2, "qwen3_next": 3 - 2}  # (5 - 7 of layer 1)  # fmt: skip
# (lfm2: token_embd, its norm, output; its attention layer 1 holds 11 tensors, 3 more than
# the 8 of its convolution layer 0)


@pytest.mark.parametrize("model_type", list(LAYOUT))
def test_generic_gguf_has_llama_cpps_names_and_layout(tmp_path, quiet, tokenizer, model_type):  # noqa: F811
    """Every tensor under a name of llama.cpp's table for the architecture, in its layout:
    Mixtral's Q/K rows permuted per head as native llama's are (OLMo 2's NeoX RoPE: not),
    its experts split into stacked gate/up/down, the router f32; the hyperparameters under
    the architecture's keys, RoPE base from config.json's rope_parameters."""
    import gguf

    from slipstream.checkpoint.gguf_spec import permute_rotary

    arch, experts, per_layer, permuted, overrides = LAYOUT[model_type]
    model = _generic(tmp_path, model_type, **overrides)
    assert type(model).__name__ == "GenericCausalLM"
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    path = export_gguf(model, tmp_path / "m.gguf", "f32", tokenizer=tokenizer)
    reader = gguf.GGUFReader(str(path))
    fields = _fields(reader)
    assert fields["general.architecture"] == arch
    if model_type != "nemotron_h":  # whose attention has no RoPE
        rope = model.hf.config.rope_parameters
        theta = rope.get("full_attention", rope)["rope_theta"]  # olmo3: per layer type
        assert fields[f"{arch}.rope.freq_base"] == [pytest.approx(theta)]
    kv = model.hf.config.num_key_value_heads
    kv = [0, kv] if model_type == "lfm2" else [kv]  # lfm2: per layer, 0 on its conv layer
    kv = [1] if model_type == "deepseek_v3" else kv  # MLA absorbed: one compressed K/V head
    kv = [0, kv[0]] if model_type == "nemotron_h" else kv  # per layer: 0 off attention
    assert fields[f"{arch}.block_count"] == [2]
    assert fields[f"{arch}.attention.head_count_kv"] == kv
    assert fields.get(f"{arch}.expert_count") == ([experts] if experts else None)
    _assert_arch_fields(model_type, arch, fields, model.hf.config)
    known = set(gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[_arch_enum(arch)])
    tensors = {t.name: t for t in reader.tensors}
    for name in tensors:
        stem = name.removesuffix(".weight").removesuffix(".bias")
        assert any(stem == k.format(bid=b) for k in known for b in (0, 1)), name
    q_name, hf_q_name = (
        ("attn_q_b", "self_attn.q_b_proj")
        if model_type == "deepseek_v3"
        else (
            ("attn_q", "mixer.q_proj")
            if model_type == "nemotron_h"
            else ("attn_q", "self_attn.q_proj")
        )
    )
    q = torch.from_numpy(tensors[f"blk.1.{q_name}.weight"].data.copy())
    hf_q = state[f"model.layers.1.{hf_q_name}.weight"]
    want_q = permute_rotary(hf_q, 4) if permuted else hf_q
    if model_type == "falcon_h1":  # attention_in_multiplier folded in
        want_q = want_q * 0.7
    torch.testing.assert_close(q, want_q)
    names = gguf.get_tensor_name_map(_arch_enum(arch), 2)
    hf_name = next(
        n for n in state if n.startswith("model.layers.0.") and n.endswith("norm.weight")
    )
    hf_norm = state[hf_name]  # Gemma's 1 + w, stored
    norm = torch.from_numpy(tensors[names.get_name(hf_name, try_suffixes=(".weight",))].data.copy())
    torch.testing.assert_close(  # falcon_h1's SSM norm: (groups, d / groups)
        norm.flatten(), hf_norm + 1 if model_type == "gemma2" else hf_norm
    )
    if experts and model_type != "nemotron_h":  # the first MoE layer (glm4_moe's 0 is dense)
        key = next(n for n in state if n.endswith("experts.gate_up_proj"))
        gate_up, i = state[key], key.split(".")[2]  # (E, 2I, D), gate first
        if model_type == "llama4_text":  # Llama 4's (E, D, 2I)
            gate_up = gate_up.transpose(1, 2)
        up = torch.from_numpy(tensors[f"blk.{i}.ffn_up_exps.weight"].data.copy())
        torch.testing.assert_close(up, gate_up[:, gate_up.shape[1] // 2 :])
        router = tensors[f"blk.{i}.ffn_gate_inp.weight"]
        assert router.tensor_type == gguf.GGMLQuantizationType.F32
    assert len(tensors) == OUTSIDE.get(model_type, 3) + 2 * per_layer


def _assert_arch_fields(model_type, arch, fields, hf) -> None:
    """The architecture's own keys, as llama.cpp's converter writes them."""
    if model_type == "gemma2":
        assert fields["gemma2.attn_logit_softcapping"] == [pytest.approx(hf.attn_logit_softcapping)]
        assert fields["gemma2.final_logit_softcapping"] == [
            pytest.approx(hf.final_logit_softcapping)
        ]
        assert fields["gemma2.attention.sliding_window"] == [hf.sliding_window]
    if model_type in ("starcoder2", "stablelm", "phi"):
        eps = getattr(hf, "layer_norm_eps", None) or hf.norm_epsilon
        assert fields[f"{arch}.attention.layer_norm_epsilon"] == [pytest.approx(eps)]
    if model_type in ("stablelm", "phi"):  # partial rotary: 25% and 50% of the head
        rotary = hf.rope_parameters.get("partial_rotary_factor", 1.0)
        assert rotary < 1 and fields[f"{arch}.rope.dimension_count"] == [int(16 * rotary)]
    if model_type == "stablelm":
        assert fields["stablelm.use_parallel_residual"] == [hf.use_parallel_residual]
    if model_type == "olmo3":  # sliding, then full (transformers' layer_types)
        assert fields["olmo2.attention.sliding_window"] == [8]
        assert fields["olmo2.attention.sliding_window_pattern"] == [True, False]
    if model_type == "cohere2":
        assert fields["cohere2.logit_scale"] == [pytest.approx(hf.logit_scale)]
        assert fields["cohere2.attention.sliding_window"] == [hf.sliding_window]
        assert fields["cohere2.attention.layer_norm_epsilon"] == [pytest.approx(hf.layer_norm_eps)]
    if model_type == "glm4_moe":
        for key, want in [
            ("expert_shared_count", hf.n_shared_experts),
            ("leading_dense_block_count", hf.first_k_dense_replace),
            ("expert_feed_forward_length", hf.moe_intermediate_size),
            ("expert_gating_func", 2),  # gguf.ExpertGatingFuncType.SIGMOID
            ("expert_weights_norm", hf.norm_topk_prob),
            ("rope.dimension_count", 16 // 2),
            ("expert_group_count", 2),
            ("expert_group_used_count", 1),
        ]:  # fmt: skip (half the head)
            assert fields[f"glm4moe.{key}"] == [want], key
    if model_type == "ernie4_5_moe":
        for key, want in [("interleave_moe_layer_step", 1), ("leading_dense_block_count", 1),
                          ("expert_shared_count", 2), ("expert_feed_forward_length", 16),
                          ("expert_shared_feed_forward_length", 32)]:  # fmt: skip
            assert fields[f"ernie4_5-moe.{key}"] == [want], key
    if model_type == "llama4_text":  # the dense layers' width, the experts', the pattern
        for key, want in [("feed_forward_length", [96]), ("expert_feed_forward_length", [128]),
                          ("interleave_moe_layer_step", [2]), ("rope.dimension_count", [16]),
                          ("attention.sliding_window_pattern", [True, True])]:  # fmt: skip
            assert fields[f"llama4.{key}"] == want, key
    if model_type == "deepseek_v3":  # r = 8, rope 4, nope 4, v 8
        for key, want in [("attention.key_length", 8 + 4), ("attention.value_length", 8),
                          ("attention.key_length_mla", 4 + 4), ("attention.value_length_mla", 8),
                          ("attention.q_lora_rank", 8), ("attention.kv_lora_rank", 8),
                          ("rope.dimension_count", 4), ("leading_dense_block_count", 1),
                          ("expert_group_count", 2), ("expert_group_used_count", 1),
                          ("expert_gating_func", 2), ("expert_weights_norm", True),
                          ("expert_weights_scale", pytest.approx(2.5))]:  # fmt: skip
            assert fields[f"deepseek2.{key}"] == [want], key
    if model_type == "qwen3_next":  # Gated DeltaNet sizes; which layers are recurrent
        for key, want in [("ssm.conv_kernel", [4]), ("ssm.state_size", [8]),
                          ("ssm.group_count", [2]), ("ssm.time_step_rank", [4]),
                          ("ssm.inner_size", [32]), ("rope.dimension_count", [4]),
                          ("attention.recurrent_layers", [True, False])]:  # fmt: skip
            assert fields[f"qwen3next.{key}"] == want, key
    if model_type == "nemotron_h":  # per layer: the MoE width on MoE layers, else 0
        assert fields["nemotron_h_moe.feed_forward_length"] == [16, 0]
        assert fields["nemotron_h_moe.expert_shared_feed_forward_length"] == [32]
        assert fields["nemotron_h_moe.ssm.group_count"] == [2]
    if model_type == "falcon_h1":
        for key, want in [("ssm.conv_kernel", 4), ("ssm.inner_size", 32), ("ssm.state_size", 8),
                          ("ssm.time_step_rank", 4), ("ssm.group_count", 2)]:  # fmt: skip
            assert fields[f"falcon-h1.{key}"] == [want], key
    if model_type == "lfm2":
        assert fields["lfm2.shortconv.l_cache"] == [hf.conv_L_cache]
        assert fields["lfm2.attention.layer_norm_rms_epsilon"] == [pytest.approx(hf.norm_eps)]
    if model_type in ("granite", "granitemoe"):
        arch = "granitemoe" if model_type == "granitemoe" else "granite"
        for key, attr in [("attention.scale", "attention_multiplier"),
                          ("embedding_scale", "embedding_multiplier"),
                          ("residual_scale", "residual_multiplier"),
                          ("logit_scale", "logits_scaling")]:  # fmt: skip
            assert fields[f"{arch}.{key}"] == [pytest.approx(getattr(hf, attr))], key


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


@pytest.mark.parametrize(
    ("model_type", "overrides"),
    [("gemma2", {"tie_word_embeddings": True, "query_pre_attn_scalar": 16}),
     ("starcoder2", {"sliding_window": None}), ("stablelm", {}), ("lfm2", {}),
     ("minimax_m2", {})],
)  # fmt: skip
def test_transformers_reads_our_gguf_back_to_our_logits(tmp_path, quiet, tokenizer, model_type,  # noqa: F811
                                                         overrides):  # fmt: skip
    """transformers' GGUF loader (written after llama.cpp's converter: Gemma's norms - 1,
    StableLM's biases and parallel residual read from the tensors) gets back the config
    fields it reads and, on the original config, our logits on a 16-token prompt."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = _generic(tmp_path, model_type, **overrides)
    torch.manual_seed(4)
    for name, buf in model.named_buffers():  # MiniMax-M2's router bias: 0 would hide a loss
        if name.endswith("e_score_correction_bias"):
            buf.normal_(0, 0.5)
    ids = torch.tensor(tokenizer(PROMPT)["input_ids"])
    with torch.no_grad():
        ref = model(ids, SeqInfo.from_lengths([len(ids)]))
    folder = tmp_path / model_type
    export_gguf(model, folder / "m.gguf", "f32", tokenizer=tokenizer)
    read = AutoConfig.from_pretrained(folder, gguf_file="m.gguf")
    want = AutoConfig.from_pretrained(folder)
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size")  # fmt: skip
    if model_type != "lfm2":  # whose width transformers derives from block_ff_dim (256 here)
        keys += ("intermediate_size",)
    assert {k: getattr(read, k) for k in keys} == {k: getattr(want, k) for k in keys}
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file="m.gguf", config=want,
                                              dtype=torch.float32)  # fmt: skip
    with torch.no_grad():
        torch.testing.assert_close(hf(ids[None]).logits[0], ref, atol=1e-5, rtol=1e-5)


def test_generic_gguf_refusals_name_the_model_type(tmp_path, quiet, tokenizer):  # noqa: F811
    other = _generic(tmp_path, "mamba")
    with pytest.raises(ValueError, match="model_type .mamba. has no llama.cpp arch") as e:
        export_gguf(other, tmp_path / "a.gguf", "f32", tokenizer=tokenizer)
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
    cases = [  # what llama.cpp's architecture fixes otherwise
        ("gemma2", {"query_pre_attn_scalar": 16}, "gemma2 with an untied lm_head"),
        ("gemma2", {"tie_word_embeddings": True}, "gemma2 with query_pre_attn_scalar=256"),
        ("starcoder2", {"sliding_window": 8}, "starcoder2 with sliding_window=8"),
        ("phi", {}, "phi with 2 key/value heads"),
        ("smollm3", {"no_rope_layers": [1, 0]}, r"smollm3 with no_rope_layers=\[1, 0\]"),
        ("granite", {"head_dim": 4}, "granite with head_dim=4"),
        ("cohere2", {"layer_types": ["sliding_attention"] * 2}, "cohere2 with an untied lm_head"),
        ("cohere2", {"tie_word_embeddings": True}, r"cohere2 with layer_types \[.*\]"),
        ("glm4_moe", {"n_group": 4, "topk_group": 2}, "glm4_moe with n_group=4"),
        ("glm4_moe", {"n_shared_experts": 0}, "glm4_moe with no shared expert"),
        ("minimax_m2", {"tie_word_embeddings": True}, "minimax_m2 with a tied lm_head"),
        ("ernie4_5_moe", {"use_bias": True}, "ernie4_5_moe with use_bias=true"),
        (
            "llama4_text",
            {**LLAMA4, "attention_chunk_size": 16},
            "llama4_text with attention_chunk_size=16",
        ),
        (
            "llama4_text",
            {**LLAMA4, "no_rope_layers": [1, 0]},
            r"llama4_text with no_rope_layers=\[1, 0\]",
        ),
        (
            "deepseek_v3",
            {"head_dim": 4, "rope_interleave": False},
            "deepseek_v3 with rope_interleave=false",
        ),
        ("deepseek_v3", {"head_dim": 4, "q_lora_rank": None}, "deepseek_v3 with no q_lora_rank"),
        ("falcon_h1", {"mamba_rms_norm": True}, "falcon_h1 with mamba_norm_before_gate=true"),
        ("falcon_h1", {"attention_bias": True}, "falcon_h1 with attention_bias=true"),
        (
            "falcon_h1",
            {"time_step_limit": [0.0, 10.0]},
            r"falcon_h1 with time_step_limit=\(0.0, 10.0\)",
        ),
        ("qwen3_next", {"norm_topk_prob": False}, "qwen3_next with norm_topk_prob=false"),
        ("nemotron_h", {"layers_block_type": ["mlp", "moe"]}, "nemotron_h with dense mlp layers"),
        ("llama4_text", {**LLAMA4, "moe_layers": [0, 1]}, r"llama4_text with moe_layers=\[0, 1\]"),
        (
            "llama4_text",
            {**LLAMA4, "use_qk_norm": False},
            "llama4_text with use_qk_norm=False and 4 experts",
        ),
    ]
    for i, (model_type, overrides, match) in enumerate(cases):
        model = _generic(tmp_path / str(i), model_type, **overrides)
        with pytest.raises(ValueError, match=f"GGUF export: {match}: llama.cpp") as e:
            export_gguf(model, tmp_path / f"{i}.gguf", "f32", tokenizer=tokenizer)
        assert "\n" not in str(e.value) and "another model" in str(e.value)
    assert not list(tmp_path.glob("*.gguf"))


# 4 layers: with none NoPE (fewer than 4) llama.cpp 0.3.36 aborts ("tensor buffer not set":
# its query-temperature input, built for NoPE layers, has none to feed)
L4_LAYERS = dict(layers=4, no_rope_layers=[1, 1, 1, 0], moe_layers=[1, 3],
                 layer_types=["chunked_attention"] * 3 + ["full_attention"])  # fmt: skip
# Every type that exports, at LAYOUT's configs; Llama 4 with 4 layers so that its NoPE layer
# (the 4th: full attention, temperature-scaled queries) and two MoE layers run too.
RUNS = {**{t: LAYOUT[t][4] for t in LAYOUT}, "qwen2_moe": {},
        "nemotron_h": {**NEMOTRON, "layers": 4,  # Mamba-2, attention, MoE, Mamba-2
                       "layers_block_type": ["linear_attention", "full_attention", "moe",
                                             "linear_attention"]},
        "qwen3_next": {"layers": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"]},
        # Llama 4's released configs: llama3 RoPE scaling (the rope_freqs tensor; with head_dim
        # 16 and theta 1e4, of 8 frequencies 1 is in the high band, 2 between, 5 in the low)
        "llama4_llama3_rope": {**LLAMA4, **L4_LAYERS, "rope_parameters": dict(
            rope_type="llama3", rope_theta=1e4, factor=8.0, low_freq_factor=1.0,
            high_freq_factor=4.0, original_max_position_embeddings=64)},
        "llama4_text": {**LLAMA4, **L4_LAYERS},
        # DeepSeek-V3's released configs: YaRN with mscale (K.Q scaled by mscale squared)
        "deepseek_v3_yarn": {**LAYOUT["deepseek_v3"][4], "rope_parameters": dict(
            rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=16,
            beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)}}  # fmt: skip


@pytest.mark.parametrize("model_type", list(RUNS))
def test_llama_cpp_runs_a_generic_gguf_as_we_do(tmp_path, quiet, tokenizer, model_type):  # noqa: F811
    """llama.cpp's logits (relative 5e-3: it keeps K/V in f16) and 8 greedy tokens equal ours."""
    pytest.importorskip("llama_cpp")
    from test_gguf_llama_cpp import greedy_llama_cpp, greedy_ours, llama_cpp_logits

    kind = {"llama4_llama3_rope": "llama4_text", "deepseek_v3_yarn": "deepseek_v3"}.get(
        model_type, model_type
    )
    model = _generic(tmp_path, kind, **RUNS[model_type])
    torch.manual_seed(4)
    for name, buf in model.named_buffers():  # a router's score bias: 0 would hide a loss
        if name.endswith("e_score_correction_bias"):
            buf.normal_(0, 0.5)
    ids = tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        ref = model(torch.tensor(ids), SeqInfo.from_lengths([len(ids)]))
    path = export_gguf(model, tmp_path / "m.gguf", "f32", tokenizer=tokenizer)
    llm, got = llama_cpp_logits(path, ids)
    err = (got - ref).abs().max() / ref.abs().max()
    assert err < 5e-3, f"{model_type}: llama.cpp logits differ by {err:.2e} (relative)"
    assert greedy_llama_cpp(llm, ids, 8) == greedy_ours(model, ids, 8)
