"""Qwen3.5's GGUF (checkpoint/gguf_qwen35.py: llama.cpp's qwen35 / qwen35moe) for the four
types that hold its decoder: the text checkpoints (`qwen3_5_text`, `qwen3_5_moe_text`) and the
language model of the image-text ones (`qwen3_5`, `qwen3_5_moe`), each a tiny random
transformers model saved and loaded by the production loader. Without llama.cpp: the keys, the
tensors of each layer kind, the value heads in llama.cpp's tiled order checked index by index,
the transforms' inverses, the refusals. In llama.cpp itself (llama-cpp-python, skipped where
it is not installed): logits and greedy tokens equal ours on a prompt longer than a DeltaNet
chunk (64 tokens).

The tiny decoder: 3 DeltaNet layers then gated attention; 2 key heads, 4 value heads (r = 2,
so grouped and tiled orders differ); head_dim 16, half of it rotary (4 frequencies) under
M-RoPE sections [2, 1, 1] (each of t/h/w owns one: positions llama.cpp gave the wrong axis
would show).
"""

from __future__ import annotations

import pytest
import torch
from helpers.gguf_tokenizer import VOCAB
from helpers.gguf_tokenizer import tokenizer as tokenizer  # noqa: F401 (module fixture)
from helpers.tiny_hf import quiet as quiet  # noqa: F401 (module fixture)

from slipstream.checkpoint.gguf_export import export_gguf
from slipstream.checkpoint.hf import load_model
from slipstream.ops.packing import SeqInfo

KINDS = ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe"]
ROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
        "mrope_interleaved": True, "partial_rotary_factor": 0.5}  # fmt: skip
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_parameters=ROPE,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
            linear_value_head_dim=16, max_position_embeddings=512)  # fmt: skip
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=48)  # fmt: skip
VISION = dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=64,
              patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
              num_position_embeddings=16)  # fmt: skip
PROMPT = " ".join(["Hello, how are you doing today? I went hiking in the mountains."] * 3)
ARCH = {"qwen3_5_text": "qwen35", "qwen3_5": "qwen35", "qwen3_5_moe_text": "qwen35moe",
        "qwen3_5_moe": "qwen35moe"}  # fmt: skip


def _hf_model(kind: str, **text):
    """transformers' random model of `kind` at TEXT's sizes (+ `text`), norms randomised (they
    start at 0 or 1: a wrong offset would not show)."""
    import transformers

    text = {**TEXT, **(MOE if "moe" in kind else {}), **text}
    if kind.endswith("_text"):
        config = transformers.AutoConfig.for_model(kind, **text)
        model = transformers.AutoModelForCausalLM
    else:
        moe, tie = kind == "qwen3_5_moe", text.pop("tie_word_embeddings", False)  # top-level
        config = (transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config)(
            text_config=text, vision_config=VISION, image_token_id=300,
            vision_start_token_id=301, vision_end_token_id=302, tie_word_embeddings=tie,
        )  # fmt: skip
        model = transformers.AutoModelForImageTextToText
    torch.manual_seed(0)
    hf = model.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return hf


def _ours(tmp_path, kind: str, **text):
    _hf_model(kind, **text).save_pretrained(tmp_path / kind)
    return load_model(tmp_path / kind)


def _fields(reader) -> dict:
    out = {}
    for key, f in reader.fields.items():
        if f.data and not key.startswith("tokenizer.ggml.") or key == "tokenizer.ggml.pre":
            if f.types and f.types[-1].name == "STRING":
                out[key] = bytes(f.parts[f.data[0]]).decode()
            else:
                out[key] = [x for i in f.data for x in f.parts[i].tolist()]
    return out


def _tensors(reader) -> dict[str, torch.Tensor]:
    """The file's tensors in HF's (out, in) shapes (GGUF lists dims fastest-first)."""
    return {t.name: torch.from_numpy(t.data.copy()).reshape(list(reversed(t.shape.tolist())))
            for t in reader.tensors}  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
