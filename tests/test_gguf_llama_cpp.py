"""Our GGUF files in llama.cpp itself (llama-cpp-python, the `slipstream[gguf]` extra): logits
and greedy tokens match ours, the GGUF LoRA moves the logits as merging does, K-quants load.
Skipped where llama-cpp-python is not installed (it builds llama.cpp from source)."""

import pytest
import torch

from slipstream.checkpoint.gguf_export import export_gguf
from slipstream.ops.packing import SeqInfo
from tests.helpers import gguf_tokenizer
from tests.helpers.gguf_tokenizer import VOCAB
from tests.helpers.models import make_hf_model, ours_from_hf
from tests.helpers.moe_models import make_hf_moe_model

llama_cpp = pytest.importorskip("llama_cpp")
transformers = pytest.importorskip("transformers")
tokenizer = gguf_tokenizer.tokenizer  # the module-scoped fixture

DENSE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2)  # fmt: skip
OVERRIDES = {
    "gemma3_text": dict(head_dim=16, query_pre_attn_scalar=16),  # llama.cpp: 1/sqrt(head_dim)
    "qwen3": dict(head_dim=16),
    "mistral": dict(sliding_window=None),
}
# Llama 3.1-style RoPE scaling (the rope_freqs tensor): with head_dim 16 and theta 1e4, of the
# 8 frequencies 1 is in the high band, 2 between the bands and 5 in the low band.
LLAMA3_ROPE = dict(max_position_embeddings=512, rope_scaling=dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
    original_max_position_embeddings=64))  # fmt: skip
FAMILIES = ["llama", "llama3_rope", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text",
            "qwen3_moe", "gpt_oss", "gemma4_text", "gemma4_text_moe"]  # fmt: skip
# Gemma 4 (tests/helpers/tiny_hf.py): 4 layers sliding (window 4, shorter than the prompt) /
# full alternating, full layers with their own head dim (16 vs 8), one KV head and k = v,
# proportional RoPE on a quarter of the full head, per-layer inputs, layers 2-3 reusing layers
# 0-1's K/V with double-wide MLPs, softcapped logits; the MoE variant adds the routed experts
# beside the dense MLP (and ties the embeddings). Norms, layer scalars and router scales are
# randomised (ones by default: a dropped one would not show).
GEMMA4 = {"gemma4_text": {}, "gemma4_text_moe": dict(
    hidden_size_per_layer_input=8, num_kv_shared_layers=2, use_double_wide_mlp=True,
    tie_word_embeddings=True)}  # fmt: skip
PROMPT = "Hello, how are you doing today? I went hiking in the mountains."


def tiny(kind: str):
    if kind in GEMMA4:
        return tiny_gemma4(kind)
    if kind == "qwen3_moe":
        return make_hf_moe_model(kind, vocab_size=VOCAB, hidden_size=64, head_dim=16)
    if kind == "gpt_oss":  # llama.cpp fixes the clamp at 7.0
        return make_hf_moe_model(kind, vocab_size=VOCAB, hidden_size=64, swiglu_limit=7.0)
    if kind == "llama3_rope":
        return make_hf_model("llama", **DENSE, **LLAMA3_ROPE)
    return make_hf_model(kind, **{**DENSE, **OVERRIDES.get(kind, {})})


def tiny_gemma4(kind: str):
    from tests.helpers.tiny_hf import tiny_config

    torch.manual_seed(0)
    sizes = dict(vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=2)
    cfg = tiny_config(kind, 4, **{**sizes, **GEMMA4[kind]})
    hf = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, t in [*hf.named_parameters(), *hf.named_buffers()]:
            if name.endswith(("norm.weight", "layer_scalar", "router.scale", "per_expert_scale")):
                t.copy_(1 + 0.2 * torch.randn_like(t))
    return hf


def ours_of(hf, tmp_path):
    """Ours through the production loader (Gemma 4: layer scalars, shared layers' unused
    K/V); the other families by state dict."""
    if hf.config.model_type != "gemma4_text":
        return ours_from_hf(hf)
    from slipstream.checkpoint.hf import load_model

    hf.save_pretrained(tmp_path / "hf")
    return load_model(tmp_path / "hf")


def _no_repack_params():
    """llama.cpp's model defaults with weight repacking off (llama-cli's --no-repack): on a
    CPU with AMX, llama-cpp-python 0.3.36 repacks Q8_0/K-quant weights for its AMX kernels
    and segfaults in decode, on llama.cpp's own quantization of our f32 file as on ours."""
    params = _default_model_params()
    params.use_extra_bufts = False
    return params


_default_model_params = llama_cpp.llama_model_default_params


def llama_cpp_logits(path, ids: list[int], lora=None):
    from unittest import mock

    with mock.patch("llama_cpp.llama.llama_cpp.llama_model_default_params", _no_repack_params):
        llm = llama_cpp.Llama(
            model_path=str(path), n_ctx=128, logits_all=True, verbose=False, n_threads=2,
            lora_path=str(lora) if lora else None,
        )  # fmt: skip
    llm.eval(ids)
    return llm, torch.tensor(llm.scores[: len(ids)], dtype=torch.float32)


