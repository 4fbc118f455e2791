"""Qwen3-VL (Qwen3VLForConditionalGeneration, `model_type: qwen3_vl`): the Qwen3 decoder
(models/qwen3.py: per-head q/k RMSNorm) as the language model, RoPE by 3-D positions with the
t/h/w sections interleaved (models/rope.py), and the vision tower under `model.visual` (a learned
position table resampled to each grid, a patch merger as projector) whose intermediate features
(deepstack) are added to the image rows after the first decoder layers: the image-text shell of
models/qwen_vl.py.
"""

from __future__ import annotations

from typing import Any

from slipstream.models import qwen3
from slipstream.models.common import ModelConfig
from slipstream.models.qwen_vl import (
    ImageTextLM,
    QwenVLWeights,
    build_image_text,
    image_text_config,
)
from slipstream.models.spec import FamilySpec


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    return image_text_config(hf, qwen3)


def build(cfg: ModelConfig) -> ImageTextLM:
    return build_image_text(cfg, qwen3, interleaved=True)


weights = QwenVLWeights
SPEC = FamilySpec("qwen3_vl", config_from_hf, build, weights)
