"""GGUF `mmproj` export: the vision tower and projector of an image-text checkpoint in the
file llama.cpp's multimodal library (mtmd, `llama-mtmd-cli --mmproj`) reads beside the text
model's GGUF.

The tensors are read from the saved checkpoint (safetensors, transformers' names), not from
a live model: what the vision side is in memory is the modeling code's business, what it is
on disk is transformers' layout. An mmproj file is `general.architecture = "clip"` with the
`clip.*` keys and `v.*` / `mm.*` tensor names of the `gguf` package's tables
(`GGUFWriter.add_vision_*`, `gguf.TENSOR_NAMES`), as llama.cpp's clip.cpp loads them.

Types: `f32` when the text GGUF is f32 (exact), else `f16` (llama.cpp's own default for
mmproj files; a K-quant vision tower is not what its converter writes): 1-D tensors and the
patch and position embeddings stay f32, as its converter keeps them.

Supported: `gemma3` (SigLIP tower, average-pooled to `mm_tokens_per_image`, Gemma's RMSNorm
+ linear projector), `idefics3` and `smolvlm` (SigLIP tower, pixel shuffle by `scale_factor`,
one linear connector; llama.cpp tiles the image at the processor's longest edge as
transformers does), `qwen2_5_vl` (its windowed ViT and 2 x 2 merger) and `qwen3_vl` (its ViT,
2 x 2 merger and deepstack mergers; also `qwen3_5` and `qwen3_5_moe`, the same tower without
deepstack): gguf_mmproj_qwen.py; their text models: gguf_qwen_vl.py, gguf_qwen35.py;
`mistral3` (Pixtral tower, patch merger, GELU projector and the `[IMG_BREAK]` embedding as
llama.cpp's `pixtral`: gguf_mmproj_pixtral.py);
`gemma4` (llama.cpp's gemma4v: gguf_mmproj_gemma4.py).
Every other image-text type is refused in one line naming it. What a spec is and the names
shared by several towers: gguf_mmproj_spec.py.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slipstream.checkpoint.atomic import atomic_write
from slipstream.checkpoint.gguf_mmproj_gemma4 import GEMMA4V
from slipstream.checkpoint.gguf_mmproj_pixtral import PIXTRAL
from slipstream.checkpoint.gguf_mmproj_qwen import QWEN3VL, QWEN25VL
from slipstream.checkpoint.gguf_mmproj_spec import MmprojSpec, encoder_name

# An image-text checkpoint is one whose config.json has a vision_config; these are the types
# slipstream trains (docs/vision.md) and why each has no mmproj here yet.
_NO_TEXT = "its text model ({}) has no GGUF export here yet"
NOT_WRITTEN = {
    # Written and run once (branch gobj-llava): 0.3.36's llava graph puts the class token after
    # the patches while its inputs assume it first; embeddings rel 1.17 vs transformers.
    "llava": "llama.cpp's CLIP graph (llama-cpp-python 0.3.36) appends the class token after "
    "the patches and then reads rows 1..n as patches, so it computes another model "
    "(ggml-org/llama.cpp#25814, fixed by PR #25844, open)",
    "qwen2_vl": _NO_TEXT.format("llama.cpp's qwen2vl: M-RoPE sections"),
}
_VISION_MODULE = re.compile(
    r"(^|\.)(vision_tower|vision_model|multi_modal_projector|connector|visual)\."
)


def is_image_text(hf: dict) -> bool:
    """A checkpoint's config.json describes an image-text model (it has a vision tower)."""
    return isinstance(hf.get("vision_config"), dict)


def mmproj_refusal(hf: dict) -> str | None:
    """One line saying why no mmproj is written for this image-text config; None: supported."""
    kind = hf.get("model_type", "")
    if kind in SPECS:
        why = SPECS[kind].check(hf)
        return None if why is None else f"no GGUF mmproj for this {kind}: {why}."
    why = NOT_WRITTEN.get(kind, "slipstream does not know its vision tower's llama.cpp layout")
    return f"no GGUF mmproj for model_type {kind!r}: {why}; supported: {', '.join(SPECS)}."


def adapter_trains_vision(adapter: str | os.PathLike) -> bool:
    """A peft adapter folder whose tensors (LoRA or modules_to_save) touch the vision tower or
    projector: transformers' module names for them in the types slipstream trains."""
    from safetensors import safe_open

    file = Path(adapter) / "adapter_model.safetensors"
    if not file.is_file():
        return False
    with safe_open(str(file), framework="pt", device="cpu") as f:
        return any(_VISION_MODULE.search(key) for key in f.keys())  # noqa: SIM118


def mmproj_type(type: str) -> str:
    """The mmproj's file type for a text GGUF type (module docstring)."""
    return "f32" if type.lower() == "f32" else "f16"