def test_qwen35_gguf_keys_and_each_layer_kinds_tensors(tmp_path, quiet, tokenizer, kind):  # noqa: F811
    """llama.cpp's qwen35/qwen35moe keys (rotary dims, M-RoPE sections + a 0, DeltaNet sizes,
    which layers are recurrent, qwen35's pre-tokenizer); a DeltaNet layer holds the ssm_*
    tensors and no attention, the attention layer q (query and gate: 2 H Dh rows), k, v and
    its norms; no MTP, no vision tower, nothing else."""
    import gguf

    model = _ours(tmp_path, kind)
    reader = gguf.GGUFReader(str(export_gguf(model, tmp_path / "m.gguf", "f32", tokenizer)))
    fields, arch = _fields(reader), ARCH[kind]
    assert fields["general.architecture"] == arch
    want = {"block_count": [4], "embedding_length": [64], "attention.head_count": [4],
            "attention.head_count_kv": [2], "attention.key_length": [16],
            "rope.dimension_count": [8], "rope.dimension_sections": [2, 1, 1, 0],
            "rope.freq_base": [10000.0], "ssm.conv_kernel": [4], "ssm.state_size": [16],
            "ssm.group_count": [2], "ssm.time_step_rank": [4], "ssm.inner_size": [64],
            "attention.recurrent_layers": [True, True, True, False],
            "full_attention_interval": [4], "context_length": [512]}  # fmt: skip
    if arch == "qwen35moe":
        want.update({"expert_count": [4], "expert_used_count": [2],
                     "expert_feed_forward_length": [32],
                     "expert_shared_feed_forward_length": [48]})  # fmt: skip
    assert {k: fields.get(f"{arch}.{k}") for k in want} == want
    assert fields["tokenizer.ggml.pre"] == "qwen35"
    names = [t.name for t in reader.tensors]
    ffn = (["ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_inp_shexp",
            "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"] if arch == "qwen35moe"
           else ["ffn_gate", "ffn_up", "ffn_down"])  # fmt: skip
    norms = ["attn_norm", "post_attention_norm"]
    linear = ["attn_qkv", "attn_gate", "ssm_conv1d", "ssm_dt", "ssm_a", "ssm_beta", "ssm_alpha",
              "ssm_norm", "ssm_out"]  # fmt: skip
    attention = ["attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm"]
    for i, kinds in enumerate([linear] * 3 + [attention]):
        got = sorted(n.split(".")[2] for n in names if n.startswith(f"blk.{i}."))
        assert got == sorted(norms + kinds + ffn), i
    assert sorted(n for n in names if not n.startswith("blk.")) == [
        "output.weight", "output_norm.weight", "token_embd.weight"]  # fmt: skip
    shapes = {t.name: list(reversed(t.shape.tolist())) for t in reader.tensors}
    assert shapes["blk.3.attn_q.weight"] == [2 * 4 * 16, 64]
    assert shapes["blk.0.ssm_conv1d.weight"] == [2 * 2 * 16 + 4 * 16, 4]


def test_qwen35_gguf_leaves_the_mtp_head_out(tmp_path, quiet, tokenizer):  # noqa: F811
    """A checkpoint with an MTP head (`mtp.*`, which the loader skips): the GGUF holds
    the trunk alone (no nextn key or tensors, block_count the decoder's layers), which
    llama.cpp runs as it runs a file converted without MTP."""
    import gguf
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "qwen3_5_text"
    _hf_model("qwen3_5_text").save_pretrained(folder)
    weights = load_file(folder / "model.safetensors")
    weights.update({"mtp.fc.weight": torch.randn(64, 128), "mtp.norm.weight": torch.zeros(64),
                    "mtp.layers.0.mlp.up_proj.weight": torch.randn(128, 64)})  # fmt: skip
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    model = load_model(folder)
    assert not [n for n, _ in model.named_parameters() if "mtp" in n]  # loaded past, not held
    reader = gguf.GGUFReader(str(export_gguf(model, tmp_path / "m.gguf", "f32", tokenizer)))
    fields = _fields(reader)
    assert fields["qwen35.block_count"] == [4]
    assert not [k for k in fields if "nextn" in k]
    assert not [t.name for t in reader.tensors if "nextn" in t.name or t.name.startswith("blk.4")]


