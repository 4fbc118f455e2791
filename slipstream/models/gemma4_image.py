"""Gemma 4 image+text on the native family (`model_type: gemma4` with a `vision_config`): our
text model (models/gemma4.py) plus transformers' own vision tower and `embed_vision` modules,
run by slipstream's pass over them (models/gemma4_tower.py: each image's real patches only,
every index built on the host by data/gemma4_meta.py).

What the image side changes, as transformers' `Gemma4Model` does it:
- the embedding stage writes each image's pooled, embedded soft tokens into the rows the
  collator found on the host (`images["image_rows"]`, `index_copy`), unscaled;
- the per-layer inputs (E2B/E4B) take the pad token's id at those rows for their token part
  (`index_fill` over the same rows; transformers: a `where` over its placeholder mask), and
  the projection of the embeddings with the image features in place;
- with `use_bidirectional_attention: "vision"` each image's rows see one another on the
  sliding layers only (`seq.image_spans`; models/gemma4.py's full layers stay causal).

Names are transformers' module tree: ours `vision_tower.*` / `embed_vision.*` are its
`model.vision_tower.*` / `model.embed_vision.*` (`IMAGE_TEXT_LAYOUTS`), so LoRA on the tower
(`vision.tower: lora`) saves adapters peft loads on `AutoModelForImageTextToText`. The audio
tower and its embedder are passed through (save and export copy them from the source).

Shapes: T tokens (flat, packed), D hidden, Q image feature rows.
"""

from __future__ import annotations

from typing import Any

import torch

from slipstream.models import gemma4_tower
from slipstream.models.common import CausalLM, _check_batch, write_image_features
from slipstream.ops.packing import SeqInfo

IMAGE_TEXT_LAYOUTS = (
    (
        ("vision_tower.", "model.vision_tower."),
        ("embed_vision.", "model.embed_vision."),
        ("model.", "model.language_model."),
        ("lm_head.", "lm_head."),
    ),
)
AUDIO_PASSTHROUGH = ("model.audio_tower.", "model.embed_audio.")


def _hf_config(hf: dict[str, Any]) -> Any:
    from transformers import Gemma4Config

    return Gemma4Config(**{k: v for k, v in hf.items() if k != "model_type"})


class Gemma4ImageTextLM(CausalLM):
    """The text model plus the vision tower and its embedder (module docstring):
    `embed(ids, images)` writes the image features into their rows; `hidden_states`, `loss`
    and `forward` take the same `images=` (models/contract.py)."""

    takes_images = True

    def __init__(self, cfg: Any, backbone: Any) -> None:
        super().__init__(cfg, backbone, logit_softcap=cfg.final_softcap)
        from transformers.models.gemma4.modeling_gemma4 import (
            Gemma4MultimodalEmbedder,
            Gemma4VisionModel,
        )

        hf = _hf_config(cfg.hf)
        vision = hf.vision_config
        vision._attn_implementation = "sdpa"  # unused: slipstream's pass does the attention
        self.vision_tower = Gemma4VisionModel(vision)
        self.embed_vision = Gemma4MultimodalEmbedder(vision, hf.text_config)
        pad = hf.text_config.pad_token_id
        self.pad_token_id = 0 if pad is None else int(pad)
        # The parts `vision.tower` / `vision.projector` name (train/setup.py); LoRA stays off
        # them unless those settings ask for it.
        self.vision = {"tower": "vision_tower", "projector": "embed_vision"}
        self.no_lora_prefixes = tuple(f"{p}." for p in self.vision.values())

    def image_features(self, images: dict[str, Any]) -> torch.Tensor:
        """(Q, D): the tower and embedder over every image of the batch, in order."""
        return gemma4_tower.image_features(self.vision_tower, self.embed_vision, images)

    def embed(self, input_ids_T: torch.Tensor, images: Any = None) -> torch.Tensor:
        """(T, D) scaled token embeddings, image features (unscaled, as transformers writes
        them) in the rows `images["image_rows"]` names."""
        x_TD = self.model.embed_tokens(input_ids_T)
        if images is None:
            return x_TD
        return write_image_features(x_TD, self.image_features(images), images)

    def _backbone_out(self, input_ids_T: torch.Tensor, seq: SeqInfo, images: Any = None):
        if images is None:
            return super()._backbone_out(input_ids_T, seq)
        _check_batch(input_ids_T, seq)  # what the inherited step checks first
        rows_Q = images["image_rows"]
        ple_ids_T = input_ids_T.index_fill(0, rows_Q, self.pad_token_id)
        x_TD = self.embed(input_ids_T, images)
        return self.model(input_ids_T, seq, x_TD=x_TD, ple_ids_T=ple_ids_T)
