"""mmproj writers for the Qwen-VL towers: llama.cpp's `qwen2.5vl_merger` (Qwen2.5-VL) and
`qwen3vl_merger` (Qwen3-VL)."""

from __future__ import annotations

import math
from typing import Any

import torch

from slipstream.checkpoint.gguf_mmproj_spec import (
    MmprojSpec,
    fixed_differences,
    graph_refusal,
    mapped_name,
)

# --- Qwen2.5-VL: its windowed ViT (RMSNorm, SwiGLU, 2-D RoPE), the 2 x 2 patch merger ---
# What llama.cpp's qwen2.5vl graph fixes (clip.cpp, llama-cpp-python 0.3.36): a merge of 2, an
# attention window of 112 px, temporal patches of 2, the tower's RoPE base 10000.
QWEN25VL_FIXED = {"spatial_merge_size": 2, "window_size": 112, "temporal_patch_size": 2}


def _qwen25vl_vision(hf: dict) -> dict:
    v = hf["vision_config"]
    return {**v, "image_size": v.get("image_size", 560), "num_hidden_layers": v["depth"],
            "num_attention_heads": v["num_heads"], "layer_norm_eps": 1e-6}  # fmt: skip


def _qwen25vl_check(hf: dict) -> str | None:
    v = hf.get("vision_config") or {}
    differ = fixed_differences(v, QWEN25VL_FIXED)
    theta = float((v.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    if theta != 10000.0:
        differ.append(f"the tower's RoPE base {theta:g} (llama.cpp: 10000)")
    if v.get("hidden_act", "silu") != "silu":
        differ.append(f"hidden_act {v['hidden_act']} (llama.cpp: silu)")
    full = list(v.get("fullatt_block_indexes") or [])
    pattern = full[0] + 1 if full else 0
    if not full or full != list(range(pattern - 1, int(v.get("depth", 0)), pattern)):
        differ.append(f"fullatt_block_indexes {full} (llama.cpp: every n-th block to the last)")
    return graph_refusal("qwen2.5vl", "tower", differ)


def _qwen25vl_metadata(w: Any, hf: dict, processor: dict) -> None:
    w.add_vision_use_silu(True)
    w.add_vision_n_wa_pattern(int(hf["vision_config"]["fullatt_block_indexes"][0]) + 1)
    w.add_vision_spatial_merge_size(2)


def _qwen25vl_rename(name: str, t: torch.Tensor, hf: dict) -> Any:
    import gguf

    if not name.startswith("visual."):
        return None
    if name == "visual.patch_embed.proj.weight":  # Conv3d (D, C, 2, p, p): a Conv2d per frame
        patch = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.V_ENC_EMBD_PATCH]
        return [(f"{patch}.weight", t[:, :, 0]), (f"{patch}.weight.1", t[:, :, 1])]
    if ".attn.qkv." in name:  # fused q, k, v rows: three tensors
        return [_qwen25vl_name(name.replace(".qkv.", f".{p}."), x)
                for p, x in zip("qkv", t.chunk(3, dim=0), strict=True)]  # fmt: skip
    return _qwen25vl_name(name, t)


def _qwen25vl_name(name: str, t: torch.Tensor) -> tuple[str, torch.Tensor]:
    return mapped_name(name, t, "Qwen2.5-VL")


QWEN25VL = MmprojSpec(
    "qwen2.5vl_merger", _qwen25vl_metadata, _qwen25vl_rename, _qwen25vl_vision,
    check=_qwen25vl_check,
)  # fmt: skip


# --- Qwen3-VL: a ViT with a learned position table resampled to each grid (LayerNorm, tanh
# GELU, 2-D RoPE, fused qkv), the 2 x 2 merger, and deepstack mergers on chosen blocks ---
# What llama.cpp's qwen3vl graph fixes (clip.cpp, models/qwen3vl.cpp, llama-cpp-python
# 0.3.36): a 2 x 2 merge (its reshapes), temporal patches of 2, the MLP's GELU (tanh), the
# position table bilinearly resampled with corners aligned (transformers' linspace: the same).
QWEN3VL_FIXED = {"spatial_merge_size": 2, "temporal_patch_size": 2,
                 "hidden_act": "gelu_pytorch_tanh"}  # fmt: skip


def _qwen3vl_vision(hf: dict) -> dict:
    v = hf["vision_config"]
    side = math.isqrt(int(v["num_position_embeddings"]))  # the table's grid side, in patches
    return {**v, "image_size": side * int(v["patch_size"]), "num_hidden_layers": v["depth"],
            "num_attention_heads": v["num_heads"], "layer_norm_eps": 1e-6}  # fmt: skip


def _qwen3vl_check(hf: dict) -> str | None:
    v = hf.get("vision_config") or {}
    differ = fixed_differences(v, QWEN3VL_FIXED)
    n = int(v.get("num_position_embeddings", 2304))
    if math.isqrt(n) ** 2 != n:
        differ.append(f"num_position_embeddings {n} (llama.cpp: a square grid)")
    deepstack = list(v.get("deepstack_visual_indexes") or [])
    depth = int(v.get("depth", 0))
    if deepstack != sorted(set(deepstack)) or any(not 0 <= i < depth for i in deepstack):
        differ.append(f"deepstack_visual_indexes {deepstack} (llama.cpp: distinct blocks in "
                      "order)")  # fmt: skip
    return graph_refusal("qwen3vl", "tower", differ)


def _qwen3vl_metadata(w: Any, hf: dict, processor: dict) -> None:
    v = hf["vision_config"]
    w.add_vision_use_gelu(True)
    w.add_vision_spatial_merge_size(2)
    deepstack = set(v.get("deepstack_visual_indexes") or [])
    w.add_vision_is_deepstack_layers([i in deepstack for i in range(int(v["depth"]))])


def _qwen3vl_rename(name: str, t: torch.Tensor, hf: dict) -> Any:
    import gguf

    T = gguf.MODEL_TENSOR
    if not name.startswith("visual."):
        return None
    if name == "visual.patch_embed.proj.weight":  # Conv3d (D, C, 2, p, p): a Conv2d per frame
        patch = gguf.TENSOR_NAMES[T.V_ENC_EMBD_PATCH]
        return [(f"{patch}.weight", t[:, :, 0]), (f"{patch}.weight.1", t[:, :, 1])]
    part, _, kind = name.rpartition(".")  # kind: weight | bias
    if part.startswith("visual.deepstack_merger_list."):  # named by the tower block it reads
        k, _, module = part.removeprefix("visual.deepstack_merger_list.").partition(".")
        block = hf["vision_config"]["deepstack_visual_indexes"][int(k)]
        member = {"norm": T.V_DS_NORM, "linear_fc1": T.V_DS_FC1, "linear_fc2": T.V_DS_FC2}
        return f"{gguf.TENSOR_NAMES[member[module]].format(bid=block)}.{kind}", t
    merger = {"visual.merger.norm": gguf.TENSOR_NAMES[T.V_POST_NORM],
              "visual.merger.linear_fc1": gguf.TENSOR_NAMES[T.V_MMPROJ].format(bid=0),
              "visual.merger.linear_fc2": gguf.TENSOR_NAMES[T.V_MMPROJ].format(bid=2)}  # fmt: skip
    if part in merger:
        return f"{merger[part]}.{kind}", t
    return mapped_name(name, t, "Qwen3-VL")


QWEN3VL = MmprojSpec(
    "qwen3vl_merger", _qwen3vl_metadata, _qwen3vl_rename, _qwen3vl_vision,
    check=_qwen3vl_check,
)  # fmt: skip
