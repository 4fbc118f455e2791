"""Multimodal Gemma 3 checkpoints (Gemma3ForConditionalGeneration, `model_type: gemma3`) on
text against transformers and peft through load_model: logits, loss and grads, LoRA adapters
both ways (none on the vision tower unless asked; a peft adapter that wraps it loads), merged
export that is still a multimodal model (vision tower and projector bit-identical), NF4 (text
linears only), and a trainer run. Images: tests/test_vision_native_gemma.py.

The tiny text config is test_gemma3's (windows, two RoPEs, query_pre_attn_scalar != head_dim);
the vision side is a one-layer SigLIP whose attention has q_proj/k_proj/v_proj, the names a
plain LoRA target list would also hit.
"""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
from helpers.models import per_sequence_logits, randomise_lora_b, shifted_labels
from helpers.runs import chat_rows
from helpers.tokenizers import save_test_tokenizer
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from safetensors import safe_open
from safetensors.torch import save_file

import slipstream
from slipstream.models import gemma3
from slipstream.models.weights import from_hf_name, to_hf_name
from slipstream.ops.packing import SeqInfo

VOCAB = 97
LENGTHS = [7, 3, 12, 1]
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    query_pre_attn_scalar=24,
    sliding_window=4,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
    },
)
VISION = dict(
    hidden_size=32,
    intermediate_size=40,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=28,
    patch_size=7,
)
TEXT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_multimodal(seed: int = 0, vocab_size: int = VOCAB, **top):
    """A float32 Gemma3ForConditionalGeneration, norms randomised (ones/zeros by default)."""
    import transformers

    text = {**TEXT, "vocab_size": vocab_size}
    config = transformers.Gemma3Config(
        text_config=text,
        vision_config=VISION,
        mm_tokens_per_image=4,
        boi_token_index=vocab_size - 3,
        eoi_token_index=vocab_size - 2,
        image_token_index=vocab_size - 1,
        **top,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def mm_dir(tmp_path_factory):
    """(transformers model, folder written by save_pretrained: language_model.model.* names)."""
    hf = make_multimodal()
    path = tmp_path_factory.mktemp("gemma3_mm")
    hf.save_pretrained(path)
    return hf, path


def _hf_logits(hf, ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return per_sequence_logits(hf, ids, lengths)


def _ids(n: int, seed: int) -> torch.Tensor:
    # Not 0, the pad id: transformers' embedding gives its row no gradient (padding_idx).
    return torch.randint(1, VOCAB - 3, (n,), generator=torch.Generator().manual_seed(seed))


def _tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def _is_vision(name: str) -> bool:
    return re.match(r"(model\.)?(vision_tower|multi_modal_projector)\.", name) is not None


def test_packed_logits_match_transformers_per_sequence(mm_dir):
    hf, path = mm_dir
    assert any(k.startswith("language_model.model.") for k in _tensors(path))  # saved layout
    ours = slipstream.load_model(path)
    assert ours.config.model_type == "gemma3" and ours.config.tie_word_embeddings
    assert [layer.self_attn.window for layer in ours.model.layers] == [4, None, 4]
    # The vision side is held under transformers' names below its prefixes, as saved.
    theirs = dict(hf.named_parameters())
    vision = {n: p for n, p in ours.named_parameters() if not n.startswith("model.")}
    assert len(vision) > 10 and all(torch.equal(p, theirs[f"model.{n}"]) for n, p in vision.items())
    ids = _ids(sum(LENGTHS), seed=1)
    with torch.no_grad():
        packed = ours(ids, SeqInfo.from_lengths(LENGTHS))
    torch.testing.assert_close(packed, _hf_logits(hf, ids, LENGTHS), atol=1e-4, rtol=1e-4)


def test_loss_and_grads_match_transformers(mm_dir):
    hf, path = mm_dir
    hf = copy.deepcopy(hf)
    ours = slipstream.load_model(path)
    ids = _ids(19, seed=2)
    ref = hf(input_ids=ids[None], labels=ids[None]).loss
    ref.backward()
    loss = ours.loss(ids, shifted_labels(ids, [19]), SeqInfo.from_lengths([19]))
    loss.backward()
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    hf_params = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        theirs = hf_params[to_hf_name(name, gemma3.MULTIMODAL_LAYOUTS[0])]
        if p.grad is None:  # the vision side, on text
            assert theirs.grad is None and not name.startswith("model."), name
            continue
        torch.testing.assert_close(p.grad, theirs.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_untied_checkpoint_in_transformers_module_names(tmp_path):
    """A checkpoint under transformers' module names (model.language_model.*, lm_head,
    model.vision_tower.*) with an untied head loads; save keeps that layout."""
    import transformers

    hf = make_multimodal(seed=3, tie_word_embeddings=False)
    src, out = tmp_path / "src", tmp_path / "out"
    hf.save_pretrained(src)
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, src / "model.safetensors")
    processor = json.dumps({"image_processor_type": "Gemma3ImageProcessor", "size": 28})
    (src / "preprocessor_config.json").write_text(processor)
    ours = slipstream.load_model(src)
    assert not ours.config.tie_word_embeddings
    torch.testing.assert_close(ours.lm_head.weight, hf.lm_head.weight, atol=0, rtol=0)
    ids = _ids(13, seed=3)
    with torch.no_grad():
        got = ours(ids, SeqInfo.from_lengths([13]))
    torch.testing.assert_close(got, _hf_logits(hf, ids, [13]), atol=1e-4, rtol=1e-4)
    slipstream.save_model(ours, out)
    assert set(_tensors(out)) == set(_tensors(src))
    assert (out / "preprocessor_config.json").read_text() == processor
    back = transformers.Gemma3ForConditionalGeneration.from_pretrained(out, dtype=torch.float32)
    torch.testing.assert_close(_hf_logits(back, ids, [13]), got, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("targets,dora", [(None, False), ("all-linear", False), (None, True)])
def test_lora_adapter_loads_in_peft_on_the_multimodal_model(mm_dir, tmp_path, targets, dora):
    hf, path = mm_dir
    ours = slipstream.load_model(path)
    slipstream.apply_lora(ours, rank=4, alpha=8, targets=targets, use_dora=dora)
    randomise_lora_b(ours)
    slipstream.save_adapter(ours, tmp_path)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    # A regex over the language model, not a name list (which would hit the tower's q/k/v).
    assert isinstance(cfg["target_modules"], str)
    peft_model = PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path).eval()
    wrapped = [n for n, m in peft_model.named_modules() if isinstance(m, LoraLayer)]
    assert not [n for n in wrapped if "vision_tower" in n or "projector" in n]
    assert len(wrapped) == 3 * 7 == len(slipstream.peft.lora.lora_modules(ours))
    ids = _ids(sum(LENGTHS), seed=4)
    with torch.no_grad():
        got = ours(ids, SeqInfo.from_lengths(LENGTHS))
    expected = _hf_logits(peft_model, ids, LENGTHS)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    # The adapter changed the output, so the comparison above could fail.
    assert (_hf_logits(hf, ids, LENGTHS) - expected).abs().max() > 1e-3
    # Our own adapter loads back here with the same logits.
    again = slipstream.load_adapter(slipstream.load_model(path), tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(again(ids, SeqInfo.from_lengths(LENGTHS)), got, atol=0, rtol=0)


@pytest.mark.parametrize("layers", [r"\d+", "[02]"])
def test_peft_adapter_with_language_model_regex_loads_here(mm_dir, tmp_path, layers):
    """peft's regex target_modules select the same modules here (all layers, or some); our
    re-save of it wraps exactly those in peft again."""
    hf, path = mm_dir
    regex = rf"model\.language_model\.layers\.{layers}\.(self_attn\.(q_proj|v_proj)|mlp\.down_proj)"
    config = LoraConfig(r=4, lora_alpha=8, target_modules=regex, task_type="CAUSAL_LM")
    peft_model = get_peft_model(copy.deepcopy(hf), config)
    randomise_lora_b(peft_model)
    peft_model.save_pretrained(tmp_path / "peft")
    ours = slipstream.load_adapter(slipstream.load_model(path), tmp_path / "peft")
    assert ours.lora_config["target_modules"] == ["down_proj", "q_proj", "v_proj"]
    n_layers = 3 if layers == r"\d+" else 2
    assert len(slipstream.peft.lora.lora_modules(ours)) == n_layers * 3
    ids = _ids(sum(LENGTHS), seed=5)
    with torch.no_grad():
        got = ours(ids, SeqInfo.from_lengths(LENGTHS))
    expected = _hf_logits(peft_model.eval(), ids, LENGTHS)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert (_hf_logits(hf, ids, LENGTHS) - expected).abs().max() > 1e-3
    slipstream.save_adapter(ours, tmp_path / "ours")
    again = PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "ours").eval()
    wrapped = [n for n, m in again.named_modules() if isinstance(m, LoraLayer)]
    assert len(wrapped) == n_layers * 3
    torch.testing.assert_close(_hf_logits(again, ids, LENGTHS), got, atol=1e-4, rtol=1e-4)


def test_peft_adapter_on_the_vision_tower_loads_here(mm_dir, tmp_path):
    """A name list in peft wraps the SigLIP q/v_proj too; our model holds the tower, so the
    adapter loads whole: the same image features and text logits as peft's."""
    hf, path = mm_dir
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    peft_model = get_peft_model(copy.deepcopy(hf), config)
    randomise_lora_b(peft_model)
    peft_model.save_pretrained(tmp_path)
    ours = slipstream.load_adapter(slipstream.load_model(path), tmp_path)
    wrapped = slipstream.peft.lora.lora_modules(ours)
    assert len(wrapped) == 3 * 2 + 2 and sum(n.startswith("vision_tower.") for n in wrapped) == 2
    pixels = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(0))
    ids = _ids(sum(LENGTHS), seed=8)
    with torch.no_grad():  # the tower's output (this checkpoint's projection is zeros)
        feats = ours.vision_tower(pixels)
        tower = peft_model.eval().base_model.model.model.vision_tower
        expected = tower(pixel_values=pixels).last_hidden_state
        torch.testing.assert_close(feats, expected, atol=1e-5, rtol=1e-4)
        plain = hf.model.vision_tower(pixel_values=pixels).last_hidden_state
        assert (plain - feats).abs().max() > 1e-4  # the tower's adapter matters
        got = ours(ids, SeqInfo.from_lengths(LENGTHS))
        torch.testing.assert_close(got, _hf_logits(peft_model, ids, LENGTHS), atol=1e-4, rtol=1e-4)


def test_export_merged_is_a_multimodal_checkpoint(mm_dir, tmp_path):
    import transformers

    hf, path = mm_dir
    ours = slipstream.load_model(path)
    slipstream.apply_lora(ours, rank=4, alpha=8, targets="all-linear")
    randomise_lora_b(ours)
    ids = _ids(11, seed=6)
    with torch.no_grad():
        expected = ours(ids, SeqInfo.from_lengths([11]))
    slipstream.export_merged(ours, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["vision_config"]
    back, info = transformers.AutoModelForImageTextToText.from_pretrained(
        tmp_path, dtype=torch.float32, output_loading_info=True
    )
    assert type(back).__name__ == "Gemma3ForConditionalGeneration"
    assert not info["missing_keys"] and not info["unexpected_keys"]
    got = _hf_logits(back, ids, [11])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert (_hf_logits(hf, ids, [11]) - expected).abs().max() > 1e-3
    # Every vision/projector tensor is the source's, bit for bit, in the file and loaded.
    source, exported = _tensors(path), _tensors(tmp_path)
    vision = [k for k in source if _is_vision(k)]
    assert len(vision) > 10 and set(exported) == set(source)
    assert all(torch.equal(exported[k], source[k]) for k in vision)
    summary = json.loads((tmp_path / "export_summary.json").read_text())
    # Only SigLIP's pooling head (unused by Gemma 3) is copied; the rest is ours, unchanged.
    assert summary["copied_from_source"]["tensors"] == len([k for k in vision if ".head." in k])
    theirs = dict(back.named_parameters())
    for name, p in hf.named_parameters():
        if _is_vision(name):
            assert torch.equal(theirs[name], p), name


def test_save_without_the_source_checkpoint_is_a_one_line_error(mm_dir, tmp_path):
    _, path = mm_dir
    ours = slipstream.load_model(path)
    del ours.checkpoint_path
    with pytest.raises(ValueError, match="vision tower.*load_model") as e:
        slipstream.save_model(ours, tmp_path)
    assert "\n" not in str(e.value)


def test_export_from_a_4bit_vision_tower_is_a_one_line_error(mm_dir, tmp_path):
    """A bitsandbytes checkpoint's packed vision weights cannot be copied into a
    full-precision export: say where to export from instead."""
    _, path = mm_dir
    tensors = _tensors(path)
    name = next(k for k in tensors if k.startswith("vision_tower.head.") and k.endswith(".weight"))
    tensors[f"{name}.absmax"] = torch.ones(4)
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text((path / "config.json").read_text())
    save_file(tensors, src / "model.safetensors")
    with pytest.raises(ValueError, match="4-bit.*--base ORIGINAL") as e:
        slipstream.export_merged(slipstream.load_model(src), tmp_path / "out")
    assert "\n" not in str(e.value)


def test_nf4_load_quantises_only_the_text_linears(mm_dir):
    bnb = pytest.importorskip("bitsandbytes")
    _, path = mm_dir
    ours = slipstream.load_model(path, quantize="nf4")
    ref = slipstream.load_model(path)
    nf4 = [n for n, m in ours.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(nf4) == 3 * 7 and all(n.startswith("model.layers.") for n in nf4)
    with torch.no_grad():  # NF4 layers compute x @ dequant(W).T; everything else as loaded
        for name in nf4:
            m = ours.get_submodule(name)
            w = bnb.functional.dequantize_4bit(m.weight.data, m.weight.quant_state)
            assert (w - ref.get_submodule(name).weight).abs().max() > 0
            ref.get_submodule(name).weight.copy_(w)
        seq, ids = SeqInfo.from_lengths(LENGTHS), _ids(sum(LENGTHS), seed=7)
        torch.testing.assert_close(ours(ids, seq), ref(ids, seq), atol=1e-5, rtol=1e-5)


def test_trainer_lora_run_writes_an_adapter_peft_loads(tmp_path):
    from slipstream.config import config_from_dict
    from slipstream.train import train

    model_dir = tmp_path / "model"
    save_test_tokenizer(model_dir, "chatml", vocab_size=300)
    hf = make_multimodal(seed=4, vocab_size=300)
    with torch.no_grad():  # at init scale 0.02 the logits are ~uniform and LoRA cannot move them
        for name, p in hf.named_parameters():
            if "language_model" in name and "norm" not in name:
                p.normal_(0, 0.2)
    hf.save_pretrained(model_dir)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in chat_rows(24)))
    out = tmp_path / "out"
    raw = {
        "model": {"path": str(model_dir)},
        "data": {"train": str(data)},
        "lora": {"rank": 4, "alpha": 8},
        "train": {
            "lr": 3e-3, "steps": 4, "tokens_per_batch": 128, "warmup_steps": 1,
            "log_every": 1, "device": "cpu", "activation_checkpointing": "none",
        },
        "output_dir": str(out),
    }  # fmt: skip
    train(config_from_dict(raw))
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in lines if "loss" in r]) == 4
    peft_model = PeftModel.from_pretrained(copy.deepcopy(hf), out).eval()
    wrapped = [n for n, m in peft_model.named_modules() if isinstance(m, LoraLayer)]
    assert len(wrapped) == 3 * 7 and all("language_model" in n for n in wrapped)
    ours = slipstream.load_adapter(slipstream.load_model(model_dir), out)
    ids = torch.randint(0, 290, (15,), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        got = ours(ids, SeqInfo.from_lengths([15]))
    expected = _hf_logits(peft_model, ids, [15])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert (_hf_logits(hf, ids, [15]) - expected).abs().max() > 1e-4  # it trained


# ------------------------------------------------------------------- config.json variants

# Gemma-3-4B's config.json as published (transformers 4.50): text_config lists only what
# differs from Gemma3TextConfig's defaults; no tie_word_embeddings anywhere (tied).
GEMMA3_4B_V4 = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": 255999, "eoi_token_index": 256000, "eos_token_id": [1, 106],
    "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {
        "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
        "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "torch_dtype": "bfloat16",
    "vision_config": {
        "hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
        "model_type": "siglip_vision_model", "num_attention_heads": 16,
        "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False,
    },
}  # fmt: skip