def greedy_llama_cpp(llm, ids: list[int], n: int) -> list[int]:
    llm.reset()
    llm.eval(ids)
    out = []
    for _ in range(n):
        nxt = int(llm.scores[llm.n_tokens - 1].argmax())
        out.append(nxt)
        llm.eval([nxt])
    return out


def greedy_ours(model, ids: list[int], n: int) -> list[int]:
    seq_ids = list(ids)
    with torch.no_grad():
        for _ in range(n):
            t = torch.tensor(seq_ids)
            seq_ids.append(int(model(t, SeqInfo.from_lengths([len(t)]))[-1].argmax()))
    return seq_ids[len(ids) :]


@pytest.mark.parametrize("kind", FAMILIES)
def test_llama_cpp_logits_and_greedy_match(tmp_path, tokenizer, kind):
    ours = ours_of(tiny(kind), tmp_path)
    ids = tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        ref = ours(torch.tensor(ids), SeqInfo.from_lengths([len(ids)]))
    path = export_gguf(ours, tmp_path / "m.gguf", "f32", tokenizer=tokenizer)
    llm, got = llama_cpp_logits(path, ids)
    # llama.cpp keeps K/V in f16 and sums in its own order: ~1e-3 of the logit scale.
    err = (got - ref).abs().max() / ref.abs().max()
    print(f"{kind}: llama.cpp logits rel {err:.2e}")
    assert err < 5e-3, f"{kind}: llama.cpp logits differ by {err:.2e} (relative)"
    assert greedy_llama_cpp(llm, ids, 8) == greedy_ours(ours, ids, 8)


def test_llama_cpp_q8_0_and_k_quants_load(tmp_path, tokenizer):
    ours = ours_from_hf(make_hf_model("llama", **{**DENSE, "hidden_size": 256,
                                                   "intermediate_size": 512}))  # fmt: skip
    ids = tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        ref = ours(torch.tensor(ids), SeqInfo.from_lengths([len(ids)]))
    for type, tol in (("q8_0", 3e-2), ("q6_k", 6e-2), ("q4_k_m", 2e-1)):
        path = export_gguf(ours, tmp_path / f"{type}.gguf", type, tokenizer=tokenizer)
        _, got = llama_cpp_logits(path, ids)
        err = (got - ref).abs().max() / ref.abs().max()
        assert 0 < err < tol, f"{type}: {err:.2e}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q4_k_m.gguf", "q6_k.gguf", "q8_0.gguf"]


# Gemma 4: every linear llama.cpp puts its LoRA hook on (per_layer_model_projection: refused)
LORA_TARGETS = {"llama": "all-linear", "gemma4_text": [
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    "per_layer_input_gate", "per_layer_projection"]}  # fmt: skip


@pytest.mark.parametrize("kind", list(LORA_TARGETS))
def test_gguf_lora_in_llama_cpp_moves_logits_as_merging(tmp_path, tokenizer, kind):
    from slipstream.checkpoint.hf import load_model

    hf = tiny(kind)
    hf.save_pretrained(tmp_path / "base")
    assert_gguf_lora_moves_as_merging(
        load_model(tmp_path / "base"), tmp_path / "base", tmp_path, tokenizer, LORA_TARGETS[kind]
    )


def assert_gguf_lora_moves_as_merging(model, base, tmp_path, tokenizer, targets):
    """A random LoRA (rank 8 on `targets`) of our `model` of the checkpoint `base`, as a GGUF
    LoRA on its f32 GGUF: llama.cpp's logits move as merging moves ours (within 5% of the
    move). Returns the saved adapter's folder."""
    from slipstream.checkpoint.adapter import save_adapter
    from slipstream.checkpoint.gguf_lora import export_adapter_gguf
    from slipstream.peft.lora import apply_lora, merge_lora
    from tests.helpers.models import randomise_lora_b

    export_gguf(model, tmp_path / "base.gguf", "f32", tokenizer=tokenizer)
    apply_lora(model, rank=8, alpha=16, targets=targets)
    randomise_lora_b(model)
    save_adapter(model, tmp_path / "run", base_model_name_or_path=str(base))
    lora = export_adapter_gguf(tmp_path / "run", tmp_path / "lora.gguf")
    merge_lora(model)
    ids = tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        merged = model(torch.tensor(ids), SeqInfo.from_lengths([len(ids)]))
    _, plain = llama_cpp_logits(tmp_path / "base.gguf", ids)
    _, adapted = llama_cpp_logits(tmp_path / "base.gguf", ids, lora=lora)
    moved = (merged - plain).abs().max()
    assert moved > 0.05  # the adapter does change the logits
    assert (adapted - merged).abs().max() < 0.05 * moved
    return tmp_path / "run"
