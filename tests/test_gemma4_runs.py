"""Native Gemma 4, dense and MoE, through the trainer: 2 gloo ranks (DDP, FSDP2 per decoder
layer, the K/V of source layers handed to the layers that reuse them across shard
boundaries) equal one process (losses, adapter). Tiny configs of transformers' own class
(4 layers, per-layer inputs, K/V sharing; the MoE one with its routed block beside the dense
MLP, as tests/test_gemma4.py's), a chat tokenizer, 48 rows (float32, CPU)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.runs import chat_rows, losses, run_config
from helpers.tiny_hf import tiny_config
from helpers.tokenizers import save_test_tokenizer
from helpers.torchrun import check, train_job

from slipstream.config import config_from_dict
from slipstream.train import train

MOE = {"hidden_size_per_layer_input": 8, "num_kv_shared_layers": 2, "use_double_wide_mlp": True}


@pytest.fixture(scope="module", params=["gemma4_text", "gemma4_text_moe"])
def gemma4_run(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp(request.param)
    model_dir = root / "model"
    save_test_tokenizer(model_dir, "chatml", vocab_size=300)
    torch.manual_seed(0)
    extra = MOE if request.param == "gemma4_text_moe" else {}
    cfg = tiny_config(request.param, 4, vocab_size=300, vocab_size_per_layer_input=300, **extra)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(model_dir)
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in chat_rows(48)))
    return model_dir, data


def _lora_run(run, out, **train):
    raw = run_config(run, out, steps=4, lr=2e-2, dist_timeout_s=60, **train)
    raw["train"]["finetune"] = "lora"
    raw["lora"] = {"rank": 4, "alpha": 8}
    return raw


@pytest.mark.slow
def test_two_ranks_match_one_process(gemma4_run, tmp_path):
    from safetensors.torch import load_file

    train(config_from_dict(_lora_run(gemma4_run, tmp_path / "single", grad_accum=4)))
    for mode in ("ddp", "fsdp"):
        job = _lora_run(gemma4_run, tmp_path / mode, grad_accum=2, parallel=mode)
        check(train_job(job, tmp_path))
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