def test_qwen35_value_heads_tiled_and_stored_forms(tmp_path, quiet, tokenizer):  # noqa: F811
    """Against explicit indices: llama.cpp's value head j = i * Hk + k is HF's head k * r + i
    (key head k, i-th of its r) in every value-head axis (the V rows of attn_qkv and its conv
    channels, attn_gate, ssm_beta/alpha rows, ssm_a, ssm_dt, ssm_out's columns); A stored as
    -exp(A_log); RMSNorms + 1 except the DeltaNet's gated one; q/k rows and attention as HF's."""
    import gguf

    model = _ours(tmp_path, "qwen3_5_text")
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    reader = gguf.GGUFReader(str(export_gguf(model, tmp_path / "m.gguf", "f32", tokenizer)))
    got = _tensors(reader)
    Hk, r, V, QK = 2, 2, 16, 2 * 2 * 16
    hf_head = [k * r + i for i in range(r) for k in range(Hk)]  # llama.cpp head j -> HF head
    rows = torch.tensor([h * V + d for h in hf_head for d in range(V)])
    la = "model.layers.0.linear_attn."

    def same(name: str, want: torch.Tensor) -> None:
        torch.testing.assert_close(got[name], want.float(), rtol=0, atol=0, msg=name)

    qkv = state[la + "in_proj_qkv.weight"]
    same("blk.0.attn_qkv.weight", torch.cat([qkv[:QK], qkv[QK:][rows]]))
    conv = state[la + "conv1d.weight"][:, 0]
    same("blk.0.ssm_conv1d.weight", torch.cat([conv[:QK], conv[QK:][rows]]))
    same("blk.0.attn_gate.weight", state[la + "in_proj_z.weight"][rows])
    same("blk.0.ssm_beta.weight", state[la + "in_proj_b.weight"][hf_head])
    same("blk.0.ssm_alpha.weight", state[la + "in_proj_a.weight"][hf_head])
    same("blk.0.ssm_out.weight", state[la + "out_proj.weight"][:, rows])
    same("blk.0.ssm_dt.bias", state[la + "dt_bias"][hf_head])
    torch.testing.assert_close(got["blk.0.ssm_a"], -state[la + "A_log"][hf_head].exp())
    same("blk.0.ssm_norm.weight", state[la + "norm.weight"])
    same("blk.0.attn_norm.weight", state["model.layers.0.input_layernorm.weight"] + 1)
    same("blk.3.attn_q_norm.weight", state["model.layers.3.self_attn.q_norm.weight"] + 1)
    same("output_norm.weight", state["model.norm.weight"] + 1)
    same("blk.3.attn_q.weight", state["model.layers.3.self_attn.q_proj.weight"])  # no permute
    same("blk.3.attn_k.weight", state["model.layers.3.self_attn.k_proj.weight"])


def test_qwen35_transforms_invert(tmp_path, quiet):  # noqa: F811
    """Each layout change's inverse gives the HF tensor back (MoE's shared-expert gate too)."""
    from slipstream.checkpoint.gguf_qwen35 import QWEN35MOE

    model = _ours(tmp_path, "qwen3_5_moe_text")
    seen = set()
    for name, p in model.named_parameters():
        tr = QWEN35MOE.transform(name)
        if tr not in QWEN35MOE.transforms or tr in seen:
            continue  # no change, or the generic stacked experts' split
        seen.add(tr)
        t = torch.randn_like(p.detach())  # dt_bias starts at ones: any order would equal it
        parts = [x for _, x in tr.to_llama_cpp(model.config, name, t)]
        moved = parts[0].shape != t.shape or not torch.equal(parts[0], t)
        assert moved or name.endswith("linear_attn.norm.weight"), name  # a change, but one
        (back_name, back), *_ = tr.to_hf(model.config, name, parts)
        assert back_name == name
        torch.testing.assert_close(back, t, msg=name)
    assert seen == set(QWEN35MOE.transforms)


