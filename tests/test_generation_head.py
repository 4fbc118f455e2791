"""The decode-speed paths of generation give the same numbers as the plain ones: the LM head
in vocabulary slices equals F.linear bitwise, and greedy generation through it still equals
transformers' `generate` token for token."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.models import make_hf_model

import slipstream
from slipstream.generation import engine


@pytest.mark.parametrize("rows", [1, 2, 3, 16])
@pytest.mark.parametrize("vocab", [129, 257, 385, 1000, 1536])
def test_lm_head_slices_equal_linear_bitwise(rows, vocab, monkeypatch):
    monkeypatch.setattr(engine, "HEAD_SLICE", 128)  # several slices and a ragged last one
    g = torch.Generator().manual_seed(vocab + rows)
    W_VD = torch.randn(vocab, 72, generator=g)
    h_BD = torch.randn(rows, 72, generator=g)
    got = engine.lm_head(h_BD, W_VD)
    assert got.shape == (rows, vocab) and got.is_contiguous()
    assert torch.equal(got, F.linear(h_BD, W_VD))


def test_lm_head_real_shape_bitwise():
    """SmolLM2's head shape (vocab 49152, hidden 576), where the slices are used."""
    g = torch.Generator().manual_seed(0)
    W_VD = torch.randn(49152, 576, generator=g) * 0.02
    h_BD = torch.randn(16, 576, generator=g)
    assert torch.equal(engine.lm_head(h_BD, W_VD), F.linear(h_BD, W_VD))


def test_greedy_through_sliced_head_equals_transformers(tmp_path, monkeypatch):
    monkeypatch.setattr(engine, "HEAD_SLICE", 48)  # the tiny vocab (256) in 6 slices
    hf = make_hf_model("llama")
    hf.save_pretrained(tmp_path)
    ours = slipstream.load_model(tmp_path)
    prompts = [[5, 17, 3], [44, 9, 21, 60, 3, 8, 13, 71, 30, 12, 6], [88, 4, 50, 7, 19]]
    got = slipstream.generate(ours, prompts, max_new_tokens=10)
    for p, c in zip(prompts, got, strict=True):
        out = hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, pad_token_id=0)
        assert c.token_ids == out[0, len(p) :].tolist()