def test_published_4b_config_builds_transformers_model():
    """The sparse 4B config.json builds, on the meta device, the model transformers builds
    from it: same names (below its prefixes), shapes, windows, RoPEs."""
    import transformers
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    from slipstream.models.rope import rope_inv_freq

    hf_cfg = transformers.Gemma3Config(
        **{k: v for k, v in GEMMA3_4B_V4.items() if k not in ("model_type", "architectures")}
    )
    with torch.device("meta"):
        ref = transformers.Gemma3ForConditionalGeneration(hf_cfg)
        ours = gemma3.build(gemma3.config_from_hf(GEMMA3_4B_V4))
    layout = (gemma3.MULTIMODAL_LAYOUTS[0],)  # the text model, SigLIP and the projector
    expected = {from_hf_name(n, layout): p.shape for n, p in ref.named_parameters()}
    assert {n: p.shape for n, p in ours.named_parameters()} == expected
    assert ours.config.tie_word_embeddings and ours.config.vocab_size == 262_208
    windows = [layer.self_attn.window for layer in ours.model.layers]
    assert windows == [None if (i + 1) % 6 == 0 else 1024 for i in range(34)]
    rotary = Gemma3RotaryEmbedding(hf_cfg.text_config)
    for rope, kind in ((ours.config.rope, "full"), (ours.config.local_rope, "sliding")):
        inv_freq, scale = rope_inv_freq(rope, ours.config.head_dim)
        expected_freq = getattr(rotary, f"{kind}_attention_inv_freq")
        torch.testing.assert_close(inv_freq, expected_freq, atol=0, rtol=1e-6)
        assert scale == getattr(rotary, f"{kind}_attention_attention_scaling")
    assert ours.config.rope.rope_type == "linear"


def test_multimodal_config_without_text_config_is_a_one_line_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3"}))
    with pytest.raises(ValueError, match="text_config") as e:
        slipstream.load_model(tmp_path)
    assert "\n" not in str(e.value)
