"""Generation from native Qwen3.5 (dense and MoE): the cache holds conv + recurrent state for
the Gated DeltaNet layers and keys/values for the attention layers (generation/recurrent.py,
cache.py). Greedy tokens equal transformers' `generate` on each prompt alone, for prompts of
mixed lengths (one longer than a 64-token DeltaNet chunk), with several samples a prompt
(rows repeated) and with rows finishing early and dropped from the cache mid-run."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_hf import tiny_config

import slipstream
from slipstream.generation.engine import run
from slipstream.generation.sampling import Sampling

NEW = 10


def _prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 96, (n,), generator=g).tolist() for n in (3, 70, 11, 7)]


@pytest.fixture(scope="module", params=["qwen3_5_text", "qwen3_5_moe_text"])
def pair(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = tiny_config(request.param, layers=4)
    ref = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    path = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(path)
    return ref, slipstream.load_model(path)


def _greedy(ref, prompt, new=NEW) -> list[int]:
    out = ref.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def test_greedy_equals_transformers_generate(pair):
    ref, ours = pair
    prompts = _prompts()
    got = slipstream.generate(ours, prompts, max_new_tokens=NEW, num_return_sequences=2)
    for i, c in enumerate(got):
        assert c.token_ids == _greedy(ref, prompts[i // 2])[: len(c.token_ids)], i
        assert len(c.token_ids) == NEW or c.finish_reason == "stop"


def test_state_survives_dropped_rows(pair):
    """A stop token ends the first row after 3 tokens; at the next check (every 2 tokens) it
    leaves the cache, and the other rows' states are compacted with their keys."""
    ref, ours = pair
    prompts = _prompts()
    refs = [_greedy(ref, p) for p in prompts]
    stop = refs[0][2]
    rows = run(ours, prompts, max_new_tokens=NEW, sampling=Sampling(), stop_ids=[stop],
               check_every=2)  # fmt: skip
    assert rows[0].finish_reason == "stop" and len(rows[0].token_ids) <= 3
    later = [r for r, want in zip(rows, refs, strict=True) if stop not in want[:4]]
    assert later, "no row outlives the first: the compaction would go untested"
    for r, want in zip(rows, refs, strict=True):
        cut = want.index(stop) + 1 if stop in want else NEW
        assert r.token_ids == want[:cut]
