"""load_model / forward error paths, sharded checkpoints, and the zero-sync guarantee."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.models import make_hf_model
from safetensors.torch import load_file, save_file

import slipstream
from slipstream.checkpoint import hf as hf_io
from slipstream.debug import count_syncs
from slipstream.ops.packing import SeqInfo


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_hf_model("llama").save_pretrained(path)
    return path


def _copy(checkpoint, tmp_path, edit_config=None, edit_tensors=None):
    cfg = json.loads((checkpoint / "config.json").read_text())
    tensors = load_file(checkpoint / "model.safetensors")
    if edit_config:
        edit_config(cfg)
    if edit_tensors:
        edit_tensors(tensors)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, tmp_path / "model.safetensors")
    return tmp_path


def test_missing_config(tmp_path):
    with pytest.raises(ValueError, match=r"config.json not found"):
        slipstream.load_model(tmp_path)


def test_missing_path(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        slipstream.load_model(tmp_path / "nope")


def test_unsupported_model_type(checkpoint, tmp_path):
    # t5: no native family and no causal LM in transformers (bert would build: BertLMHead)
    path = _copy(checkpoint, tmp_path, edit_config=lambda c: c.update(model_type="t5"))
    with pytest.raises(
        ValueError, match=r"model_type 't5' is not supported: it has no native .*llama"
    ):
        slipstream.load_model(path)


def test_missing_tensor(checkpoint, tmp_path):
    drop = lambda t: t.pop("model.layers.1.mlp.up_proj.weight")  # noqa: E731
    path = _copy(checkpoint, tmp_path, edit_tensors=drop)
    with pytest.raises(ValueError, match=r"missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        slipstream.load_model(path)


def test_misshaped_tensor(checkpoint, tmp_path):
    def shrink(t):
        t["model.norm.weight"] = t["model.norm.weight"][:-1].clone()

    path = _copy(checkpoint, tmp_path, edit_tensors=shrink)
    with pytest.raises(
        ValueError, match=r"'model.norm.weight' has shape \(47,\), expected \(48,\)"
    ):
        slipstream.load_model(path)


def test_input_length_mismatch(checkpoint):
    model = slipstream.load_model(checkpoint)
    with pytest.raises(ValueError, match=r"input_ids has 5 tokens but sum\(seq.lengths\) = 6"):
        model(torch.zeros(5, dtype=torch.long), SeqInfo.from_lengths([4, 2]))
    with pytest.raises(ValueError, match="flat packed layout"):
        model(torch.zeros(1, 6, dtype=torch.long), SeqInfo.from_lengths([6]))


def test_sharded_save_and_load(checkpoint, tmp_path, monkeypatch):
    import transformers

    model = slipstream.load_model(checkpoint)
    monkeypatch.setattr(hf_io, "SHARD_BYTES", 20_000)  # force several shards on a tiny model
    slipstream.save_model(model, tmp_path)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    again = slipstream.load_model(tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.randint(0, 97, (9,))
    with torch.no_grad():
        ours = again(ids, SeqInfo.from_lengths([9]))
        torch.testing.assert_close(ours, model(ids, SeqInfo.from_lengths([9])))
        torch.testing.assert_close(ours, back(ids[None]).logits[0], atol=1e-4, rtol=1e-4)
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
@pytest.mark.parametrize("layers", [2, 8])
def test_forward_backward_has_no_host_syncs(model_type, layers, tmp_path):
    make_hf_model(model_type, num_hidden_layers=layers).save_pretrained(tmp_path)
    model = slipstream.load_model(tmp_path)
    lengths = [6, 3, 8]
    seq = SeqInfo.from_lengths(lengths)
    ids = torch.randint(0, 97, (sum(lengths),))
    labels = ids.roll(-1)
    with count_syncs() as syncs:
        loss = model.loss(ids, labels, seq)
        loss.backward()
    assert syncs.total == 0, str(syncs)
    # The audit is live: one stray .item() in the step would show.
    with count_syncs() as syncs:
        model.loss(ids, labels, seq).item()
    assert syncs.total == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_cuda_packed_forward_matches_cpu(model_type, tmp_path):
    """The CUDA path (varlen or flex attention, bf16) against the CPU path (SDPA, float32)."""
    make_hf_model(model_type, head_dim=64 if model_type == "qwen3" else None).save_pretrained(
        tmp_path
    )
    lengths = [37, 5, 90, 1]
    ids = torch.randint(0, 97, (sum(lengths),))
    cpu = slipstream.load_model(tmp_path)
    gpu = slipstream.load_model(tmp_path, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad(), count_syncs() as syncs:
        got = gpu(ids.cuda(), SeqInfo.from_lengths(lengths, "cuda"))
    with torch.no_grad():
        ref = cpu(ids, SeqInfo.from_lengths(lengths))
    torch.testing.assert_close(got.float().cpu(), ref, atol=5e-2, rtol=5e-2)
    assert syncs.total == 0, str(syncs)
