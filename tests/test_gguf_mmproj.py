"""GGUF mmproj export of image-text checkpoints (checkpoint/gguf_mmproj.py): what the writer
puts in the file (keys, tensor names, shapes, values), read back with the `gguf` package;
the one-line refusals. llama.cpp itself running the files: tests/test_gguf_mmproj_llama_cpp.py
and tests/test_gguf_mmproj_llama_cpp_qwen.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers.tiny_vlm import (
    ministral3_text,
    mistral3_as_llama_cpp,
    qwen2_5_vl_as_llama_cpp,
    qwen3_vl_as_llama_cpp,
    randomise_constant_tensors,
    vlm_folder,
)
from safetensors.torch import load_file, save_file

from slipstream.checkpoint.gguf_export import mmproj_path
from slipstream.checkpoint.gguf_mmproj import adapter_trains_vision
from slipstream.checkpoint.gguf_spec import permute_rotary
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
    _edit_config(
        folder, "text_config", rope_parameters={"rope_type": "default", "rope_theta": 1e5}
    )  # SmolVLM's
    out = tmp_path / "i.f32.gguf"
    assert main(["export", str(folder), "--gguf", "f32", "--out", str(out)]) == 0
    text = gguf.GGUFReader(out)
    assert fields(text)["general.architecture"] == "llama"  # the language model alone
    assert fields(text)["llama.rope.freq_base"] == 1e5  # config.json's, not a default
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


def test_gemma4_with_an_audio_tower_gets_a_vision_only_mmproj(tmp_path, capsys):
    from helpers.tiny_vlm import with_audio_tower

    folder = with_audio_tower(vlm_folder(tmp_path / "g", "gemma4"))
    out = tmp_path / "g.f16.gguf"
    capsys.readouterr()
    assert main(["export", str(folder), "--gguf", "f16", "--out", str(out)]) == 0
    assert "the audio tower is not written" in capsys.readouterr().out
    reader = gguf.GGUFReader(tmp_path / "mmproj-g.f16.gguf")
    assert fields(reader)["clip.projector_type"] == "gemma4v"
    assert not [k for k in reader.fields if "audio" in k]
    assert reader.tensors and all(t.name.startswith(("v.", "mm.")) for t in reader.tensors)
    assert not [t.name for t in gguf.GGUFReader(out).tensors if "audio" in t.name]


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

    name, t = GEMMA4V.rename(f"{layer}.mlp.down_proj.output_min", torch.tensor(-1.5), {})
    assert name == "v.blk.0.ffn_down.output_min" and t.tolist() == [-1.5]


@pytest.mark.parametrize(
    "change, said",
    [
        (lambda c: c["vision_config"].update(rope_parameters={"rope_type": "axial",
                                                              "rope_theta": 10.0}),
         "RoPE base 10 (llama.cpp: 100)"),
        (lambda c: c["text_config"].update(use_bidirectional_attention=None),
         "llama.cpp decodes its images bidirectionally"),
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


def _edit_config(folder, part: str, **values) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg[part].update(values)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_qwen3_vl_text_gguf_and_mmproj(tmp_path):
    folder = vlm_folder(tmp_path / "q", "qwen3_vl")
    _edit_config(folder, "vision_config", deepstack_visual_indexes=[1])  # merger 0 reads block 1
    qwen3_vl_as_llama_cpp(folder)
    randomise_constant_tensors(folder)
    out = tmp_path / "q.f32.gguf"
    assert main(["export", str(folder), "--gguf", "f32", "--out", str(out)]) == 0
    text = fields(gguf.GGUFReader(out))
    assert text["general.architecture"] == "qwen3vl" and text["qwen3vl.block_count"] == 3
    assert text["qwen3vl.rope.dimension_sections"] == [2, 1, 1, 0]
    assert text["qwen3vl.n_deepstack_layers"] == 1
    reader = gguf.GGUFReader(tmp_path / "mmproj-q.f32.gguf")
    meta = fields(reader)
    assert meta["clip.projector_type"] == "qwen3vl_merger" and meta["clip.use_gelu"] is True
    assert meta["clip.vision.is_deepstack_layers"] == [False, True]
    assert meta["clip.vision.image_size"] == 64  # the 4 x 4 position table of 16-px patches
    assert meta["clip.vision.spatial_merge_size"] == 2 and meta["clip.vision.block_count"] == 2
    tensors = {t.name: torch.from_numpy(t.data.copy()) for t in reader.tensors}
    hf = {k.removeprefix("model."): v for k, v in load_file(folder / "model.safetensors").items()}
    conv = hf["visual.patch_embed.proj.weight"]  # (D, C, 2, p, p): a Conv2d per frame
    for k, name in enumerate(("v.patch_embd.weight", "v.patch_embd.weight.1")):
        assert torch.equal(tensors[name].reshape(conv[:, :, k].shape), conv[:, :, k])
    same = {  # llama.cpp's name -> transformers' (fused qkv kept: its graph splits the rows)
        "v.blk.1.attn_qkv.weight": "visual.blocks.1.attn.qkv.weight",
        "v.position_embd.weight": "visual.pos_embed.weight",
        "v.post_ln.bias": "visual.merger.norm.bias",
        "mm.0.weight": "visual.merger.linear_fc1.weight",
        "mm.2.bias": "visual.merger.linear_fc2.bias",
        "v.deepstack.1.norm.weight": "visual.deepstack_merger_list.0.norm.weight",
        "v.deepstack.1.fc1.weight": "visual.deepstack_merger_list.0.linear_fc1.weight",
        "v.deepstack.1.fc2.bias": "visual.deepstack_merger_list.0.linear_fc2.bias",
    }  # fmt: skip
    for ours, theirs in same.items():
        assert torch.equal(tensors[ours].reshape(hf[theirs].shape), hf[theirs]), ours
    assert not [n for n in tensors if n.startswith("v.deepstack.0.")]
    assert not [n for n in tensors if not n.startswith(("v.", "mm."))]


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_text_gguf_and_its_qwen3_vl_tower_mmproj(kind, tmp_path):
    """Qwen3.5's image side is Qwen3-VL's tower without deepstack: llama.cpp's qwen3vl_merger
    (its converter writes both so), beside the qwen35 / qwen35moe text model."""
    folder = vlm_folder(tmp_path / "q", kind)
    out = tmp_path / "q.f32.gguf"
    assert main(["export", str(folder), "--gguf", "f32", "--out", str(out)]) == 0
    arch = {"qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe"}[kind]
    text = fields(gguf.GGUFReader(out))
    assert text["general.architecture"] == arch
    reader = gguf.GGUFReader(tmp_path / "mmproj-q.f32.gguf")
    meta = fields(reader)
    assert meta["clip.projector_type"] == "qwen3vl_merger"
    assert meta["clip.vision.is_deepstack_layers"] == [False, False]
    tensors = {t.name: torch.from_numpy(t.data.copy()) for t in reader.tensors}
    hf = {k.removeprefix("model."): v for k, v in load_file(folder / "model.safetensors").items()}
    w = hf["visual.merger.linear_fc2.weight"]
    assert torch.equal(tensors["mm.2.weight"].reshape(w.shape), w)
    assert not [n for n in tensors if n.startswith("v.deepstack.")]
    assert not [n for n in tensors if not n.startswith(("v.", "mm."))]


def test_llama_cpp_interleaved_mrope_differs_only_where_the_check_says():
    """llama.cpp's interleaved M-RoPE axes (gguf_qwen_vl.py) against ours (= transformers'):
    the released sections move two slow frequencies (written), the tiny default a fast one
    (refused), [2, 1, 1] none."""
    from types import SimpleNamespace

    from slipstream.checkpoint.gguf_qwen_vl import FOURTH, _qwen3vl_check, llama_cpp_imrope_axes
    from slipstream.models.rope import RopeConfig, mrope_axes

    ours, theirs = mrope_axes([24, 20, 20], True, 64), llama_cpp_imrope_axes([24, 20, 20], 64)
    assert [j for j in range(64) if ours[j] != theirs[j]] == [61, 62]
    assert theirs[61] == theirs[62] == FOURTH and ours[61] == ours[62] == 0
    assert llama_cpp_imrope_axes([2, 1, 1], 4) == mrope_axes([2, 1, 1], True, 4) == [0, 1, 2, 0]

    def config(section, theta, head_dim):
        cfg = SimpleNamespace(rope=RopeConfig(theta=theta), head_dim=head_dim,
                              num_hidden_layers=28, model_type="qwen3_vl")  # fmt: skip
        hf = {"rope_parameters": {"mrope_section": section},
              "vision_config": {"deepstack_visual_indexes": [5, 11, 17]}}  # fmt: skip
        return cfg, hf

    _qwen3vl_check(*config([24, 20, 20], 5e6, 128))  # Qwen3-VL-2B..32B: 4e-7 rad: written
    with pytest.raises(ValueError, match=r"frequencies \[61, 62\] of 64"):
        _qwen3vl_check(*config([24, 20, 20], 1e4, 128))  # a base of 1e4: 1.4e-4 rad
    with pytest.raises(ValueError, match=r"frequencies \[3\] of 4"):
        _qwen3vl_check(*config([1, 1, 2], 1e4, 8))


def _qwen3_vl_sections_112(folder):
    qwen3_vl_as_llama_cpp(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["text_config"]["rope_parameters"]["mrope_section"] = [1, 1, 2]  # the tiny default
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "edit, says",
    [  # the tiny default: 2 decoder layers, deepstack on both
        (lambda folder: None, "2 deepstack features and 2 decoder layers"),
        # frequency 3 of 4 is w's 2nd turn in transformers, llama.cpp's 4th (0) position
        (_qwen3_vl_sections_112, "mrope_section [1, 1, 2]: llama.cpp's interleaved M-RoPE "
         "turns rotary frequencies [3] of 4"),
        (lambda folder: (qwen3_vl_as_llama_cpp(folder), _edit_config(
            folder, "vision_config", hidden_act="gelu")),
         "hidden_act gelu (llama.cpp: gelu_pytorch_tanh)"),
    ],
    ids=["deepstack-on-the-last-layer", "sections", "tower-activation"],
)  # fmt: skip
def test_a_qwen3_vl_llama_cpp_would_run_differently_is_one_line(edit, says, tmp_path, capsys):
    folder = vlm_folder(tmp_path / "q", "qwen3_vl")
    edit(folder)
    capsys.readouterr()
    assert main(["export", str(folder), "--gguf", "f16"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err, err
    # refused before anything is written (the text checks need the built model's config: the
    # output folder is made by then, empty)
    assert not list(folder.glob("gguf/*"))


def test_mistral3_text_gguf_and_pixtral_mmproj(tmp_path):
    folder = mistral3_as_llama_cpp(vlm_folder(tmp_path / "m", "mistral3"))
    randomise_constant_tensors(folder)
    out = tmp_path / "m.f32.gguf"
    assert main(["export", str(folder), "--gguf", "f32", "--out", str(out)]) == 0
    reader = gguf.GGUFReader(out)
    text = fields(reader)
    assert text["general.architecture"] == "mistral3"  # as llama.cpp's converter writes it
    assert text["tokenizer.ggml.pre"] == "tekken"
    assert text["mistral3.rope.dimension_count"] == text["mistral3.attention.key_length"] == 8
    saved = load_file(folder / "model.safetensors")  # the hub's layout or transformers 5's

    def hf(name):  # the one saved tensor whose name ends so
        (key,) = [k for k in saved if k.endswith(name)]
        return saved[key]

    lm = {t.name: torch.from_numpy(t.data.copy()) for t in reader.tensors}
    assert not [n for n in lm if n.startswith(("v.", "mm."))]
    q = hf("layers.1.self_attn.q_proj.weight")  # 4 heads, rows permuted
    assert torch.equal(lm["blk.1.attn_q.weight"].reshape(q.shape), permute_rotary(q, 4))
    mm = gguf.GGUFReader(tmp_path / "mmproj-m.f32.gguf")
    meta = fields(mm)
    assert meta["clip.projector_type"] == "pixtral" and meta["clip.use_silu"] is True
    assert "clip.use_gelu" not in meta
    assert meta["clip.vision.spatial_merge_size"] == 2
    assert meta["clip.vision.attention.layer_norm_epsilon"] == pytest.approx(1e-5)
    assert (meta["clip.vision.image_size"], meta["clip.vision.patch_size"]) == (56, 7)
    assert meta["clip.vision.block_count"] == 2 and meta["clip.vision.attention.head_count"] == 2
    assert meta["clip.vision.projection_dim"] == 32
    tensors = {t.name: torch.from_numpy(t.data.copy()) for t in mm.tensors}
    layer = {f"v.blk.{i}.{p}.weight" for i in range(2) for p in
             ("attn_q", "attn_k", "attn_v", "attn_out", "ln1", "ln2", "ffn_gate", "ffn_up",
              "ffn_down")}  # fmt: skip
    assert set(tensors) == layer | {
        "v.patch_embd.weight", "v.pre_ln.weight", "mm.input_norm.weight",
        "mm.patch_merger.weight", "mm.1.weight", "mm.2.weight", "v.token_embd.img_break",
    }  # fmt: skip
    tower = "vision_tower.transformer.layers.1"
    for part, permuted in (("q", True), ("k", True), ("v", False)):
        w = hf(f"{tower}.attention.{part}_proj.weight")
        want = permute_rotary(w, 2) if permuted else w  # 2-D RoPE's pairs, as the text model's
        assert torch.equal(tensors[f"v.blk.1.attn_{part}.weight"].reshape(w.shape), want)
    merger = hf("patch_merger.merging_layer.weight")  # (16, 16 * 4)
    assert torch.equal(tensors["mm.patch_merger.weight"].reshape(merger.shape), merger)
    conv = hf("vision_tower.patch_conv.weight")
    assert torch.equal(tensors["v.patch_embd.weight"].reshape(conv.shape), conv)
    tok = json.loads((folder / "tokenizer.json").read_text())
    brk = next(a["id"] for a in tok["added_tokens"] if a["content"] == "[IMG_BREAK]")
    embed = hf("embed_tokens.weight")
    assert torch.equal(tensors["v.token_embd.img_break"], embed[brk])


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        ({}, "the projector norm's eps 1e-06 (text rms_norm_eps; llama.cpp: 1e-05)"),
        ({"vision_feature_layer": -2}, "vision_feature_layer -2 (llama.cpp: the last layer, -1)"),
        ({"projector_hidden_act": "silu"}, "projector_hidden_act silu (llama.cpp: gelu)"),
        ({"vision_config": {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}},
         "the tower's RoPE base 1e+06 (llama.cpp: 10000)"),
        ({"text_config": {"sliding_window": 16}},
         "sliding_window 16 < max_position_embeddings 512"),
        ({"text_config": {"model_type": "llama"}},
         "mistral3 with a 'llama' language model: only a Mistral or Ministral 3 one"),
        ({"text_config": {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}},
         "mistral3 with linear RoPE scaling"),  # config.json's RoPE, not the generic default
    ],
)  # fmt: skip
def test_a_mistral3_llama_cpp_would_run_differently_is_one_line(edit, said, tmp_path, capsys):
    folder = vlm_folder(tmp_path / "m", "mistral3")
    if edit:  # else vlm_folder's own: MistralConfig's rms_norm_eps 1e-6 for the projector norm
        mistral3_as_llama_cpp(folder)
        cfg = json.loads((folder / "config.json").read_text())
        for key, value in edit.items():
            cfg[key] = {**cfg[key], **value} if isinstance(value, dict) else value
        (folder / "config.json").write_text(json.dumps(cfg))
    capsys.readouterr()
    assert main(["export", str(folder), "--gguf", "f16"]) == 2
    # the text model's refusal comes after loading it (transformers' progress bars first)
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("slipstream")]
    assert len(err) == 1 and said in err[0]
    assert not list(folder.glob("gguf/*"))  # nothing written


def test_ministral3_text_gguf_has_yarn_and_the_attention_temperature(tmp_path):
    """Ministral 3's language model: YaRN's keys, mscale_all_dim and the temperature beta
    under the keys llama.cpp's mistral3 reads (its converter's), the mmproj as Mistral 3's."""
    folder = mistral3_as_llama_cpp(ministral3_text(vlm_folder(tmp_path / "m", "mistral3")))
    out = tmp_path / "m.f32.gguf"
    assert main(["export", str(folder), "--gguf", "f32", "--out", str(out)]) == 0
    text = fields(gguf.GGUFReader(out))
    assert text["general.architecture"] == "mistral3"
    assert text["mistral3.rope.freq_base"] == 100.0  # config.json's rope_theta
    assert text["mistral3.rope.scaling.type"] == "yarn"
    assert text["mistral3.rope.scaling.factor"] == 4.0
    assert text["mistral3.rope.scaling.original_context_length"] == 16  # the temperature's too
    assert text["mistral3.rope.scaling.yarn_beta_fast"] == 16.0
    assert text["mistral3.rope.scaling.yarn_beta_slow"] == 0.25
    assert text["mistral3.rope.scaling.yarn_log_multiplier"] == 1.0  # mscale_all_dim
    assert text["mistral3.attention.temperature_scale"] == pytest.approx(0.3)
    assert "mistral3.rope.scaling.yarn_attn_factor" not in text  # llama.cpp computes it
    assert fields(gguf.GGUFReader(tmp_path / "mmproj-m.f32.gguf"))["clip.projector_type"] == (
        "pixtral"
    )


