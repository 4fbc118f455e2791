"""What the native Qwen-VL image-text families share (Qwen2.5-VL: models/qwen2_5_vl.py, ...):
the backbone that holds the vision tower beside the token embedding, the embedding stage, 3-D
mRoPE and deepstack, and the checkpoint layouts.

- Embedding stage (`embed`): the tower runs once over every image of the micro-batch and its
  features are written into the rows the collator found on the host (`images["image_rows"]`,
  data/vision.py) by `index_copy`: no `input_ids == image_token_id` on the device, no boolean
  mask, no host sync. A frozen tower (its parameters and the pixels need no grad) records no
  autograd state.
- Positions: with images, each layer's RoPE turns by the host-built 3-D positions
  (`images["mrope_position_ids"]`, (3, T): data/mrope.py) through the family's mRoPE sections
  (models/rope.py); without (text batches, decode steps) the 1-D ones, which equal (p, p, p).
- Deepstack (Qwen3-VL): the tower's intermediate features are added to the image rows after
  the first decoder layers, by `index_add` over the same rows.
- The tower is slipstream's (models/qwen_vit.py), called `tower(pixel_values, images) ->
  (feats_PD, [deepstack_PD])` over the collator's host-built metadata (data/qwen_vit_meta.py):
  the images packed by their own lengths, attention over `cu_seqlens`, no host sync; its
  parameters are named as transformers' `model.visual`.

Names: ours are transformers' module tree with `model.language_model.` read as `model.`
(`model.embed_tokens`, `model.layers.*`, `model.visual.*`, `lm_head`); checkpoints hold that
tree or the older layout transformers still writes for Qwen2.5-VL (`model.layers.*`,
`visual.*`); peft's adapter keys follow the module tree.

Shapes: T tokens (flat, packed), D hidden, P image feature rows.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from slipstream.models.common import (
    Backbone,
    CausalLM,
    ModelConfig,
    RMSNorm,
    image_row_features,
    split_outputs,
    write_image_features,
)
from slipstream.models.qwen_vit import QwenVisionTower
from slipstream.models.rope import mrope_axes, mrope_cos_sin
from slipstream.models.weights import WeightMap
from slipstream.ops.packing import SeqInfo

ROWS = "image_rows"  # data/vision.py: the packed rows the features fill, (P,) int64
MROPE_FIELD = "mrope_position_ids"  # data/vision.py: the batch's (3, T) positions
MODULE_TREE = (("model.visual.", "model.visual."), ("model.", "model.language_model."),
               ("lm_head.", "lm_head."))  # fmt: skip
OLD_LAYOUT = (("model.visual.", "visual."), ("model.", "model."), ("lm_head.", "lm_head."))


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of an image-text config.json (`text_config`, or the top
    level of configs written by transformers 4), its rope type 'mrope' read as the default
    (the sections are read apart: `mrope_section`)."""
    text = {**hf, **(hf.get("text_config") or {})}
    text.pop("text_config", None)
    text.pop("vision_config", None)
    for key in ("rope_parameters", "rope_scaling"):
        params = dict(text.get(key) or {})
        if params.get("rope_type", params.get("type")) == "mrope":
            params.pop("type", None)
            params["rope_type"] = "default"
        if params:
            text[key] = params
    text["tie_word_embeddings"] = hf.get("tie_word_embeddings", text.get("tie_word_embeddings"))
    return text


# transformers' mRoPE sections where config.json gives none (its rotary modules' defaults).
DEFAULT_SECTIONS = {
    "qwen2_5_vl": [16, 24, 24], "qwen3_vl": [24, 20, 20], "qwen3_5": [11, 11, 10],
    "qwen3_5_moe": [11, 11, 10],
}  # fmt: skip


def mrope_section(text: dict[str, Any], model_type: str) -> list[int]:
    """The t/h/w sections of config.json's text part (`rope_parameters` / `rope_scaling`)."""
    params = {**(text.get("rope_scaling") or {}), **(text.get("rope_parameters") or {})}
    return list(params.get("mrope_section") or DEFAULT_SECTIONS[model_type])


def image_text_config(hf: dict[str, Any], text_family: Any) -> ModelConfig:
    """The language model's config by `text_family`'s `config_from_hf` (models/qwen2.py,
    qwen3.py: windows checked) from config.json's text part; `hf` kept whole (export writes it
    back)."""
    if not isinstance(hf.get("vision_config"), dict):
        raise ValueError(
            f"config.json: model_type {hf.get('model_type')!r} needs a vision_config; re-save "
            "the checkpoint with transformers."
        )
    text = text_config(hf)
    cfg = text_family.config_from_hf({**text, "model_type": hf["model_type"]})
    return dataclasses.replace(cfg, hf=dict(hf))


