"""llama3 RoPE (Llama 3.1+) through GGUF: the `rope_freqs` divisors our exporter (and
llama.cpp's converter) write come back as transformers' rope_scaling, whose frequencies, in
our RoPE code and in transformers', are the source model's; a tiny random Llama 3.1-style model
round-trips with its logits; malformed divisors are a one-line error."""

import copy
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from slipstream.checkpoint.gguf_export import export_gguf
from slipstream.checkpoint.gguf_llama3 import llama3_rope_scaling
from slipstream.checkpoint.hf import load_model
from slipstream.models.rope import RopeConfig, rope_inv_freq
from slipstream.ops.packing import SeqInfo
from tests.helpers import gguf_tokenizer
from tests.helpers.gguf_tokenizer import VOCAB
from tests.helpers.models import make_hf_model, ours_from_hf

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
tokenizer = gguf_tokenizer.tokenizer  # the module-scoped fixture

# Llama 3.1's rope_scaling; head_dim 64 and theta 5e5 put 15 frequencies in the high band,
# 3 between (wavelengths 2048-8192) and 14 in the low band.
LLAMA31 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_position_embeddings=8192)  # fmt: skip
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=131072)  # fmt: skip
TOLERANCE = {"f32": 1e-5, "f16": 2e-3}  # max |logit error| / max |logit|
PROMPT = "Hello, how are you doing today? I am fine, thanks."


def hf_inv_freq(config: dict) -> torch.Tensor:
    """transformers' own llama inverse frequencies for a config dict (a copy: LlamaConfig
    adds rope_theta to the rope_scaling dict it is given)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaRotaryEmbedding(transformers.LlamaConfig(**copy.deepcopy(config))).inv_freq


def divisors(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """What our exporter writes (gguf_arch.extra_tensors): plain / scaled, float32."""
    plain, _ = rope_inv_freq(replace(rope, rope_type="default"), head_dim)
    return (plain / rope_inv_freq(rope, head_dim)[0]).numpy()


def llama_cpp_divisors(theta, dim, factor, low, high, old) -> np.ndarray:
    """llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel.generate_extra_tensors)."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


def back_inv_freq(scaling, theta, head_dim, context):
    """Our and transformers' frequencies for an imported rope_scaling (None: plain RoPE)."""
    hf = dict(rope_theta=theta, head_dim=head_dim, max_position_embeddings=context,
              hidden_size=64, num_attention_heads=4)  # fmt: skip
    if scaling is not None:
        hf["rope_scaling"] = scaling
    return rope_inv_freq(RopeConfig.from_hf(hf), head_dim)[0], hf_inv_freq(hf)


# (theta, head_dim, factor, low, high, original, context): Llama 3.1, 3.2, a config off the
# low=1 convention, and tiny ones with one or no mid-band frequency.
CASES = [
    (5e5, 128, 8.0, 1.0, 4.0, 8192, 131072),
    (5e5, 64, 32.0, 1.0, 4.0, 8192, 131072),
    (5e5, 128, 8.0, 2.0, 8.0, 8192, 131072),
    (1e4, 8, 3.7, 1.3, 4.9, 100, 512),
    (1e4, 16, 8.0, 1.0, 4.0, 8192, 131072),
    (1e4, 16, 8.0, 1.0, 4.0, 64, 512),
]


