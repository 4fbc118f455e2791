"""What an mmproj writer knows of one image-text type (MmprojSpec), and the tensor names
shared by several: SigLIP/CLIP encoder layers under transformers' names, and the `gguf`
package's own table of mmproj names (`gguf.get_tensor_name_map(MMPROJ)`), as llama.cpp's
converter maps them."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

# A SigLIP/CLIP encoder layer under transformers' names -> the gguf package's tensor.
_ENCODER_LAYER = {
    "self_attn.q_proj": "V_ENC_ATTN_Q",
    "self_attn.k_proj": "V_ENC_ATTN_K",
    "self_attn.v_proj": "V_ENC_ATTN_V",
    "self_attn.out_proj": "V_ENC_ATTN_O",
    "layer_norm1": "V_ENC_INPUT_NORM",
    "layer_norm2": "V_ENC_POST_ATTN_NORM",
    "mlp.fc1": "V_ENC_FFN_UP",
    "mlp.fc2": "V_ENC_FFN_DOWN",
}
_LAYER = re.compile(r"encoder\.layers\.(\d+)\.(.+)\.(weight|bias)$")


@dataclass(frozen=True)
class MmprojSpec:
    """What one image-text type needs: its checks and metadata (`write_metadata(w, hf,
    processor)`, raising ValueError for what llama.cpp cannot run) and the renaming of its
    vision-side tensors (`rename(name, tensor, hf)` -> (llama.cpp name, tensor) or None:
    skip; `hf` the full config.json)."""

    projector: str
    write_metadata: Callable[[Any, dict, dict], None]
    # -> (name, tensor), [(name, tensor), ...] for a tensor llama.cpp splits, or None
    rename: Callable[[str, torch.Tensor, dict], Any]
    # vision_config under the keys write_vision_metadata reads (SigLIP's: as it is)
    vision: Callable[[dict], dict] = lambda hf: hf["vision_config"]
    # why llama.cpp would run this config's tower differently (a line), or None
    check: Callable[[dict], str | None] = lambda hf: None
    # folder -> (name, tensor)s from outside the vision side (pixtral: the [IMG_BREAK] row)
    extra_tensors: Callable[[Any], Iterator[tuple[str, torch.Tensor]]] = lambda folder: iter(())


def encoder_name(name: str) -> str | None:
    """llama.cpp's name for a SigLIP/CLIP tower tensor (names after the tower's prefix)."""
    import gguf

    T = gguf.MODEL_TENSOR
    m = _LAYER.match(name)
    if m is not None:
        layer, part, kind = m.groups()
        member = _ENCODER_LAYER.get(part)
        if member is None:
            return None
        return f"{gguf.TENSOR_NAMES[T[member]].format(bid=int(layer))}.{kind}"
    fixed = {
        "embeddings.patch_embedding.weight": f"{gguf.TENSOR_NAMES[T.V_ENC_EMBD_PATCH]}.weight",
        "embeddings.patch_embedding.bias": f"{gguf.TENSOR_NAMES[T.V_ENC_EMBD_PATCH]}.bias",
        "embeddings.position_embedding.weight": f"{gguf.TENSOR_NAMES[T.V_ENC_EMBD_POS]}.weight",
        "post_layernorm.weight": f"{gguf.TENSOR_NAMES[T.V_POST_NORM]}.weight",
        "post_layernorm.bias": f"{gguf.TENSOR_NAMES[T.V_POST_NORM]}.bias",
    }
    return fixed.get(name)


def fixed_differences(v: dict, fixed: dict) -> list[str]:
    """What `v` (a vision_config) sets otherwise than the values llama.cpp's graph fixes."""
    return [
        f"{k} {v[k]} (llama.cpp: {want})" for k, want in fixed.items() if v.get(k, want) != want
    ]


def graph_refusal(graph: str, what: str, differ: list[str]) -> str | None:
    """The one line for a config llama.cpp's `graph` would run differently (None: nothing
    differs); `what`: the part of the model the differences belong to."""
    if not differ:
        return None
    return f"llama.cpp's {graph} graph fixes what this {what} sets otherwise: " + "; ".join(differ)


@functools.cache
def mmproj_names() -> Any:
    """The gguf package's mmproj name table, built once (0.6 s a build: it expands every
    block of every tensor it knows; built per tensor, a tiny tower's export took 34 s)."""
    import gguf

    return gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, 256)


def mapped_name(name: str, t: torch.Tensor, what: str) -> tuple[str, torch.Tensor]:
    """(llama.cpp's name, tensor) for a tensor the gguf package's mmproj table maps, or a
    one-line error naming it (`what`: the model, for the message)."""
    out = mmproj_names().get_name(name, try_suffixes=(".weight", ".bias"))
    if out is None:
        raise ValueError(f"GGUF mmproj: no llama.cpp name for {what} tensor {name!r}.")
    return out, t.contiguous()
