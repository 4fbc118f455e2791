"""GGUF export: every family round-trips through transformers' GGUF loader and our import;
the tokenizer, special tokens and chat template travel in the file; bad input is one line."""

import os

import numpy as np
import pytest
import torch

from slipstream.checkpoint.gguf_export import GGUF_TYPES, export_gguf
from slipstream.checkpoint.hf import load_model
from slipstream.checkpoint.tokenizer import load_tokenizer
from slipstream.ops.packing import SeqInfo
from tests.helpers import gguf_tokenizer
from tests.helpers.gguf_tokenizer import VOCAB
from tests.helpers.models import make_hf_model, ours_from_hf
from tests.helpers.moe_models import make_hf_moe_model

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
tokenizer = gguf_tokenizer.tokenizer  # the module-scoped fixture

DENSE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
             num_key_value_heads=2)  # fmt: skip
# transformers' GGUF reader takes config defaults for keys its table lacks: Qwen3's head_dim
# (128), Qwen3-MoE's moe_intermediate_size (768), Gemma 3's query scale (256 = head_dim here).
OVERRIDES = {
    "qwen3": dict(head_dim=128, num_attention_heads=2, num_key_value_heads=1),
    "gemma3_text": dict(
        head_dim=256, query_pre_attn_scalar=256, num_attention_heads=2, num_key_value_heads=1
    ),  # fmt: skip
}
# max |logit error| / max |logit| allowed per type (f16: rounding; q8_0: 8-bit blocks).
TOLERANCE = {"f16": 2e-3, "q8_0": 4e-2}
SCALE = {"gemma3_text": 2.5}  # Gemma multiplies the embeddings by sqrt(hidden): errors grow
PROMPT = "Hello, how are you doing today? I am fine, thanks."


def tiny_hf(kind: str):
    if kind == "qwen3_moe":
        hf = make_hf_moe_model(kind, vocab_size=VOCAB, hidden_size=64, head_dim=128,
                               num_attention_heads=2, num_key_value_heads=1,
                               moe_intermediate_size=768)  # fmt: skip
        with torch.no_grad():  # wide experts: keep their outputs O(1) so q8_0 flips no route
            for name, p in hf.named_parameters():
                if "experts" in name:
                    p.mul_(0.05)
        return hf
    return make_hf_model(kind, **{**DENSE, **OVERRIDES.get(kind, {})})


@pytest.mark.parametrize("type", ["f16", "q8_0"])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "qwen3_moe", "phi3", "gemma3_text"])
def test_roundtrip_transformers_and_ours(tmp_path, tokenizer, kind, type):
    hf = tiny_hf(kind)
    ours = ours_from_hf(hf)
    ids = torch.tensor(tokenizer(PROMPT)["input_ids"])
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        path = export_gguf(ours, tmp_path / "m.gguf", type, tokenizer=tokenizer)
        back = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path, gguf_file="m.gguf", dtype=torch.float32
        ).eval()
        theirs = back(ids[None]).logits[0]
        mine = load_model(path)(ids, SeqInfo.from_lengths([len(ids)]))
    scale = ref.abs().max()
    err = (theirs - ref).abs().max() / scale
    assert err < TOLERANCE[type] * SCALE.get(kind, 1), f"{kind} {type}: relative error {err:.2e}"
    assert err > 0  # the weights did go through f16/q8_0
    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)  # same dequantised weights
    assert list(tmp_path.glob(".*tmp")) == []


def test_q8_0_is_quantized_and_smaller(tmp_path, tokenizer):
    ours = ours_from_hf(tiny_hf("llama"))
    f16 = export_gguf(ours, tmp_path / "a.gguf", "f16", tokenizer=tokenizer)
    q8 = export_gguf(ours, tmp_path / "b.gguf", "q8_0", tokenizer=tokenizer)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(q8)).tensors}
    assert types["blk.0.attn_q.weight"] == "Q8_0" and types["blk.0.attn_norm.weight"] == "F32"
    assert os.path.getsize(q8) < 0.75 * os.path.getsize(f16)


