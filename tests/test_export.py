"""Merged export: our LoRA model -> export_merged -> transformers gives the same logits."""

from __future__ import annotations

import json

import pytest
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


def _adapter(tiny_run, folder):
    model = slipstream.load_model(tiny_run[0])
    slipstream.apply_lora(model, rank=2, alpha=4)
    return slipstream.save_adapter(model, folder)


def test_export_refuses_a_non_empty_out_and_force_replaces_it_whole(
    tiny_run, tmp_path, capsys, monkeypatch
):
    """`export --out DIR` overwrote a merged model in place, and into a folder holding other
    files it overwrote some and left the rest mixed in."""
    from slipstream import cli

    adapter = _adapter(tiny_run, tmp_path / "run")
    out = tmp_path / "merged"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "config.json").write_text("{}")
    assert cli.main(["export", str(adapter), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        "is not empty (2 entries: config.json, notes.txt); give a new folder, or pass --force"
        in err
    )
    assert len(err.splitlines()) == 1
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "notes.txt"]
    assert (out / "config.json").read_text() == "{}"

    # --force, but the write fails: the old folder is untouched, nothing is left beside it.
    from slipstream.checkpoint import export

    def boom(*a, **k):
        raise OSError("injected failure")

    monkeypatch.setattr(export, "save_model", boom)
    with pytest.raises(OSError, match="injected"):
        cli.main(["export", str(adapter), "--out", str(out), "--force"])
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "notes.txt"]
    monkeypatch.undo()

    assert cli.main(["export", str(adapter), "--out", str(out), "--force"]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert "notes.txt" not in names and "export_summary.json" in names
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged", "run"]  # no .old/.partial

    # Never --force over what the export reads: the adapter's own folder (or one above it).
    assert cli.main(["export", str(adapter), "--out", str(tmp_path), "--force"]) == 2
    assert "which this export reads" in capsys.readouterr().err
    assert (adapter / "adapter_config.json").is_file()
    with pytest.raises(ValueError, match="is not empty"):  # the Python API says it too
        slipstream.export_merged(slipstream.load_model(tiny_run[0]), out)