@pytest.mark.parametrize(
    ("rope", "said"),
    [
        ({"rope_type": "default"}, "default RoPE (llama.cpp's converter: yarn only)"),
        ({"llama_4_scaling_beta": None}, "no llama_4_scaling_beta"),
        ({"attention_factor": 1.2}, "attention_factor 1.2 (llama.cpp's mistral3 computes it"),
        ({"mscale": 0.5}, "mscale 0.5 (llama.cpp's mistral3 takes 1)"),
        ({"truncate": False}, "truncate=false"),
    ],
)  # fmt: skip
def test_a_ministral3_llama_cpp_would_run_differently_is_one_line(rope, said, tmp_path, capsys):
    folder = vlm_folder(tmp_path / "m", "mistral3")
    folder = mistral3_as_llama_cpp(ministral3_text(folder, **rope))
    capsys.readouterr()
    assert main(["export", str(folder), "--gguf", "f16"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("slipstream")]
    assert len(err) == 1 and "mistral3 with a ministral3 language model with " + said in err[0]
    assert not list(folder.glob("gguf/*"))  # nothing written


@pytest.mark.parametrize("kind", ["llava"])
def test_unsupported_image_text_type_is_one_line_and_writes_nothing(kind, tmp_path, capsys):
    folder = vlm_folder(tmp_path / kind, kind)
    capsys.readouterr()  # what building the checkpoint printed
    assert main(["export", str(folder), "--gguf", "f16"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"no GGUF mmproj for model_type {kind!r}" in err
    supported = (
        "gemma3, idefics3, smolvlm, qwen2_5_vl, qwen3_vl, qwen3_5, qwen3_5_moe, mistral3, gemma4"
    )
    assert f"supported: {supported}." in err
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