def test_tokenizer_and_chat_template_travel(tmp_path, tokenizer):
    ours = ours_from_hf(tiny_hf("qwen2"))
    path = export_gguf(ours, tmp_path / "m.gguf", "f16", tokenizer=tokenizer)
    back = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    msgs = [{"role": "user", "content": "Hi there!"}]
    assert back.chat_template == tokenizer.chat_template
    assert back.apply_chat_template(msgs, tokenize=False) == tokenizer.apply_chat_template(
        msgs, tokenize=False
    )
    assert back(PROMPT)["input_ids"] == tokenizer(PROMPT)["input_ids"]
    fields = gguf.GGUFReader(str(path)).fields
    eos = int(fields["tokenizer.ggml.eos_token_id"].contents())
    assert eos == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert fields["tokenizer.ggml.pre"].contents() == "qwen2"


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, tokenizer, monkeypatch):
    ours = ours_from_hf(tiny_hf("llama"))
    with pytest.raises(ValueError, match="unknown GGUF type 'q3_x'; one of: f32, f16"):
        export_gguf(ours, tmp_path / "m.gguf", "q3_x", tokenizer=tokenizer)
    with pytest.raises(ValueError, match="does not exist"):
        export_gguf(ours, tmp_path / "no" / "m.gguf", "f16", tokenizer=tokenizer)
    with pytest.raises(ValueError, match="is a folder"):
        export_gguf(ours, tmp_path, "f16", tokenizer=tokenizer)
    with pytest.raises(ValueError, match="needs the tokenizer"):
        export_gguf(ours, tmp_path / "m.gguf", "f16")
    ours.config.model_type = "falcon"
    with pytest.raises(ValueError, match="model_type 'falcon' has no llama.cpp architecture"):
        export_gguf(ours, tmp_path / "m.gguf", "f16", tokenizer=tokenizer)
    ours.config.model_type = "llama"
    monkeypatch.setitem(__import__("sys").modules, "llama_cpp", None)  # not installed
    with pytest.raises(ValueError, match=r"pip install 'slipstream\[gguf\]'"):
        export_gguf(ours, tmp_path / "m.gguf", "q4_k_m", tokenizer=tokenizer)
    assert list(tmp_path.iterdir()) == []


def test_interrupted_write_leaves_nothing(tmp_path, tokenizer, monkeypatch):
    from slipstream.checkpoint import gguf_export

    ours = ours_from_hf(tiny_hf("llama"))
    target = export_gguf(ours, tmp_path / "m.gguf", "f16", tokenizer=tokenizer)
    before = target.read_bytes()

    def boom(t, qtype):
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_export, "_convert", boom)
    with pytest.raises(KeyboardInterrupt):
        export_gguf(ours, target, "q8_0", tokenizer=tokenizer)
    assert target.read_bytes() == before  # the old file intact, no temp left
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


def test_types_listed():
    assert {"f16", "bf16", "q8_0", "q4_k_m", "q5_k_m", "q6_k"} <= set(GGUF_TYPES)


@pytest.fixture
def lora_run(tmp_path, tokenizer):
    """A tiny llama base (HF folder) and a LoRA run folder (adapter + tokenizer) on it."""
    from slipstream.checkpoint.adapter import save_adapter
    from slipstream.peft.lora import apply_lora
    from tests.helpers.models import randomise_lora_b

    hf = tiny_hf("llama")
    base = tmp_path / "base"
    hf.save_pretrained(base)
    model = load_model(base)
    apply_lora(model, rank=8, alpha=16, targets="all-linear")
    randomise_lora_b(model)
    run = tmp_path / "run"
    save_adapter(model, run, base_model_name_or_path=str(base))
    tokenizer.save_pretrained(run)
    return base, run


def test_cli_exports_run_with_modelfile(lora_run, tmp_path, tokenizer):
    from slipstream.checkpoint.adapter import load_adapter
    from slipstream.cli import main
    from slipstream.peft.lora import merge_lora

    base, run = lora_run
    out = tmp_path / "m.gguf"
    assert main(["export", str(run), "--gguf", "q8_0", "--out", str(out)]) == 0
    merged = load_model(base)
    load_adapter(merged, run)
    merge_lora(merged)
    ids = torch.tensor(tokenizer(PROMPT)["input_ids"])
    seq = SeqInfo.from_lengths([len(ids)])
    with torch.no_grad():
        ref, got = merged(ids, seq), load_model(out)(ids, seq)
        plain = load_model(base)(ids, seq)
    err = (got - ref).abs().max() / ref.abs().max()
    assert err < TOLERANCE["q8_0"]
    assert (plain - ref).abs().max() > 10 * (got - ref).abs().max()  # the adapter is in it
    modelfile = (tmp_path / "m.Modelfile").read_text()  # named after its GGUF
    assert modelfile.startswith("FROM ./m.gguf\n")
    assert 'PARAMETER stop "<|im_end|>"' in modelfile
    assert 'eq .Role "user" }}<|im_start|>user\n{{ .Content }}<|im_end|>\n' in modelfile


