"""The FLOP formula behind MFU (slipstream/train/flops.py) against independent counts."""

from __future__ import annotations

import pytest
import torch
from helpers.models import make_hf_model, ours_from_hf
from helpers.moe_models import make_hf_moe_model

import slipstream
from slipstream.ops.attention import dense_causal_mask
from slipstream.ops.packing import SeqInfo
from slipstream.train.flops import StepFlops, active_params, causal_pairs


def _reference_active(hf_model) -> float:
    """From transformers' own parameters: embedding left out unless tied, experts at k/E."""
    c = hf_model.config
    share = c.num_experts_per_tok / (getattr(c, "num_local_experts", None) or c.num_experts)
    total = 0.0
    for name, p in hf_model.named_parameters():
        if name.endswith("embed_tokens.weight") and not c.tie_word_embeddings:
            continue
        total += p.numel() * (share if ".experts." in name else 1.0)
    return total


def test_active_params_dense_by_hand():
    D, F, H, G, Dh, L, V = 48, 80, 6, 2, 8, 2, 97
    per_layer = D * Dh * (2 * H + 2 * G) + 3 * D * F + 2 * D  # q k v o, gate up down, 2 norms
    assert active_params(ours_from_hf(make_hf_model())) == L * per_layer + D + V * D
    tied = ours_from_hf(make_hf_model(tie_word_embeddings=True))
    assert active_params(tied) == L * per_layer + D + V * D  # the shared matrix, once


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_active_params_moe_counts_top_k_experts(model_type):
    hf_model = make_hf_moe_model(model_type)
    assert active_params(ours_from_hf(hf_model, weights=False)) == pytest.approx(
        _reference_active(hf_model), abs=1
    )


def test_lora_adapters_are_not_counted():
    model = ours_from_hf(make_hf_model())
    before = active_params(model)
    slipstream.apply_lora(model, rank=4, alpha=8, targets="all-linear")
    assert active_params(model) == before


@pytest.mark.parametrize("n", [1, 2, 5, 17])
@pytest.mark.parametrize("window", [None, 1, 4, 16])
def test_causal_pairs_count_the_mask(n, window):
    mask = dense_causal_mask(SeqInfo.from_lengths([n]), window)
    assert causal_pairs(n, window) == int(mask.sum())


def test_step_flops_gpt_oss_alternating_windows():
    """GPT-OSS: sliding layers (window 4) and full layers; 4NT with LoRA, 6NT full."""
    hf_model = make_hf_moe_model("gpt_oss")
    model = ours_from_hf(hf_model, weights=False)
    c, lengths = hf_model.config, [3, 9, 6]
    per_pair = 3 * 2 * 2 * c.num_attention_heads * c.head_dim
    attention = 0
    for kind in c.layer_types:
        window = c.sliding_window if kind == "sliding_attention" else None
        attention += per_pair * sum(int(dense_causal_mask(SeqInfo.from_lengths([n]), window).sum())
                                    for n in lengths)  # fmt: skip
    n_active = active_params(model)
    assert StepFlops(model, lora=True)(lengths) == 4 * n_active * 18 + attention
    assert StepFlops(model, lora=False)(lengths) == 6 * n_active * 18 + attention


def test_step_flops_on_a_meta_model_matches_a_real_one():
    """The GPU suite counts FLOPs on a meta-device build (no memory): the same numbers."""
    hf_model = make_hf_model("qwen3")
    with torch.device("meta"):
        meta = ours_from_hf(hf_model, weights=False)
    assert StepFlops(meta, lora=True)([5, 7]) == StepFlops(
        ours_from_hf(hf_model, weights=False), lora=True
    )([5, 7])
