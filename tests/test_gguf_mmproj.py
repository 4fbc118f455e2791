"""GGUF mmproj export of image-text checkpoints (checkpoint/gguf_mmproj.py): what the writer
puts in the file (keys, tensor names, shapes, values), read back with the `gguf` package;
the one-line refusals. llama.cpp itself running the files: tests/test_gguf_mmproj_llama_cpp.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers.tiny_vlm import qwen2_5_vl_as_llama_cpp, randomise_constant_tensors, vlm_folder
from safetensors.torch import load_file, save_file

from slipstream.checkpoint.gguf_export import mmproj_path
from slipstream.checkpoint.gguf_mmproj import adapter_trains_vision
from slipstream.cli import main

gguf = pytest.importorskip("gguf")

# Gemma 3's text model as llama.cpp runs it: 1/sqrt(head_dim) attention scale and its fixed
# layer pattern (every 6th layer global: two layers are both sliding).
GEMMA3_TEXT = dict(query_pre_attn_scalar=8, layer_types=["sliding_attention"] * 2,
                   sliding_window=16)  # fmt: skip


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    folder = vlm_folder(tmp_path_factory.mktemp("gemma3"), "gemma3", text=GEMMA3_TEXT)
    randomise_constant_tensors(folder)  # Gemma 3's projector starts at zero
    return folder


def fields(reader) -> dict:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def test_gemma3_mmproj_keys_names_and_values(gemma3, tmp_path, capsys):
    out = tmp_path / "m.f32.gguf"
    assert main(["export", str(gemma3), "--gguf", "f32", "--out", str(out)]) == 0
    mm = mmproj_path(out, "f32")
    assert mm.name == "mmproj-m.f32.gguf" and out.is_file() and mm.is_file()
    said = capsys.readouterr().out
    assert f"--mmproj {mm}" in said
    meta = fields(gguf.GGUFReader(mm))
    cfg = json.loads((gemma3 / "config.json").read_text())
    assert meta["general.architecture"] == "clip" and meta["general.type"] == "mmproj"
    assert meta["clip.projector_type"] == "gemma3" and meta["clip.has_vision_encoder"]
    assert meta["clip.vision.projection_dim"] == cfg["text_config"]["hidden_size"] == 32
    assert (meta["clip.vision.image_size"], meta["clip.vision.patch_size"]) == (28, 7)
    assert meta["clip.vision.embedding_length"] == 16
    assert meta["clip.vision.feed_forward_length"] == 24
    assert meta["clip.vision.block_count"] == 1
    assert meta["clip.vision.attention.head_count"] == 2
    assert meta["clip.vision.image_mean"] == meta["clip.vision.image_std"] == [0.5] * 3
    assert meta["clip.use_gelu"] is True
    # 4x4 patches pooled to mm_tokens_per_image = 4 (2x2): kernel 2, not llama.cpp's default 4
    assert meta["clip.vision.projector.scale_factor"] == 2
    reader = gguf.GGUFReader(mm)
    tensors = {t.name: t for t in reader.tensors}
    names = {
        "v.patch_embd.weight", "v.patch_embd.bias", "v.position_embd.weight",
        "v.post_ln.weight", "v.post_ln.bias", "mm.input_projection.weight",
        "mm.soft_emb_norm.weight",
        *(f"v.blk.0.{p}.{k}" for p in ("attn_q", "attn_k", "attn_v", "attn_out", "ln1", "ln2",
                                       "ffn_up", "ffn_down") for k in ("weight", "bias")),
    }  # fmt: skip
    assert set(tensors) == names  # SigLIP's pooling head (vision_tower.head.*) left out
    hf = {k.removeprefix("model."): v for k, v in load_file(gemma3 / "model.safetensors").items()}

    def back(name):  # GGUF lists dims fastest first: torch's shape reversed
        t = tensors[name]
        assert t.tensor_type == gguf.GGMLQuantizationType.F32
        return torch.from_numpy(t.data.copy()).reshape(tuple(reversed(t.shape.tolist())))

    tower = "vision_tower.encoder.layers.0"
    assert torch.equal(
        back("v.patch_embd.weight"), hf["vision_tower.embeddings.patch_embedding.weight"]
    )  # noqa: E501
    assert torch.equal(back("v.blk.0.ffn_up.weight"), hf[f"{tower}.mlp.fc1.weight"])
    assert torch.equal(back("v.blk.0.attn_out.bias"), hf[f"{tower}.self_attn.out_proj.bias"])
    proj = hf["multi_modal_projector.mm_input_projection_weight"]  # (vision, text)
    assert torch.equal(back("mm.input_projection.weight"), proj)
    norm = hf["multi_modal_projector.mm_soft_emb_norm.weight"]
    assert torch.equal(back("mm.soft_emb_norm.weight"), norm + 1)  # Gemma's 1 + w, stored


def test_f16_mmproj_beside_a_quantized_text_file(gemma3, tmp_path):
    out = tmp_path / "m.q8_0.gguf"
    assert main(["export", str(gemma3), "--gguf", "q8_0", "--out", str(out)]) == 0
    mm = tmp_path / "mmproj-m.f16.gguf"
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(mm).tensors}
    Q = gguf.GGMLQuantizationType
    assert types["v.blk.0.attn_q.weight"] == types["mm.input_projection.weight"] == Q.F16
    assert types["v.blk.0.attn_q.bias"] == types["v.patch_embd.weight"] == Q.F32
    assert main(["export", str(gemma3), "--gguf", "q8_0", "--out", str(out)]) == 2  # exists
    assert main(["export", str(gemma3), "--gguf", "q8_0", "--out", str(out), "--force"]) == 0


@pytest.mark.parametrize("kind", ["idefics3", "smolvlm"])
def test_idefics3_text_gguf_and_mmproj(kind, tmp_path):
    folder = vlm_folder(tmp_path / kind, kind)
    out = tmp_path / "i.f32.gguf"
    assert main(["export", str(folder), "--gguf", "f32", "--out", str(out)]) == 0
    text = gguf.GGUFReader(out)
    assert fields(text)["general.architecture"] == "llama"  # the language model alone
    names = {t.name for t in text.tensors}
    assert {"token_embd.weight", "output.weight", "blk.1.attn_q.weight"} <= names
    assert not [n for n in names if n.startswith(("v.", "mm."))]
    reader = gguf.GGUFReader(tmp_path / "mmproj-i.f32.gguf")
    meta = fields(reader)
    assert meta["clip.projector_type"] == "idefics3"
    assert meta["clip.vision.projector.scale_factor"] == 2  # config.json's scale_factor
    assert meta["clip.vision.preproc_image_size"] == 56  # the processor's longest edge
    assert meta["clip.vision.projection_dim"] == 32 and meta["clip.use_gelu"] is True
    tensors = {t.name: t for t in reader.tensors}
    fc = tensors["mm.model.fc.weight"]  # connector.modality_projection.proj: (32, 16 * 2 * 2)
    hf = load_file(folder / "model.safetensors")
    proj = hf["model.connector.modality_projection.proj.weight"]
    assert fc.shape.tolist() == [64, 32]
    assert torch.equal(torch.from_numpy(fc.data.copy()).reshape(32, 64), proj)
    assert {"v.patch_embd.weight", "v.position_embd.weight", "v.post_ln.weight"} <= set(tensors)
    assert not [n for n in tensors if not n.startswith(("v.", "mm."))]


def test_qwen2_5_vl_text_gguf_and_mmproj(tmp_path):
    folder = qwen2_5_vl_as_llama_cpp(vlm_folder(tmp_path / "q", "qwen2_5_vl"))
    out = tmp_path / "q.f32.gguf"
    assert main(["export", str(folder), "--gguf", "f32", "--out", str(out)]) == 0
    text = fields(gguf.GGUFReader(out))
    assert text["general.architecture"] == "qwen2vl"
    assert text["qwen2vl.rope.dimension_sections"] == [1, 1, 2, 0]  # mrope_section, then 0
    reader = gguf.GGUFReader(tmp_path / "mmproj-q.f32.gguf")
    meta = fields(reader)
    assert meta["clip.projector_type"] == "qwen2.5vl_merger" and meta["clip.use_silu"] is True
    assert meta["clip.vision.n_wa_pattern"] == 2  # every 2nd block full: fullatt [1]
    assert meta["clip.vision.block_count"] == 2 and meta["clip.vision.projection_dim"] == 32
    tensors = {t.name: torch.from_numpy(t.data.copy()) for t in reader.tensors}
    saved = load_file(folder / "model.safetensors")  # transformers writes `visual.*` here
    hf = {k.removeprefix("model."): v for k, v in saved.items()}
    conv = hf["visual.patch_embed.proj.weight"]  # (D, C, 2, p, p): a Conv2d per frame
    for k, name in enumerate(("v.patch_embd.weight", "v.patch_embd.weight.1")):
        assert torch.equal(tensors[name].reshape(conv[:, :, k].shape), conv[:, :, k])
    qkv = hf["visual.blocks.1.attn.qkv.weight"].chunk(3)
    for part, w in zip("qkv", qkv):
        assert torch.equal(tensors[f"v.blk.1.attn_{part}.weight"].reshape(w.shape), w)
    assert "v.blk.0.attn_qkv.weight" not in tensors and "mm.2.weight" in tensors
    assert not [n for n in tensors if not n.startswith(("v.", "mm."))]


def test_gemma4_text_gguf_and_mmproj(tmp_path):
    folder = vlm_folder(tmp_path / "g", "gemma4")
    randomise_constant_tensors(folder)
    out = tmp_path / "g.f32.gguf"
    assert main(["export", str(folder), "--gguf", "f32", "--out", str(out)]) == 0
    text = gguf.GGUFReader(out)
    assert fields(text)["general.architecture"] == "gemma4"  # the language model alone
    assert not [t.name for t in text.tensors if t.name.startswith(("v.", "mm."))]
    reader = gguf.GGUFReader(tmp_path / "mmproj-g.f32.gguf")
    meta = fields(reader)
    assert meta["clip.projector_type"] == "gemma4v" and meta["clip.use_gelu"] is True
    assert meta["clip.vision.projection_dim"] == 32 and meta["clip.vision.embedding_length"] == 16
    assert meta["clip.vision.patch_size"] == 4 and meta["clip.vision.block_count"] == 1
    assert "clip.vision.projector.scale_factor" not in meta  # kernel 3: llama.cpp's default
    # Gemma 4's processor only rescales; its graph maps [0, 1] to [-1, 1] itself
    assert meta["clip.vision.image_mean"] == [0.0] * 3
    assert meta["clip.vision.image_std"] == [1.0] * 3
    tensors = {t.name: t for t in reader.tensors}
    hf = {k.removeprefix("model."): v for k, v in load_file(folder / "model.safetensors").items()}

    def back(name):  # GGUF lists dims fastest first: torch's shape reversed
        t = tensors[name]
        return torch.from_numpy(t.data.copy()).reshape(tuple(reversed(t.shape.tolist())))

    proj = hf["vision_tower.patch_embedder.input_proj.weight"]  # (16, 4 * 4 * 3): (py, px, c)
    conv = proj.reshape(16, 4, 4, 3).permute(0, 3, 1, 2)
    assert torch.equal(back("v.patch_embd.weight"), conv)  # a (D, c, p, p) conv
    table = hf["vision_tower.patch_embedder.position_embedding_table"]  # (2, 256, 16): x, y
    assert torch.equal(back("v.position_embd.weight"), table)
    layer = "vision_tower.encoder.layers.0"
    assert torch.equal(back("v.blk.0.attn_q.weight"), hf[f"{layer}.self_attn.q_proj.linear.weight"])
    assert torch.equal(back("v.blk.0.attn_q_norm.weight"), hf[f"{layer}.self_attn.q_norm.weight"])
    assert torch.equal(
        back("v.blk.0.ffn_post_norm.weight"), hf[f"{layer}.post_feedforward_layernorm.weight"]
    )  # w, not 1 + w
    proj = hf["embed_vision.embedding_projection.weight"]  # (text, vision): kept
    assert torch.equal(back("mm.input_projection.weight"), proj)
    assert not [n for n in tensors if not n.startswith(("v.", "mm."))]
    # Gemma4ClippableLinear's bounds (0-d buffers): 1-element tensors beside their weight
    from slipstream.checkpoint.gguf_mmproj_gemma4 import GEMMA4V

    name, t = GEMMA4V.rename(f"{layer}.mlp.down_proj.output_min", torch.tensor(-1.5))
    assert name == "v.blk.0.ffn_down.output_min" and t.tolist() == [-1.5]


@pytest.mark.parametrize(
    "change, said",
    [
        (lambda c: c["vision_config"].update(rope_parameters={"rope_type": "axial",
                                                              "rope_theta": 10.0}),
         "RoPE base 10 (llama.cpp: 100)"),
        (lambda c: c["text_config"].update(use_bidirectional_attention=None),
         "llama.cpp decodes its images bidirectionally"),
        (lambda c: c.update(audio_config={"model_type": "gemma4_audio"}), "audio tower"),
    ],
)  # fmt: skip
def test_a_gemma4_vision_side_llama_cpp_would_run_differently_is_one_line(
    tmp_path, capsys, change, said
):
    folder = vlm_folder(tmp_path / "g", "gemma4")
    config = json.loads((folder / "config.json").read_text())
    change(config)
    (folder / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert main(["export", str(folder), "--gguf", "f16"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and said in err, err
    assert not (folder / "gguf").exists()  # refused before anything is written


def test_a_qwen2_5_vl_tower_llama_cpp_would_run_differently_is_one_line(tmp_path, capsys):
    folder = vlm_folder(tmp_path / "q", "qwen2_5_vl")  # a 56-px window: llama.cpp fixes 112
    capsys.readouterr()
    assert main(["export", str(folder), "--gguf", "f16"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "window_size 56 (llama.cpp: 112)" in err
    assert not (folder / "gguf").exists()  # refused before anything is written


@pytest.mark.parametrize("kind", ["llava", "qwen3_vl"])
def test_unsupported_image_text_type_is_one_line_and_writes_nothing(kind, tmp_path, capsys):
    folder = vlm_folder(tmp_path / kind, kind)
    capsys.readouterr()  # what building the checkpoint printed
    assert main(["export", str(folder), "--gguf", "f16"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"no GGUF mmproj for model_type {kind!r}" in err
    assert "supported: gemma3, idefics3, smolvlm, qwen2_5_vl, gemma4." in err
    assert ("llama.cpp#25814" in err) == (kind == "llava")  # the reason, not just the type
    assert not (folder / "gguf").exists()  # refused before the output folder is made


def test_adapter_that_trains_the_tower_is_detected(tmp_path):
    lm = "base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A.weight"
    tower = "base_model.model.model.vision_tower.encoder.layers.0.self_attn.q_proj.lora_A.weight"
    save_file({lm: torch.zeros(2, 4)}, tmp_path / "adapter_model.safetensors")
    assert not adapter_trains_vision(tmp_path)
    both = {lm: torch.zeros(2, 4), tower: torch.zeros(2, 4)}
    save_file(both, tmp_path / "adapter_model.safetensors")
    assert adapter_trains_vision(tmp_path)


def test_missing_image_processor_config_is_one_line_before_writing(gemma3, tmp_path, capsys):
    import shutil

    folder = tmp_path / "noproc"
    shutil.copytree(gemma3, folder, ignore=shutil.ignore_patterns("processor_config.json"))
    assert main(["export", str(folder), "--gguf", "f16", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no image processor config" in err
    assert not list(tmp_path.glob("*.gguf"))


def test_lora_adapter_exports_text_and_the_bases_mmproj(gemma3, tmp_path):
    """A peft adapter on the language model (as a LoRA run saves it): the text GGUF is the
    merged model, the mmproj the base's vision side, found through adapter_config.json."""
    import transformers
    from peft import LoraConfig, get_peft_model

    model = transformers.AutoModelForImageTextToText.from_pretrained(str(gemma3)).float()
    lora = LoraConfig(r=2, target_modules=r".*language_model.*\.(q_proj|v_proj)")
    peft_model = get_peft_model(model, lora)
    adapter = tmp_path / "adapter"
    peft_model.save_pretrained(adapter)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(gemma3)
    out = tmp_path / "a.f32.gguf"
    assert main(["export", str(adapter), "--gguf", "f32", "--out", str(out)]) == 0
    base = tmp_path / "base.f32.gguf"
    assert main(["export", str(gemma3), "--gguf", "f32", "--out", str(base)]) == 0
    ours = {t.name: t.data for t in gguf.GGUFReader(tmp_path / "mmproj-a.f32.gguf").tensors}
    theirs = {t.name: t.data for t in gguf.GGUFReader(tmp_path / "mmproj-base.f32.gguf").tensors}
    assert ours.keys() == theirs.keys() and all((ours[k] == theirs[k]).all() for k in ours)


def test_gguf_lora_of_an_idefics3_adapter_is_one_line(tmp_path, capsys):
    import transformers
    from peft import LoraConfig, get_peft_model

    folder = vlm_folder(tmp_path / "idefics3", "idefics3")
    model = transformers.AutoModelForImageTextToText.from_pretrained(str(folder))
    lora = LoraConfig(r=2, target_modules=r".*text_model.*\.q_proj")
    get_peft_model(model, lora).save_pretrained(tmp_path / "adapter")
    capsys.readouterr()
    assert main(["export", str(tmp_path / "adapter"), "--gguf-adapter"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "idefics3 adapter has no GGUF LoRA form" in err