def test_cli_errors_are_one_line(lora_run, tmp_path, capsys):
    from slipstream.cli import main

    _, run = lora_run
    assert main(["export", str(run), "--gguf", "q9"]) == 2
    assert "unknown GGUF type 'q9'" in capsys.readouterr().err
    assert main(["export", str(run), "--gguf", "f16", "--out", "/proc/x.gguf"]) == 2
    assert "not writable" in capsys.readouterr().err
    assert main(["export", str(tmp_path), "--gguf", "f16"]) == 2
    assert "neither an adapter" in capsys.readouterr().err


def test_gguf_lora_applied_to_base_equals_merged(lora_run, tmp_path):
    """llama.cpp's rule (W + alpha/r * B @ A, on the f32 GGUF tensors) gives the merged file."""
    from slipstream.checkpoint.gguf_lora import export_adapter_gguf
    from slipstream.cli import main

    base, run = lora_run
    assert main(["export", str(run), "--gguf", "f32", "--out", str(tmp_path / "merged.gguf")]) == 0
    base_model = load_model(base)
    export_gguf(base_model, tmp_path / "base.gguf", "f32", tokenizer=str(run))
    lora = export_adapter_gguf(run, tmp_path / "lora.gguf")

    def tensors(p):
        return {t.name: np.array(t.data) for t in gguf.GGUFReader(str(p)).tensors}

    merged, plain, ab = (
        tensors(tmp_path / "merged.gguf"),
        tensors(tmp_path / "base.gguf"),
        tensors(lora),
    )
    fields = gguf.GGUFReader(str(lora)).fields
    assert fields["general.type"].contents() == "adapter"
    alpha = float(fields["adapter.lora.alpha"].contents())
    adapted = [n.removesuffix(".lora_a") for n in ab if n.endswith(".lora_a")]
    assert "blk.0.attn_q.weight" in adapted and "blk.1.ffn_down.weight" in adapted
    for name in adapted:
        a, b = ab[name + ".lora_a"], ab[name + ".lora_b"]
        applied = plain[name] + alpha / a.shape[0] * (b @ a)
        np.testing.assert_allclose(applied, merged[name], atol=1e-5, err_msg=name)


def test_bf16_roundtrip_through_our_import(tmp_path, tokenizer):
    hf = tiny_hf("qwen2")
    ours = ours_from_hf(hf)
    path = export_gguf(ours, tmp_path / "m.gguf", "bf16", tokenizer=tokenizer)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert types["blk.0.ffn_up.weight"] == "BF16"
    back = dict(load_model(path).named_parameters())
    for name, p in ours.named_parameters():
        want = p if p.ndim == 1 else p.to(torch.bfloat16).float()  # 1-D tensors stay f32
        torch.testing.assert_close(back[name], want, atol=0, rtol=0, msg=name)


@pytest.mark.parametrize(
    "kind, overrides, match",
    [
        ("gemma3_text", dict(head_dim=16, query_pre_attn_scalar=256), "query_pre_attn_scalar"),
        ("gpt_oss", dict(swiglu_limit=1.0), "swiglu_limit"),
        ("qwen3_moe", dict(norm_topk_prob=False), "norm_topk_prob"),
        ("gpt_oss", dict(swiglu_limit=7.0, layer_types=["full_attention"] * 2), "layer_types"),
        ("gemma3_text", dict(layer_types=["sliding_attention", "full_attention"]), "layer_types"),
    ],
)
def test_what_llama_cpp_would_compute_differently_is_refused(
    tmp_path, tokenizer, kind, overrides, match
):
    if kind == "gemma3_text":
        hf = make_hf_model(kind, **{**DENSE, **overrides})
    else:
        hf = make_hf_moe_model(kind, vocab_size=VOCAB, **overrides)
    with pytest.raises(ValueError, match=match):
        export_gguf(ours_from_hf(hf), tmp_path / "m.gguf", "f16", tokenizer=tokenizer)
    assert list(tmp_path.iterdir()) == []


