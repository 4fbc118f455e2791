"""The trainer on CUDA: bf16 weights, fused AdamW, offloaded checkpoints, MFU in the metrics.

Skipped without a GPU (CPU twins: tests/test_train.py). Run with `pytest -m gpu`.
"""

import json

import pytest
import torch
from helpers.runs import lora_with_dropout, losses, run_config

from slipstream.config import config_from_dict
from slipstream.train import train

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_lora_on_cuda_bf16(tiny_run, tmp_path):  # noqa: F811
    raw = lora_with_dropout(run_config(tiny_run, tmp_path, steps=12, lr=2e-2, grad_accum=2))
    raw["train"].update(device="cuda", activation_checkpointing="auto")  # auto: offload
    summary = train(config_from_dict(raw))
    assert summary["device"].startswith("cuda")
    assert summary["eval_loss_after"] < summary["eval_loss_before"] - 0.5
    assert summary["peak_mem_gb"] is not None and summary["peak_mem_gb"] > 0
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 12 and all(r["peak_mem_gb"] > 0 for r in steps)
    if "H100" in torch.cuda.get_device_name() or "H200" in torch.cuda.get_device_name():
        assert all(0 < r["mfu"] < 1 for r in steps)
    curve = losses(tmp_path)
    assert curve[12] < curve[1]