def build_image_text(cfg: ModelConfig, text_family: Any, interleaved: bool) -> ImageTextLM:
    """`text_family`'s decoder layers (its `decoder_layers` and `layer_windows`, read from the
    text part of config.json), the tower, mRoPE (`interleaved` or in blocks)."""
    text = text_config(cfg.hf)
    windows = text_family.layer_windows(dataclasses.replace(cfg, hf=text))
    layers = text_family.decoder_layers(cfg, windows)
    section = mrope_section(text, cfg.model_type)
    backbone = ImageTextBackbone(cfg, layers, vision_tower(cfg.hf), section, interleaved)
    return ImageTextLM(cfg, backbone)


def vision_tower(hf: dict[str, Any]) -> QwenVisionTower:
    """slipstream's packed tower (models/qwen_vit.py) of config.json `hf` (an image-text
    model's), parameters named as transformers' `model.visual`."""
    return QwenVisionTower.from_config(hf["vision_config"], hf["model_type"])


class ImageTextBackbone(Backbone):
    """`Backbone` plus the vision tower (`visual`), the embedding stage that writes its
    features into their rows, mRoPE by `section` (`interleaved` or in blocks) and deepstack."""

    def __init__(
        self,
        cfg: ModelConfig,
        layers: list[nn.Module],
        visual: nn.Module,
        section: list[int],
        interleaved: bool,
        norm: Any = RMSNorm,
    ) -> None:
        super().__init__(cfg, layers, norm)
        self.visual = visual
        self._axes = mrope_axes(section, interleaved, self.inv_freq.shape[0])
        self.register_buffer("mrope_axes", torch.tensor(self._axes), persistent=False)

    def reset_rope(self) -> None:
        super().reset_rope()
        self.mrope_axes.copy_(torch.tensor(self._axes))
        self.visual.reset_buffers()

    def embed(self, input_ids_T: torch.Tensor, images: dict[str, Any]):
        """((T, D) embeddings with the image features in their rows, [deepstack (R, D)]: each
        image row's features)."""
        x_TD = self.embed_tokens(input_ids_T)
        feats_PD, deepstack = self.visual(images["pixel_values"], images)
        deepstack = [image_row_features(f, images) for f in deepstack]
        return write_image_features(x_TD, feats_PD, images), deepstack

    def forward(self, input_ids_T: torch.Tensor, seq: SeqInfo, images: dict | None = None):
        """-> (h_TD after the final norm, the layers' extra outputs); `images`: the batch's
        image inputs (module docstring), None for text."""
        if images is None:
            return super().forward(input_ids_T, seq)
        x_TD, deepstack = self.embed(input_ids_T, images)
        positions_3T = images.get(MROPE_FIELD)
        if positions_3T is None:
            cos_sin = self.rope_tables(seq, x_TD.dtype)[0]
        else:
            cos_sin = mrope_cos_sin(
                positions_3T, self.inv_freq, self.mrope_axes, self.rope_scale, x_TD.dtype
            )
        extras: list = []
        for i, layer in enumerate(self.layers):
            x_TD, more = split_outputs(layer(x_TD, seq, cos_sin))
            extras += more
            if i < len(deepstack):  # Qwen3-VL: the tower's layer-i features into the rows
                x_TD = x_TD.index_add(0, images[ROWS], deepstack[i].to(x_TD.dtype))
        return self.norm(x_TD), extras


class ImageTextLM(CausalLM):
    """A native image-text model: `CausalLM` whose `embed`, `hidden_states`, `loss` and
    `forward` take `images`; `vision` names the tower and projector (train/setup.py)."""

    takes_images = True

    def __init__(self, cfg: ModelConfig, backbone: ImageTextBackbone, **kwargs: Any) -> None:
        super().__init__(cfg, backbone, **kwargs)
        self.vision = {"tower": "model.visual", "projector": "model.visual.merger"}
        # LoRA stays off the vision side unless vision.tower/projector ask (train/setup.py).
        self.no_lora_prefixes = ("model.visual.",)

    def image_features(self, images: dict[str, Any]) -> torch.Tensor:
        """(P, D): the tower and projector over every image of the batch, in order."""
        return self.model.visual(images["pixel_values"], images)[0]


class QwenVLWeights(WeightMap):
    """Ours = transformers' module tree with `model.language_model.` as `model.` (module
    docstring); checkpoints in that tree or the older `model.*` + `visual.*` layout."""

    layouts = (MODULE_TREE, OLD_LAYOUT)