def export_mmproj(
    folder: str | os.PathLike, path: str | os.PathLike, type: str = "f16",
    processor_folders: tuple[str | os.PathLike, ...] = (),
) -> Path:  # fmt: skip
    """Write the mmproj of the image-text checkpoint in `folder` (config.json, safetensors) to
    `path`, in `mmproj_type(type)`. The image processor's mean and std come from the first of
    `processor_folders` + (folder,) that has its config. Returns the path written."""
    folder = Path(folder)
    hf = _full_config(folder)
    refusal = mmproj_refusal(hf)
    if refusal is not None:
        raise ValueError(refusal)
    processor = image_processor_config((*map(Path, processor_folders), folder))
    path = Path(path)
    atomic_write(path, lambda tmp: _write(folder, hf, processor, tmp, mmproj_type(type)))
    return path


def _full_config(folder: Path) -> dict:
    """config.json with transformers' defaults filled in (vision_config and text_config
    whole: a saved config leaves out what equals the default)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(folder)).to_dict()


def image_processor_config(folders: tuple[Path, ...]) -> dict:
    """The image processor's settings (preprocessor_config.json, or processor_config.json's
    `image_processor` with the processor's own keys beside it), or a one-line error."""
    for folder in folders:
        pre = folder / "preprocessor_config.json"
        if pre.is_file():
            return json.loads(pre.read_text())
        proc = folder / "processor_config.json"
        if proc.is_file():
            data = json.loads(proc.read_text())
            if isinstance(data.get("image_processor"), dict):
                return {**data, **data["image_processor"]}
    shown = ", ".join(str(f) for f in folders)
    raise ValueError(
        f"GGUF mmproj: no image processor config (preprocessor_config.json or "
        f"processor_config.json) in {shown}; the mmproj needs its image_mean and image_std."
    )


