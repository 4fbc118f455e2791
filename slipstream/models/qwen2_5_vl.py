"""Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration, `model_type: qwen2_5_vl`): the Qwen2
decoder (models/qwen2.py) as the language model, RoPE by 3-D positions in blocks of
`mrope_section` (t, h, w: models/rope.py), and the vision tower (window attention, a patch
merger as projector) under `model.visual`: the image-text shell of models/qwen_vl.py.

config.json: the language model's keys in `text_config` (transformers 5) or at the top level
(transformers 4, whose rope type "mrope" is the default rotary with sections).
"""

from __future__ import annotations

from typing import Any

from slipstream.models import qwen2
from slipstream.models.common import ModelConfig
from slipstream.models.qwen_vl import (
    ImageTextLM,
    QwenVLWeights,
    build_image_text,
    image_text_config,
)
from slipstream.models.spec import FamilySpec


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    return image_text_config(hf, qwen2)


def build(cfg: ModelConfig) -> ImageTextLM:
    return build_image_text(cfg, qwen2, interleaved=False)


weights = QwenVLWeights
SPEC = FamilySpec("qwen2_5_vl", config_from_hf, build, weights)