def test_gpt_oss_experts_in_llama_cpp_layout(tmp_path, tokenizer):
    """gate/up de-interleaved and (E, out, in): what llama.cpp's converter writes."""
    hf = make_hf_moe_model("gpt_oss", vocab_size=VOCAB, swiglu_limit=7.0)
    ours = ours_from_hf(hf)
    path = export_gguf(ours, tmp_path / "m.gguf", "f32", tokenizer=tokenizer)
    t = {x.name: np.array(x.data) for x in gguf.GGUFReader(str(path)).tensors}
    experts = hf.model.layers[1].mlp.experts
    gate_up = experts.gate_up_proj.detach().numpy()  # (E, D, 2I), gate at even columns
    np.testing.assert_array_equal(
        t["blk.1.ffn_gate_exps.weight"], gate_up[..., 0::2].swapaxes(1, 2)
    )
    np.testing.assert_array_equal(t["blk.1.ffn_up_exps.weight"], gate_up[..., 1::2].swapaxes(1, 2))
    np.testing.assert_array_equal(
        t["blk.1.ffn_down_exps.weight"], experts.down_proj.detach().numpy().swapaxes(1, 2)
    )
    bias = experts.gate_up_proj_bias.detach().numpy()
    np.testing.assert_array_equal(t["blk.1.ffn_up_exps.bias"], bias[:, 1::2])
    sinks = hf.model.layers[0].self_attn.sinks.detach().numpy()
    np.testing.assert_array_equal(t["blk.0.attn_sinks.weight"], sinks)
    fields = gguf.GGUFReader(str(path)).fields
    assert int(fields["gpt-oss.expert_count"].contents()) == 8


LONGROPE = dict(partial_rotary_factor=0.5, original_max_position_embeddings=8,
                max_position_embeddings=64, rope_parameters=dict(
                    rope_type="longrope", rope_theta=10000.0, short_factor=[1.0, 1.3, 0.9, 1.1],
                    long_factor=[2.0, 5.0, 3.0, 1.5]))  # fmt: skip


@pytest.mark.parametrize("kind", ["gpt_oss", "phi3_longrope"])
def test_our_import_alone_matches_the_source(tmp_path, tokenizer, kind):
    """gpt-oss (transformers' GGUF reader cannot parse its RoPE metadata) and Phi-3 longrope
    (factor sets stored as tensors): an f32 file read by our import computes the transformers
    model's logits, below and past original_max_position_embeddings, with the same config."""
    from dataclasses import replace

    from slipstream.models import phi3

    if kind == "gpt_oss":  # llama.cpp fixes the clamp at 7.0; wide experts so it bites
        hf = make_hf_moe_model(kind, vocab_size=VOCAB, hidden_size=64, swiglu_limit=7.0)
    else:
        hf = make_hf_model("phi3", **{**DENSE, **LONGROPE})
    ours = ours_from_hf(hf)
    path = export_gguf(ours, tmp_path / "m.gguf", "f32", tokenizer=tokenizer)
    back = load_model(path)
    ids = torch.tensor(tokenizer(PROMPT)["input_ids"])
    for n in (5, len(ids)):  # 5 < original_max_position_embeddings (8) < len(ids)
        with torch.no_grad():
            ref = hf(ids[None, :n]).logits[0]
            got = back(ids[:n], SeqInfo.from_lengths([n]))
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)
    assert replace(back.config, hf={}) == replace(ours.config, hf={})
    # The tokenizer comes back too (gpt-oss: not through AutoTokenizer, which parses the config).
    tok = load_tokenizer(str(path))
    assert tok(PROMPT)["input_ids"] == ids.tolist()
    assert tok.chat_template == tokenizer.chat_template
    if kind == "gpt_oss":
        from slipstream.models.gpt_oss import layer_windows

        assert layer_windows(back.config) == layer_windows(ours.config) == [4, None]
        assert [layer.mlp.experts.limit for layer in back.model.layers] == [7.0, 7.0]
    else:
        assert phi3.Phi3Rope.from_hf(back.config.hf) == phi3.Phi3Rope.from_hf(ours.config.hf)