def vision_tensors(folder: Path, spec: MmprojSpec, hf: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """(llama.cpp name, tensor) for the checkpoint's vision side, one tensor at a time."""
    from safetensors import safe_open

    from slipstream.checkpoint.hf import _safetensors_files

    for file in _safetensors_files(folder):
        with safe_open(str(folder / file), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                name = key.removeprefix("model.")
                if name.startswith(("language_model.", "text_model.", "lm_head.")):
                    continue
                out = spec.rename(name, f.get_tensor(key), hf)
                if isinstance(out, list):
                    yield from out
                elif out is not None:
                    yield out
    yield from spec.extra_tensors(folder)


def tensor_dtype(name: str, shape: tuple[int, ...], type: str) -> Any:
    """float32 for 1-D tensors and the embeddings (and everything in an f32 file), else
    float16: the numpy dtype the tensor is stored in (the gguf package names its GGML type)."""
    if type == "f32" or len(shape) == 1 or name.startswith(("v.patch_embd", "v.position_embd")):
        return np.dtype(np.float32)
    return np.dtype(np.float16)


def _write(folder: Path, hf: dict, processor: dict, out: str, type: str) -> None:
    import gguf

    spec = SPECS[hf["model_type"]]
    file_type = gguf.LlamaFileType.ALL_F32 if type == "f32" else gguf.LlamaFileType.MOSTLY_F16
    w = gguf.GGUFWriter(out, "clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_name(folder.resolve().name)
    w.add_file_type(int(file_type))
    write_vision_metadata(w, {**hf, "vision_config": spec.vision(hf)}, processor)
    w.add_clip_projector_type(spec.projector)
    spec.write_metadata(w, hf, processor)
    for name, t in vision_tensors(folder, spec, hf):  # the table first (llama.cpp reads it first)
        shape = tuple(t.shape)
        dtype = tensor_dtype(name, shape, type)
        w.add_tensor_info(name, shape, dtype, int(np.prod(shape)) * dtype.itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, t in vision_tensors(folder, spec, hf):
        x = t.to(torch.float32).contiguous().numpy()
        w.write_tensor_data(x.astype(tensor_dtype(name, x.shape, type), copy=False))
    w.close()


def write_vision_metadata(w: Any, hf: dict, processor: dict) -> None:
    """The keys every vision tower has: sizes from vision_config, the text model's width as
    the projection's, the image processor's normalisation."""
    v = hf["vision_config"]
    w.add_clip_has_vision_encoder(True)
    w.add_vision_projection_dim(int(hf["text_config"]["hidden_size"]))
    w.add_vision_image_size(int(v["image_size"]))
    w.add_vision_patch_size(int(v["patch_size"]))
    w.add_vision_embedding_length(int(v["hidden_size"]))
    w.add_vision_feed_forward_length(int(v["intermediate_size"]))
    w.add_vision_block_count(int(v["num_hidden_layers"]))
    w.add_vision_head_count(int(v["num_attention_heads"]))
    w.add_vision_attention_layernorm_eps(float(v["layer_norm_eps"]))
    for key in ("image_mean", "image_std"):
        if len(processor.get(key) or ()) != 3:
            raise ValueError(f"GGUF mmproj: the image processor's {key} is not 3 numbers.")
    w.add_vision_image_mean([float(x) for x in processor["image_mean"]])
    w.add_vision_image_std([float(x) for x in processor["image_std"]])


# --- Gemma 3: SigLIP, then average pooling to mm_tokens_per_image, RMSNorm, a linear map ---


def _gemma3_metadata(w: Any, hf: dict, processor: dict) -> None:
    v = hf["vision_config"]
    if v.get("hidden_act") != "gelu_pytorch_tanh":
        raise ValueError(
            f"GGUF mmproj: Gemma 3's vision hidden_act {v.get('hidden_act')!r} is not "
            "llama.cpp's (gelu_pytorch_tanh)."
        )
    side = int(v["image_size"]) // int(v["patch_size"])  # patches per side
    tokens = int(hf.get("mm_tokens_per_image", 256))
    per_side = math.isqrt(tokens)
    if per_side * per_side != tokens or side % per_side:
        raise ValueError(
            f"GGUF mmproj: Gemma 3's mm_tokens_per_image {tokens} is not a square that divides "
            f"the {side}x{side} patch grid (llama.cpp pools by a whole kernel)."
        )
    w.add_vision_use_gelu(True)
    if side // per_side != 4:  # llama.cpp's default kernel (every Gemma 3 size): written if not
        w.add_vision_projector_scale_factor(side // per_side)


def _gemma3_rename(name: str, t: torch.Tensor, hf: dict) -> tuple[str, torch.Tensor] | None:
    import gguf

    T = gguf.MODEL_TENSOR
    if name == "multi_modal_projector.mm_input_projection_weight":  # (vision, text): kept so
        return gguf.TENSOR_NAMES[T.V_MM_INP_PROJ] + ".weight", t  # llama.cpp transposes it
    if name == "multi_modal_projector.mm_soft_emb_norm.weight":  # Gemma's RMSNorm scales 1 + w
        return gguf.TENSOR_NAMES[T.V_MM_SOFT_EMB_NORM] + ".weight", t.float() + 1
    tower = name.removeprefix("vision_tower.").removeprefix("vision_model.")
    if tower == name or tower.startswith("head."):  # SigLIP's pooling head: Gemma 3 skips it
        return None
    out = encoder_name(tower)
    if out is None:
        raise ValueError(f"GGUF mmproj: no llama.cpp name for Gemma 3 tensor {name!r}.")
    return out, t


# --- Idefics3 / SmolVLM: SigLIP, pixel shuffle by scale_factor, one linear map (no bias) ---


def _idefics3_metadata(w: Any, hf: dict, processor: dict) -> None:
    v = hf["vision_config"]
    if v.get("hidden_act") != "gelu_pytorch_tanh":
        raise ValueError(
            f"GGUF mmproj: {hf['model_type']}'s vision hidden_act {v.get('hidden_act')!r} is "
            "not llama.cpp's (gelu_pytorch_tanh)."
        )
    w.add_vision_use_gelu(True)
    w.add_vision_projector_scale_factor(int(hf.get("scale_factor", 2)))
    # The image processor's longest edge: llama.cpp resizes to it, then cuts image_size tiles
    # plus an overview, as transformers' processor does.
    edge = (processor.get("size") or {}).get("longest_edge", int(v["image_size"]))
    w.add_vision_preproc_image_size(int(edge))


def _idefics3_rename(name: str, t: torch.Tensor, hf: dict) -> tuple[str, torch.Tensor] | None:
    import gguf

    if name == "connector.modality_projection.proj.weight":
        return gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.V_MMPROJ_FC] + ".weight", t
    tower = name.removeprefix("vision_model.")
    if tower == name:
        return None
    out = encoder_name(tower)
    if out is None:
        raise ValueError(f"GGUF mmproj: no llama.cpp name for Idefics3 tensor {name!r}.")
    return out, t


IDEFICS3 = MmprojSpec("idefics3", _idefics3_metadata, _idefics3_rename)


SPECS = {
    "gemma3": MmprojSpec("gemma3", _gemma3_metadata, _gemma3_rename),
    "idefics3": IDEFICS3,
    "smolvlm": IDEFICS3,
    "qwen2_5_vl": QWEN25VL,
    "qwen3_vl": QWEN3VL,
    "qwen3_5": QWEN3VL,  # the Qwen3-VL tower, no deepstack (llama.cpp's converter: the same)
    "qwen3_5_moe": QWEN3VL,
    "mistral3": PIXTRAL,
    "gemma4": GEMMA4V,
}
