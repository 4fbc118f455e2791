"""mmproj writer for Mistral 3's vision side (llama.cpp's `pixtral` projector).

Transformers' Mistral3ForConditionalGeneration: the Pixtral tower (conv patch embedding, RMSNorm
`ln_pre`, blocks of RMSNorm + attention with 2-D axial RoPE + RMSNorm + gated MLP, no final
norm), then the projector: RMSNorm, the patch merger (each `spatial_merge_size`^2 block of
patches unfolded and mapped back to the tower's width by `merging_layer`), `linear_1`, GELU,
`linear_2`. Each row of merged patches is followed by the text model's `[IMG_BREAK]`
embedding, which llama.cpp inserts itself from `v.token_embd.img_break` (so the mmproj holds
that one row of the language model's embedding, as llama.cpp's converter writes it); the
last row's `[IMG_END]` is a text token mtmd adds after the image.

Layout changes: the tower's Q and K rows are permuted per head (llama.cpp's 2-D RoPE rotates
interleaved pairs, transformers halves: the same permutation as the text model's). What
llama.cpp's pixtral graph fixes (clip.cpp, llama-cpp-python 0.3.36) and a config that sets it
otherwise is refused: the tower's RoPE base 10000, RMSNorm eps 1e-5 everywhere (transformers
hard-codes it in the tower; the projector's norm takes the text model's rms_norm_eps), the
last layer's features, a GELU projector, head_dim = hidden_size / heads. llama.cpp's GELU is
the tanh form, transformers' `gelu` the erf one (they differ by < 5e-4 an activation).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from slipstream.checkpoint.gguf_mmproj_spec import MmprojSpec, graph_refusal, mapped_name
from slipstream.checkpoint.gguf_spec import permute_rotary

PIXTRAL_EPS = 1e-5  # transformers' PixtralRMSNorm in the tower, and llama.cpp's one eps
_GELU = ("gelu", "gelu_pytorch_tanh")  # llama.cpp's GELU: the tanh form (module docstring)
IMG_BREAK = "[IMG_BREAK]"


def _pixtral_vision(hf: dict) -> dict:
    return {**hf["vision_config"], "layer_norm_eps": PIXTRAL_EPS}


def _rope_theta(v: dict) -> float:
    rope = v.get("rope_parameters") or {}
    return float(rope.get("rope_theta", v.get("rope_theta", 10000.0)))


def _pixtral_check(hf: dict) -> str | None:
    v, text = hf.get("vision_config") or {}, hf.get("text_config") or {}
    differ = []
    act = v.get("hidden_act", "gelu")
    if act not in ("silu", *_GELU):
        differ.append(f"the tower's hidden_act {act} (llama.cpp: silu or gelu)")
    if _rope_theta(v) != 10000.0:
        differ.append(f"the tower's RoPE base {_rope_theta(v):g} (llama.cpp: 10000)")
    heads, width = int(v.get("num_attention_heads", 1)), int(v.get("hidden_size", 0))
    if int(v.get("head_dim") or width // heads) * heads != width:
        differ.append(f"head_dim {v['head_dim']} x {heads} heads != hidden_size {width}")
    layer = hf.get("vision_feature_layer", -1)
    if layer not in (-1, [-1]):
        differ.append(f"vision_feature_layer {layer} (llama.cpp: the last layer, -1)")
    if hf.get("projector_hidden_act", "gelu") not in _GELU:
        differ.append(f"projector_hidden_act {hf['projector_hidden_act']} (llama.cpp: gelu)")
    eps = float(text.get("rms_norm_eps", PIXTRAL_EPS))
    if eps != PIXTRAL_EPS:
        differ.append(f"the projector norm's eps {eps:g} (text rms_norm_eps; llama.cpp: 1e-05)")
    return graph_refusal("pixtral", "model", differ)


def _pixtral_metadata(w: Any, hf: dict, processor: dict) -> None:
    if hf["vision_config"].get("hidden_act", "gelu") == "silu":
        w.add_vision_use_silu(True)
    else:
        w.add_vision_use_gelu(True)
    w.add_vision_spatial_merge_size(int(hf.get("spatial_merge_size", 2)))


def _pixtral_rename(name: str, t: torch.Tensor, hf: dict) -> tuple[str, torch.Tensor] | None:
    if not name.startswith(("vision_tower.", "multi_modal_projector.")):
        return None
    if name.endswith(("attention.q_proj.weight", "attention.k_proj.weight")):
        heads = int(hf["vision_config"]["num_attention_heads"])  # all K/V heads in the tower
        t = permute_rotary(t, heads)
    return mapped_name(name, t, "Mistral 3")


def image_break_id(folder: Path) -> int:
    """The `[IMG_BREAK]` token's id in the checkpoint's tokenizer files, or a one-line error."""
    tok = folder / "tokenizer.json"
    if tok.is_file():
        for added in json.loads(tok.read_text(encoding="utf-8")).get("added_tokens", []):
            if added.get("content") == IMG_BREAK:
                return int(added["id"])
    cfg = folder / "tokenizer_config.json"
    if cfg.is_file():
        decoder = json.loads(cfg.read_text(encoding="utf-8")).get("added_tokens_decoder") or {}
        for i, added in decoder.items():
            if added.get("content") == IMG_BREAK:
                return int(i)
    raise ValueError(
        f"GGUF mmproj: no {IMG_BREAK} token in the tokenizer in {folder} (tokenizer.json or "
        "tokenizer_config.json); Mistral 3's mmproj holds its embedding."
    )


def _img_break_tensor(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """`v.token_embd.img_break`: the language model's embedding row of `[IMG_BREAK]`, read
    alone from the checkpoint (transformers 5's name or the hub's older one)."""
    import gguf
    from safetensors import safe_open

    from slipstream.checkpoint.hf import _safetensors_files

    row = image_break_id(folder)
    for file in _safetensors_files(folder):
        with safe_open(str(folder / file), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if "language_model." in key and key.endswith("embed_tokens.weight"):
                    name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.V_TOK_EMBD_IMG_BREAK]
                    yield name, f.get_slice(key)[row : row + 1][0].clone()
                    return
    raise ValueError(f"GGUF mmproj: no language model embed_tokens.weight in {folder}.")


PIXTRAL = MmprojSpec(
    "pixtral", _pixtral_metadata, _pixtral_rename, _pixtral_vision, check=_pixtral_check,
    extra_tensors=_img_break_tensor,
)  # fmt: skip
