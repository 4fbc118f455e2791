from __future__ import annotations

import pytest
import torch
from helpers.models import make_hf_model

import slipstream
from slipstream.generation import greedy_generate


def test_greedy_matches_transformers_generate(tmp_path):
    hf = make_hf_model("qwen3")
    hf.save_pretrained(tmp_path)
    ours = slipstream.load_model(tmp_path)
    prompt = [5, 17, 3, 44, 9]
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)[
        0, len(prompt) :
    ].tolist()
    assert greedy_generate(ours, prompt, max_new_tokens=12) == ref
    stop = ref[3]
    assert (
        greedy_generate(ours, prompt, max_new_tokens=12, stop_ids=(stop,)) == ref[: ref.index(stop)]
    )
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        greedy_generate(ours, [])
