"""Native Qwen3.5, dense and MoE, through the trainer: 2 gloo ranks (DDP, FSDP2 per hybrid
decoder layer) equal one process (losses, adapter). Tiny configs of transformers' own classes
(a Gated DeltaNet layer, then a gated attention layer), a chat tokenizer, 48 rows (float32,
CPU)."""

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


@pytest.fixture(scope="module", params=["qwen3_5_text", "qwen3_5_moe_text"])
def qwen3_5_run(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp(request.param)
    model_dir = root / "model"
    save_test_tokenizer(model_dir, "chatml", vocab_size=300)
    torch.manual_seed(0)
    cfg = tiny_config(request.param, layers=2, vocab_size=300)
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
def test_two_ranks_match_one_process(qwen3_5_run, tmp_path):
    from safetensors.torch import load_file

    run = qwen3_5_run
    train(config_from_dict(_lora_run(run, tmp_path / "single", grad_accum=4)))
    for mode in ("ddp", "fsdp"):
        check(train_job(_lora_run(run, tmp_path / mode, grad_accum=2, parallel=mode), tmp_path))
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