def test_gguf_name_drops_the_sources_quant_suffix(tmp_path, tokenizer):
    """A q8_0 re-export of 'X.Q4_1.gguf' was named 'X.Q4_1' (general.name copied the stem)."""
    src = export_gguf(ours_from_hf(tiny_hf("llama")), tmp_path / "Tiny-Chat-1M.Q4_1.gguf", "q4_1",
                      tokenizer=tokenizer)  # fmt: skip
    out = export_gguf(load_model(src), tmp_path / "out.gguf", "q8_0")
    fields = gguf.GGUFReader(str(out)).fields
    assert fields["general.name"].contents() == "Tiny-Chat-1M"
    assert fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_Q8_0)
    from slipstream.checkpoint.gguf_export import model_name

    class Loaded:  # what load_model notes for the built-in SmolLM2 file (its hub id)
        name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
        checkpoint_path = "/x/SmolLM2-135M-Instruct.Q4_1.gguf"

    assert model_name(Loaded()) == "SmolLM2-135M-Instruct"


def test_cli_gguf_goes_to_run_gguf_with_a_modelfile_each(lora_run, tmp_path, capsys):
    """Beside adapter_config.json, from_pretrained(run, gguf_file=...) followed the adapter to
    the hub; two exports shared one Modelfile; a second export replaced the first silently."""
    from slipstream.cli import main

    base, run = lora_run
    assert main(["export", str(run), "--gguf", "f16"]) == 0
    folder, path = run / "gguf", run / "gguf" / "run.f16.gguf"
    assert str(path) in capsys.readouterr().out  # the log says where
    assert not list(run.glob("*.gguf")) and not (run / "Modelfile").exists()
    ids = torch.tensor([5, 17, 42, 9])
    back = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=path.name)
    with torch.no_grad():
        want = load_model(path)(ids, SeqInfo.from_lengths([len(ids)]))
        torch.testing.assert_close(back(ids[None]).logits[0], want, atol=1e-4, rtol=1e-4)

    assert main(["export", str(run), "--gguf", "q8_0"]) == 0  # a second type, same folder
    for t in ("f16", "q8_0"):
        assert (folder / f"run.{t}.Modelfile").read_text().startswith(f"FROM ./run.{t}.gguf\n")
    capsys.readouterr()
    assert main(["export", str(run), "--gguf", "f16"]) == 2  # there already: not replaced
    err = capsys.readouterr().err.strip()
    assert "run.f16.gguf' exists; pass --force" in err and len(err.splitlines()) == 1
    stamp = path.stat().st_mtime_ns
    assert main(["export", str(run), "--gguf", "f16", "--force"]) == 0
    assert path.stat().st_mtime_ns != stamp
    assert main(["export", str(run), "--gguf-adapter"]) == 0
    assert (folder / "adapter.gguf").is_file() and not (run / "adapter.gguf").exists()
    out = tmp_path / "elsewhere"
    out.mkdir()
    assert main(["export", str(run), "--gguf", "f16", "--out", str(out)]) == 0  # a folder
    assert sorted(p.name for p in out.iterdir()) == ["run.f16.Modelfile", "run.f16.gguf"]


def test_gguf_lora_given_as_a_model_says_what_it_is(lora_run, tmp_path, capsys):
    """`generate RUN/adapter.gguf` was a TypeError in gguf_config.py; as model.path it said
    'needs a chat template'."""
    from slipstream.checkpoint.gguf_lora import export_adapter_gguf
    from slipstream.cli import main
    from slipstream.sources import check_model_path

    _, run = lora_run
    lora = export_adapter_gguf(run, tmp_path / "adapter.gguf")
    assert main(["generate", str(lora), "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert "is a GGUF LoRA adapter" in err and "--lora" in err and len(err.splitlines()) == 1
    with pytest.raises(ValueError, match="model.path: .* GGUF LoRA adapter .* run folder"):
        check_model_path(str(lora))  # what `slipstream train` checks first
    with pytest.raises(ValueError, match="GGUF LoRA adapter"):
        load_model(lora)
