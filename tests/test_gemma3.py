"""Gemma 3 text (gemma3_text) against transformers through load_model: logits, loss and grads,
LoRA adapters in peft, merged export, config.json variants, and the training step's syncs.

The tiny config makes each Gemma detail matter: a sliding window (4) shorter than the
sequences, local and global RoPE bases far apart (with linear scaling on the global one),
query_pre_attn_scalar != head_dim, head_dim * heads != hidden, and the norms' zero offsets
randomised.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from helpers.models import (
    assert_loss_and_grads_match,
    compiled_graphs,
    make_hf_model,
    per_sequence_logits,
    randomise_lora_b,
    shifted_labels,
)
from peft import PeftModel
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

import slipstream
from slipstream import compile as regional
from slipstream.debug import count_syncs
from slipstream.memory.offload import apply_checkpointing
from slipstream.models import gemma3
from slipstream.models.rope import rope_inv_freq
from slipstream.ops.packing import SeqInfo

VOCAB = 97
LENGTHS = [7, 3, 12, 1]
TINY = dict(
    num_hidden_layers=3,
    head_dim=16,
    tie_word_embeddings=True,
    query_pre_attn_scalar=24,
    sliding_window=4,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
    },
)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    hf = make_hf_model("gemma3_text", **TINY)
    path = tmp_path_factory.mktemp("gemma3")
    hf.save_pretrained(path)
    return hf, path


def _hf_logits(hf, ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return per_sequence_logits(hf, ids, lengths)


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def test_packed_logits_match_transformers_per_sequence(hf_dir):
    hf, path = hf_dir
    ours = slipstream.load_model(path)
    assert [layer.self_attn.window for layer in ours.model.layers] == [4, None, 4]
    ids = _ids(sum(LENGTHS), seed=1)
    with torch.no_grad():
        packed = ours(ids, SeqInfo.from_lengths(LENGTHS))
    torch.testing.assert_close(packed, _hf_logits(hf, ids, LENGTHS), atol=1e-4, rtol=1e-4)


def test_loss_and_grads_match_transformers(hf_dir):
    hf, path = hf_dir
    assert_loss_and_grads_match(hf, slipstream.load_model(path), _ids(19, seed=2))


def test_embedding_scale_rounded_to_bf16_as_transformers(hf_dir):
    """sqrt(48) = 6.928 is 6.9375 in bf16; transformers multiplies by the rounded value."""
    hf, path = hf_dir
    ours = slipstream.load_model(path, dtype=torch.bfloat16)
    hf16 = copy.deepcopy(hf).to(torch.bfloat16)
    seen = {}
    ours.model.layers[0].register_forward_pre_hook(lambda m, a: seen.update(ours=a[0]))
    hf16.model.layers[0].register_forward_pre_hook(lambda m, a: seen.update(hf=a[0]))
    ids = _ids(23, seed=3)
    with torch.no_grad():
        ours(ids, SeqInfo.from_lengths([23]))
        hf16(input_ids=ids[None])
    assert seen["ours"].dtype == torch.bfloat16
    assert torch.equal(seen["ours"], seen["hf"][0])


def test_lora_adapter_loads_in_peft_with_same_logits(hf_dir, tmp_path):
    hf, path = hf_dir
    ours = slipstream.load_model(path)
    slipstream.apply_lora(ours, rank=4, alpha=8, targets="all-linear")
    randomise_lora_b(ours)
    slipstream.save_adapter(ours, tmp_path)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert len(cfg["target_modules"]) == 7
    peft_model = PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path).eval()
    ids = _ids(sum(LENGTHS), seed=4)
    with torch.no_grad():
        got = ours(ids, SeqInfo.from_lengths(LENGTHS))
    expected = _hf_logits(peft_model, ids, LENGTHS)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    # The adapter changed the output, so the comparison above could fail.
    assert (_hf_logits(hf, ids, LENGTHS) - expected).abs().max() > 1e-3


def test_export_merged_loads_in_transformers(hf_dir, tmp_path):
    import transformers

    hf, path = hf_dir
    ours = slipstream.load_model(path)
    slipstream.apply_lora(ours, rank=4, alpha=8, targets="all-linear")
    randomise_lora_b(ours)
    ids = _ids(11, seed=5)
    with torch.no_grad():
        expected = ours(ids, SeqInfo.from_lengths([11]))
    slipstream.export_merged(ours, tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(back).__name__ == "Gemma3ForCausalLM"
    got = _hf_logits(back, ids, [11])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert (_hf_logits(hf, ids, [11]) - expected).abs().max() > 1e-3


def _lora_grads(model, ids, labels, seq):
    params = [p for p in model.parameters() if p.requires_grad]
    loss = model.loss(ids, labels, seq)
    return loss, torch.autograd.grad(loss, params)


def test_lora_step_with_offload_is_sync_free_and_exact(hf_dir):
    """Checkpointing with offload (forced on CPU): the same loss and LoRA grads as the plain
    model, and 0 host syncs in the step (count_syncs judges ops as on CUDA)."""
    _, path = hf_dir
    plain = slipstream.load_model(path)
    slipstream.apply_lora(plain, rank=4, alpha=8, targets="all-linear")
    randomise_lora_b(plain)
    offloaded = copy.deepcopy(plain)
    apply_checkpointing(offloaded, "offload", force=True, min_offload_bytes=0)
    ids = _ids(sum(LENGTHS), seed=6)
    labels, seq = shifted_labels(ids, LENGTHS), SeqInfo.from_lengths(LENGTHS)
    ref_loss, ref_grads = _lora_grads(plain, ids, labels, seq)
    _lora_grads(offloaded, ids, labels, seq)  # the first step allocates the pool
    with count_syncs() as syncs:
        loss, grads = _lora_grads(offloaded, ids, labels, seq)
    assert syncs.total == 0, str(syncs)
    torch.testing.assert_close(loss, ref_loss, atol=0, rtol=0)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=0, rtol=0)
    assert all(g.abs().max() > 0 for g in grads)


@pytest.mark.slow  # ~20 s of compiling; tests/test_compile.py covers compile by default
def test_regional_compile_matches_eager_and_shares_graphs(hf_dir, monkeypatch):
    """self_attn and mlp of every layer compile (aot_eager on CPU) under offload and give
    eager's grads; sliding and full layers share graphs and a new batch length reuses them
    (the window read in forward made 2x the variants and hit dynamo's recompile limit)."""
    _, path = hf_dir
    torch._dynamo.reset()
    monkeypatch.setattr(regional, "BACKEND", "aot_eager")
    eager = slipstream.load_model(path)
    slipstream.apply_lora(eager, rank=4, alpha=8, targets="all-linear")
    compiled = copy.deepcopy(eager)
    apply_checkpointing(compiled, "offload", force=True, min_offload_bytes=0)
    assert regional.apply_compile(compiled) == 2 * 3
    graphs = []
    try:
        # Totals 17 and 19: a packed length equal to a weight dim (16, 32, 48) would be
        # specialised by duck sizing and recompile.
        for lengths in ([5, 9, 3], [13, 4, 2]):
            ids = _ids(sum(lengths), seed=len(lengths))
            labels, seq = shifted_labels(ids, lengths), SeqInfo.from_lengths(lengths)
            loss, grads = _lora_grads(compiled, ids, labels, seq)
            ref_loss, ref_grads = _lora_grads(eager, ids, labels, seq)
            torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
            for g, r in zip(grads, ref_grads, strict=True):
                torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
            graphs.append(compiled_graphs())
        # Offload's forward runs without grad, its recompute with grad, where layer 0's input
        # (the frozen embedding's output) needs none: 3 variants shared by all layers. With
        # the window read in forward, sliding and full layers each had their own (5 here),
        # and a new batch length then ran into dynamo's recompile limit (8).
        entries = _debug_get_cache_entry_list(gemma3.Attention.forward.__code__)
        assert len(entries) == 3
    finally:
        torch._dynamo.reset()
    assert 0 < graphs[0] == graphs[1]


# ------------------------------------------------------------------- config.json variants

# The published Gemma-3-1B config.json as written by transformers 4.50: no layer_types, no
# tie_word_embeddings, RoPE as rope_theta / rope_local_base_freq; 4B+ text configs add
# rope_scaling linear 8.
GEMMA3_1B_V4 = dict(
    model_type="gemma3_text", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
    num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
    query_pre_attn_scalar=256, rms_norm_eps=1e-6, max_position_embeddings=32768,
    rope_theta=1000000, rope_local_base_freq=10000, rope_scaling=None, sliding_window=512,
    sliding_window_pattern=6, hidden_activation="gelu_pytorch_tanh",
    attn_logit_softcapping=None, final_logit_softcapping=None,
)  # fmt: skip


@pytest.mark.parametrize("rope_scaling", [None, {"rope_type": "linear", "factor": 8.0}])
def test_config_matches_transformers_reading(rope_scaling):
    """Layer types, tying and both RoPEs' frequencies as transformers reads the same dict."""
    import transformers
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    raw = {**GEMMA3_1B_V4, "rope_scaling": rope_scaling}
    kwargs = {k: v for k, v in raw.items() if k != "model_type"}
    hf_cfg = transformers.Gemma3TextConfig(**kwargs)
    for source in (raw, {**hf_cfg.to_dict(), "model_type": "gemma3_text"}):  # 4.x and 5.x
        cfg = gemma3.config_from_hf(source)
        assert list(cfg.layer_types) == hf_cfg.layer_types
        assert cfg.layer_types.count("full_attention") == 4  # layers 6, 12, 18, 24
        assert cfg.tie_word_embeddings and cfg.sliding_window == 512
        rotary = Gemma3RotaryEmbedding(hf_cfg)
        for rope, kind in ((cfg.rope, "full"), (cfg.local_rope, "sliding")):
            inv_freq, scale = rope_inv_freq(rope, cfg.head_dim)
            expected = getattr(rotary, f"{kind}_attention_inv_freq")
            torch.testing.assert_close(inv_freq, expected, atol=0, rtol=1e-6)
            assert scale == getattr(rotary, f"{kind}_attention_attention_scaling")
    assert (cfg.rope.rope_type == "linear") == (rope_scaling is not None)


@pytest.mark.parametrize(
    "key,value",
    [
        ("attn_logit_softcapping", 50.0),
        ("final_logit_softcapping", 30.0),
        ("use_bidirectional_attention", True),
        ("hidden_activation", "silu"),
    ],
)
def test_unsupported_config_keys_are_one_line_errors(key, value):
    with pytest.raises(ValueError, match=key) as e:
        gemma3.config_from_hf({**GEMMA3_1B_V4, key: value})
    assert "\n" not in str(e.value)


def test_published_1b_shapes_build_as_transformers():
    """Gemma-3-1B's config.json (4.x form) builds, on the meta device, the parameters
    transformers builds from it: same names, same shapes, no lm_head (tied)."""
    import transformers

    kwargs = {k: v for k, v in GEMMA3_1B_V4.items() if k != "model_type"}
    with torch.device("meta"):
        ref = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**kwargs))
        ours = gemma3.build(gemma3.config_from_hf(GEMMA3_1B_V4))
    expected = {n: p.shape for n, p in ref.named_parameters() if n != "lm_head.weight"}
    assert {n: p.shape for n, p in ours.named_parameters()} == expected
    windows = [layer.self_attn.window for layer in ours.model.layers]
    assert windows == [None if (i + 1) % 6 == 0 else 512 for i in range(26)]