@pytest.mark.parametrize("writer", ["ours", "llama.cpp"])
@pytest.mark.parametrize("with_original", [True, False])
@pytest.mark.parametrize("case", CASES)
def test_divisors_give_the_same_frequencies(case, with_original, writer):
    theta, hd, factor, low, high, old, context = case
    scaling = dict(rope_type="llama3", factor=factor, low_freq_factor=low,
                   high_freq_factor=high, original_max_position_embeddings=old)  # fmt: skip
    source = dict(rope_theta=theta, head_dim=hd, max_position_embeddings=context,
                  hidden_size=64, num_attention_heads=4, rope_scaling=scaling)  # fmt: skip
    want = hf_inv_freq(source)
    if writer == "ours":
        r = divisors(RopeConfig.from_hf(source), hd)
    else:
        r = llama_cpp_divisors(theta, hd, factor, low, high, old)
    got = llama3_rope_scaling(r, theta, hd, context, old if with_original else None)
    ours, theirs = back_inv_freq(got, theta, hd, context)
    torch.testing.assert_close(ours, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(theirs, want, rtol=1e-6, atol=0)
    assert got["rope_type"] == "llama3" and got["factor"] == factor
    mid = ((r > 1) & (r < factor)).sum()
    if mid >= 2 and (with_original or low == 1.0):  # determined: the very config comes back
        assert got == scaling


def test_all_one_is_plain_rope_and_all_factor_is_linear():
    ones = np.ones(8, dtype=np.float32)
    assert llama3_rope_scaling(ones, 1e4, 16, 512) is None
    got = llama3_rope_scaling(np.full(8, 3.7, dtype=np.float32), 1e4, 16, 512)
    assert got == {"rope_type": "linear", "factor": 3.7}


@pytest.mark.parametrize(
    "r, match",
    [
        (np.ones(7), "has 7 values; head_dim 16 needs 8"),
        (
            np.array([1, 1, 3, 2, 8, 8, 8, 8.0]),
            r"\[3\] is 2, below \[2\] \(3\): llama3 divisors rise",
        ),
        (np.array([0.5, 1, 2, 3, 8, 8, 8, 8]), r"\[0\] is 0.5, below 1: llama3 divisors rise"),
        (np.array([1, 1, 2, 3, 8, 8, 8, np.nan]), r"\[7\] is nan, below 1"),
        (np.array([1, 1, 1.2, 5, 5.1, 8, 8, 8.0]), "no factor, low/high_freq_factor"),
        (np.array([1, 1.5, 1.6, 7, 7.5, 7.9, 8, 8.0]), "do not fall with the wavelength"),
    ],
)
def test_malformed_divisors_are_one_line(r, match):
    with pytest.raises(ValueError, match=match) as err:
        llama3_rope_scaling(r.astype(np.float32), 1e4, 16, 512)
    assert "\n" not in str(err.value)


def roundtrip(tmp_path, tokenizer, scaling, type="f32", **overrides):
    """(source transformers model, our import of its GGUF, token ids)."""
    rope = dict(rope_theta=overrides.pop("theta", 5e5), **scaling)
    hf = make_hf_model("llama", **{**TINY, **overrides}, rope_parameters=rope)
    path = export_gguf(ours_from_hf(hf), tmp_path / "m.gguf", type, tokenizer=tokenizer)
    names = [t.name for t in gguf.GGUFReader(str(path)).tensors]
    assert "rope_freqs.weight" in names
    return hf, load_model(path), torch.tensor(tokenizer(PROMPT)["input_ids"])


def assert_same_model(hf, back, ids, type):
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        got = back(ids, SeqInfo.from_lengths([len(ids)]))
    err = (got - ref).abs().max() / ref.abs().max()
    assert err < TOLERANCE[type], f"{type}: relative error {err:.2e}"
    # The imported config computes the source's frequencies, in our code and transformers'.
    want = hf.model.rotary_emb.inv_freq
    torch.testing.assert_close(back.model.inv_freq, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(hf_inv_freq(back.config.hf), want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("type", ["f32", "f16"])
def test_llama31_roundtrip(tmp_path, tokenizer, type):
    hf, back, ids = roundtrip(tmp_path, tokenizer, LLAMA31, type)
    assert_same_model(hf, back, ids, type)
    assert back.config.hf["rope_scaling"] == LLAMA31
    assert back.config.rope == RopeConfig.from_hf(hf.config.to_dict())


def test_file_without_original_context_reads_the_same(tmp_path, tokenizer, monkeypatch):
    """A file as llama.cpp's converter writes it (no original_context_length): low=1 gives
    original 8192, so the same config comes back."""
    monkeypatch.setattr(gguf.GGUFWriter, "add_rope_scaling_orig_ctx_len", lambda w, n: None)
    hf, back, ids = roundtrip(tmp_path, tokenizer, LLAMA31)
    path = tmp_path / "m.gguf"
    assert "llama.rope.scaling.original_context_length" not in gguf.GGUFReader(str(path)).fields
    assert_same_model(hf, back, ids, "f32")
    assert back.config.hf["rope_scaling"] == LLAMA31


@pytest.mark.parametrize(
    "original, theta, expect",
    [(8192, 100.0, None), (4, 5e5, {"rope_type": "linear", "factor": 8.0})],
)
def test_all_high_or_all_low_band_roundtrip(tmp_path, tokenizer, original, theta, expect):
    """Every wavelength below original/high (divisors all 1: plain RoPE) or above
    original/low (all factor: linear scaling)."""
    scaling = {**LLAMA31, "original_max_position_embeddings": original}
    hf, back, ids = roundtrip(tmp_path, tokenizer, scaling, theta=theta)
    r = divisors(RopeConfig.from_hf(hf.config.to_dict()), 64)
    assert (r == (1.0 if expect is None else 8.0)).all()
    assert_same_model(hf, back, ids, "f32")
    assert back.config.hf.get("rope_scaling") == expect


def test_malformed_file_is_one_line(tmp_path, tokenizer, monkeypatch):
    from slipstream.checkpoint import gguf_arch

    plain = gguf_arch.extra_tensors

    def reversed_freqs(cfg):
        for name, t in plain(cfg):
            yield name, t.flip(0)

    monkeypatch.setattr(gguf_arch, "extra_tensors", reversed_freqs)
    hf = make_hf_model("llama", **TINY, rope_parameters=dict(rope_theta=5e5, **LLAMA31))
    path = export_gguf(ours_from_hf(hf), tmp_path / "m.gguf", "f32", tokenizer=tokenizer)
    with pytest.raises(
        ValueError, match=r"rope_freqs.weight\[\d+\] is [\d.]+, below .* \(8\)"
    ) as err:
        load_model(path)
    assert "\n" not in str(err.value)


def test_rope_freqs_with_another_scaling_is_refused(tmp_path, tokenizer, monkeypatch):
    """llama.cpp would apply both the divisors and a linear factor: not a transformers model."""
    add_original = gguf.GGUFWriter.add_rope_scaling_orig_ctx_len

    def with_linear(w, n):
        add_original(w, n)
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)

    monkeypatch.setattr(gguf.GGUFWriter, "add_rope_scaling_orig_ctx_len", with_linear)
    hf = make_hf_model("llama", **TINY, rope_parameters=dict(rope_theta=5e5, **LLAMA31))
    path = export_gguf(ours_from_hf(hf), tmp_path / "m.gguf", "f32", tokenizer=tokenizer)
    with pytest.raises(ValueError, match="rope_freqs and rope scaling type 'linear'"):
        load_model(path)
