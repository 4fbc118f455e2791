"""Native Gemma 4, dense and MoE, through the trainer: 2 gloo ranks (DDP, FSDP2 per decoder
layer, the K/V of source layers handed to the layers that reuse them across shard
boundaries) equal one process (losses, adapter). Tiny configs of transformers' own class
(4 layers, per-layer inputs, K/V sharing; the MoE one with its routed block beside the dense
MLP, as tests/test_gemma4.py's), a chat tokenizer, 48 rows (float32, CPU)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.runs import losses, make_tiny_type_run, one_and_two_rank_runs

MOE = {"hidden_size_per_layer_input": 8, "num_kv_shared_layers": 2, "use_double_wide_mlp": True}


@pytest.fixture(scope="module", params=["gemma4_text", "gemma4_text_moe"])
def gemma4_run(request, tmp_path_factory):
    extra = MOE if request.param == "gemma4_text_moe" else {}
    return make_tiny_type_run(
        tmp_path_factory.mktemp(request.param), request.param, layers=4,
        vocab_size_per_layer_input=300, **extra,
    )  # fmt: skip


@pytest.mark.slow
def test_two_ranks_match_one_process(gemma4_run, tmp_path):
    from safetensors.torch import load_file

    one_and_two_rank_runs(gemma4_run, tmp_path)
    single = losses(tmp_path / "single")
    want = load_file(tmp_path / "single" / "adapter_model.safetensors")
    assert any(".layers.0.self_attn.k_proj." in k for k in want)  # reached through layer 2
    moe = json.loads((gemma4_run[0] / "config.json").read_text()).get("enable_moe_block")
    assert any(".experts." in k for k in want) == bool(moe)
    for mode in ("ddp", "fsdp"):
        got = losses(tmp_path / mode)
        assert sorted(got) == sorted(single) == list(range(1, 5))
        assert [got[s] for s in sorted(got)] == pytest.approx(
            [single[s] for s in sorted(single)], abs=1e-5
        )
        adapter = load_file(tmp_path / mode / "adapter_model.safetensors")
        assert adapter.keys() == want.keys()
        for key in want:  # 4 Adam steps at lr 2e-2 amplify reduction-order differences
            torch.testing.assert_close(adapter[key], want[key], atol=1e-4, rtol=1e-3)
