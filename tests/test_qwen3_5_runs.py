"""Native Qwen3.5, dense and MoE, through the trainer: 2 gloo ranks (DDP, FSDP2 per hybrid
decoder layer) equal one process (losses, adapter). Tiny configs of transformers' own classes
(a Gated DeltaNet layer, then a gated attention layer), a chat tokenizer, 48 rows (float32,
CPU)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.runs import losses, make_tiny_type_run, one_and_two_rank_runs


@pytest.fixture(scope="module", params=["qwen3_5_text", "qwen3_5_moe_text"])
def qwen3_5_run(request, tmp_path_factory):
    return make_tiny_type_run(tmp_path_factory.mktemp(request.param), request.param, layers=2)


@pytest.mark.slow
def test_two_ranks_match_one_process(qwen3_5_run, tmp_path):
    from safetensors.torch import load_file

    run = qwen3_5_run
    one_and_two_rank_runs(run, tmp_path)
    single = losses(tmp_path / "single")
    want = load_file(tmp_path / "single" / "adapter_model.safetensors")
    assert any(".linear_attn.in_proj_qkv." in k for k in want)
    assert any(".self_attn.q_proj." in k for k in want)
    moe = json.loads((run[0] / "config.json").read_text())["model_type"] == "qwen3_5_moe_text"
    assert any(".mlp.experts." in k for k in want) == moe
    for mode in ("ddp", "fsdp"):
        got = losses(tmp_path / mode)
        assert sorted(got) == sorted(single) == list(range(1, 5))
        assert [got[s] for s in sorted(got)] == pytest.approx(
            [single[s] for s in sorted(single)], abs=1e-5
        )
        adapter = load_file(tmp_path / mode / "adapter_model.safetensors")
        assert adapter.keys() == want.keys()
        for key in want:
            torch.testing.assert_close(adapter[key], want[key], atol=2e-5, rtol=1e-4)
