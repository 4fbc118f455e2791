"""Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration, `model_type: qwen2_5_vl`): the Qwen2
decoder (models/qwen2.py) as the language model, RoPE by 3-D positions in blocks of
`mrope_section` (t, h, w: models/rope.py), and the vision tower (window attention, a patch
merger as projector) under `model.visual`: the image-text shell of models/qwen_vl.py.

config.json: the language model's keys in `text_config` (transformers 5) or at the top level
(transformers 4, whose rope type "mrope" is the default rotary with sections).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from slipstream.models import qwen2
from slipstream.models.common import ModelConfig
from slipstream.models.qwen_vl import (
    ImageTextBackbone,
    ImageTextLM,
    QwenVLWeights,
    mrope_section,
    text_config,
    vision_tower,
)
from slipstream.models.spec import FamilySpec


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """The language model's config (windows checked); `hf` kept whole (export writes it)."""
    if not isinstance(hf.get("vision_config"), dict):
        raise ValueError(
            f"config.json: model_type {hf.get('model_type')!r} needs a vision_config; re-save "
            "the checkpoint with transformers."
        )
    text = text_config(hf)
    mrope_section(text)  # a missing section fails at load, not at build
    cfg = qwen2.config_from_hf({**text, "model_type": hf["model_type"]})
    return dataclasses.replace(cfg, hf=dict(hf))


def build(cfg: ModelConfig) -> ImageTextLM:
    text = text_config(cfg.hf)
    windows = qwen2.layer_windows(dataclasses.replace(cfg, hf=text))
    layers = qwen2.decoder_layers(cfg, windows)
    visual = vision_tower(cfg.hf)
    backbone = ImageTextBackbone(cfg, layers, visual, mrope_section(text), interleaved=False)
    return ImageTextLM(cfg, backbone)


weights = QwenVLWeights
SPEC = FamilySpec("qwen2_5_vl", config_from_hf, build, weights)
