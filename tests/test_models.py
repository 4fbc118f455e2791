"""Dense families against transformers: logits, loss and gradients through load_model."""

from __future__ import annotations

import pytest
import torch
from helpers.models import assert_loss_and_grads_match, make_hf_model

import slipstream
from slipstream.ops.packing import SeqInfo

ROPE_LLAMA3 = dict(rope_type="llama3", rope_theta=50000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=16)  # fmt: skip
ROPE_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                 original_max_position_embeddings=16)  # fmt: skip
ROPE_LINEAR = dict(rope_type="linear", rope_theta=10000.0, factor=2.0)

CASES = {
    "llama-gqa-untied": ("llama", {}),
    "llama-mha-tied": ("llama", dict(num_key_value_heads=6, tie_word_embeddings=True)),
    "llama-llama3-rope": ("llama", dict(rope_parameters=ROPE_LLAMA3)),
    "llama-linear-rope-bias": ("llama", dict(rope_parameters=ROPE_LINEAR, attention_bias=True)),
    "llama-yarn-rope": ("llama", dict(rope_parameters=ROPE_YARN)),
    "mistral": ("mistral", dict(num_key_value_heads=3)),
    "qwen3-odd-heads": ("qwen3", dict(num_attention_heads=5, num_key_value_heads=1, head_dim=12)),
    "qwen3-tied": ("qwen3", dict(tie_word_embeddings=True, num_key_value_heads=3)),
    "qwen3-yarn": ("qwen3", dict(rope_parameters=ROPE_YARN, num_key_value_heads=2)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    model_type, overrides = CASES[request.param]
    hf = make_hf_model(model_type, **overrides)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, slipstream.load_model(path)


def test_logits_match_transformers_per_sequence(pair):
    hf, ours = pair
    lengths = [7, 3, 12, 1]
    ids = torch.randint(0, 97, (sum(lengths),), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        packed = ours(ids, SeqInfo.from_lengths(lengths))
        start = 0
        for n in lengths:
            ref = hf(ids[None, start : start + n]).logits[0]
            torch.testing.assert_close(packed[start : start + n], ref, atol=1e-4, rtol=1e-4)
            start += n


def test_loss_and_grads_match_transformers(pair):
    hf, ours = pair
    ids = torch.randint(0, 97, (19,), generator=torch.Generator().manual_seed(2))
    assert_loss_and_grads_match(hf, ours, ids)


def test_round_trip_save_model_loads_in_transformers(pair, tmp_path):
    import transformers

    _, ours = pair
    slipstream.save_model(ours, tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.randint(0, 97, (10,))
    with torch.no_grad():
        ref = back(ids[None]).logits[0]
        got = ours(ids, SeqInfo.from_lengths([10]))
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
