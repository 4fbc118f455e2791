"""Merged export: our LoRA model -> export_merged -> transformers gives the same logits."""

from __future__ import annotations

import json

import torch
from helpers.models import make_hf_model

import slipstream
from slipstream.ops.packing import SeqInfo


def test_export_merged_loads_in_transformers(tmp_path):
    import transformers

    make_hf_model("qwen3", tie_word_embeddings=True).save_pretrained(tmp_path / "base")
    model = slipstream.load_model(tmp_path / "base")
    slipstream.apply_lora(model, rank=4, alpha=8, targets="all-linear")
    with torch.no_grad():  # a trained adapter: B != 0
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    ids = torch.randint(0, 97, (11,))
    with torch.no_grad():
        expected = model(ids, SeqInfo.from_lengths([11]))
    slipstream.export_merged(model, tmp_path / "merged")
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "merged", dtype=torch.float32
    )
    with torch.no_grad():
        got = back(ids[None]).logits[0]
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    with torch.no_grad():
        assert (base(ids[None]).logits[0] - expected).abs().max() > 1e-3  # the adapter mattered
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    summary = json.loads((tmp_path / "merged" / "export_summary.json").read_text())
    assert summary["lora_modules_merged"] == 7 * 2  # all-linear on 2 layers
    assert summary["base_dequantized_from_nf4"] is False