@pytest.mark.parametrize(
    ("text", "match"),
    [({"linear_value_head_dim": 8}, "linear_key_head_dim=16 != linear_value_head_dim=8: llama"),
     ({"rms_norm_eps": 1e-5}, "rms_norm_eps=1e-05: llama.cpp L2-normalises"),
     ({"rope_parameters": {**ROPE, "mrope_section": [1, 1, 2]}},
      r"mrope_section=\[1, 1, 2\] for 4 rotary frequencies: llama.cpp's interleaved")],
)  # fmt: skip
def test_qwen35_gguf_refuses_what_llama_cpp_runs_differently(tmp_path, quiet, tokenizer, text,  # noqa: F811
                                                              match):  # fmt: skip
    """One line naming the setting and why, before anything is written. ([1, 1, 2]: HF turns
    the 4th frequency by t, llama.cpp's sections cycle it onto the 4th row, 0 for text.)"""
    model = _ours(tmp_path, "qwen3_5_text", **text)
    with pytest.raises(ValueError, match=f"GGUF export: qwen3_5_text with {match}") as e:
        export_gguf(model, tmp_path / "m.gguf", "f32", tokenizer=tokenizer)
    assert "\n" not in str(e.value) and "another model" in str(e.value)
    assert not list(tmp_path.glob("*.gguf"))


@pytest.mark.parametrize("kind", [*KINDS, "qwen3_5_tied"])
def test_llama_cpp_runs_qwen35_as_we_do(tmp_path, quiet, tokenizer, kind):  # noqa: F811
    """llama.cpp's logits on a 107-token prompt (two DeltaNet chunks here; one batch there)
    within 2e-3 relative of ours (measured 1.0-1.8e-4: it keeps K/V in f16) and 8 greedy
    tokens equal, each decoded alone (llama.cpp's recurrent state and its M-RoPE positions:
    a text token's one position becomes (p, p, p, 0) in its graph input)."""
    pytest.importorskip("llama_cpp")
    from test_gguf_llama_cpp import greedy_llama_cpp, greedy_ours, llama_cpp_logits

    tied = kind == "qwen3_5_tied"  # the small releases' tied head: token_embd used twice
    model = _ours(tmp_path, "qwen3_5" if tied else kind, tie_word_embeddings=tied)
    assert model.config.tie_word_embeddings == tied
    ids = tokenizer(PROMPT)["input_ids"]
    assert 64 < len(ids) < 120
    with torch.no_grad():
        ref = model(torch.tensor(ids), SeqInfo.from_lengths([len(ids)]))
    path = export_gguf(model, tmp_path / "m.gguf", "f32", tokenizer=tokenizer)
    llm, got = llama_cpp_logits(path, ids)
    err = (got - ref).abs().max() / ref.abs().max()
    assert err < 2e-3, f"{kind}: llama.cpp logits differ by {err:.2e} (relative)"
    assert greedy_llama_cpp(llm, ids, 8) == greedy_ours(model, ids, 8)


def test_qwen35_gguf_lora_regroups_a_columns_and_b_rows(tmp_path, quiet):  # noqa: F811
    """A GGUF LoRA's factors in the weights' llama.cpp layout: out_proj's A (r, in) with its
    value-head columns tiled (B as is), in_proj_z's B (out, r) with its rows tiled (A as is),
    the attention's as they are; against the same explicit indices as the weights."""
    import gguf

    from slipstream.checkpoint.adapter import save_adapter
    from slipstream.checkpoint.gguf_lora import export_adapter_gguf
    from slipstream.peft.lora import apply_lora
    from tests.helpers.models import randomise_lora_b

    model = _ours(tmp_path, "qwen3_5_text")
    apply_lora(model, rank=4, alpha=4, targets="all-linear")
    randomise_lora_b(model)
    state = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    save_adapter(model, tmp_path / "run", base_model_name_or_path=str(tmp_path / "qwen3_5_text"))
    got = _tensors(gguf.GGUFReader(str(export_adapter_gguf(tmp_path / "run", tmp_path / "a.gguf"))))
    hf_head = [k * 2 + i for i in range(2) for k in range(2)]  # as in the weights' test
    rows = torch.tensor([h * 16 + d for h in hf_head for d in range(16)])
    la, at = "model.layers.0.linear_attn.", "model.layers.3.self_attn."

    def factor(module: str, ab: str) -> torch.Tensor:
        return state[f"{module}.lora_{ab}.weight"]

    torch.testing.assert_close(
        got["blk.0.ssm_out.weight.lora_a"], factor(la + "out_proj", "A")[:, rows]
    )
    torch.testing.assert_close(got["blk.0.ssm_out.weight.lora_b"], factor(la + "out_proj", "B"))
    torch.testing.assert_close(got["blk.0.attn_gate.weight.lora_a"], factor(la + "in_proj_z", "A"))
    torch.testing.assert_close(
        got["blk.0.attn_gate.weight.lora_b"], factor(la + "in_proj_z", "B")[rows]
    )
    torch.testing.assert_close(got["blk.3.attn_q.weight.lora_b"], factor(at + "q_proj", "B"))


@pytest.mark.parametrize("kind", ["qwen3_5_text", "qwen3_5"])
def test_qwen35_gguf_lora_in_llama_cpp_moves_logits_as_merging(tmp_path, quiet, tokenizer, kind):  # noqa: F811
    """A LoRA on every linear (the DeltaNet's five: out_proj's A columns regrouped as the
    weight's, in_proj_qkv/z/a/b's B rows) as a GGUF LoRA on our base GGUF: llama.cpp's logits
    move as merging moves ours (within 5% of the move)."""
    pytest.importorskip("llama_cpp")
    from safetensors import safe_open
    from test_gguf_llama_cpp import assert_gguf_lora_moves_as_merging

    run = assert_gguf_lora_moves_as_merging(
        _ours(tmp_path, kind), tmp_path / kind, tmp_path, tokenizer, "all-linear"
    )
    with safe_open(str(run / "adapter_model.safetensors"), framework="pt") as f:
        assert any("linear_attn.out_proj.lora_A" in key for key in f.keys())  # noqa: SIM118


def test_llama_cpp_runs_a_quantised_qwen35(tmp_path, quiet, tokenizer):  # noqa: F811
    """f16, q8_0 (ours) and q4_k_m (llama.cpp's quantizer): the conv kernels stay f32 (an f16
    one aborts llama.cpp's ssm_conv), the rest is quantised, and llama.cpp's logits stay near
    ours. Measured (width 256): f16 9.9e-4, q8_0 2.9e-2, q4_k_m 0.31 (our q4_0: 0.29, so
    quantisation noise; a layout error is ~1: 1.47 without the value-head regrouping)."""
    pytest.importorskip("llama_cpp")
    import gguf
    from test_gguf_llama_cpp import llama_cpp_logits

    model = _ours(tmp_path, "qwen3_5_text", hidden_size=256, intermediate_size=512)
    ids = tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        ref = model(torch.tensor(ids), SeqInfo.from_lengths([len(ids)]))
    for type, tol in (("f16", 5e-3), ("q8_0", 6e-2), ("q4_k_m", 0.5)):
        path = export_gguf(model, tmp_path / f"{type}.gguf", type, tokenizer=tokenizer)
        types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
        assert types["blk.0.ssm_conv1d.weight"] == "F32"
        assert types["blk.0.attn_qkv.weight"] != "F32"
        _, got = llama_cpp_logits(path, ids)
        err = (got - ref).abs().max() / ref.abs().max()
        assert 0 < err < tol, f"{type}: {err:.2e}"
