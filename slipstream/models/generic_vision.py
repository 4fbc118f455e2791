"""Image-text models on the generic path: transformers' `AutoModelForImageTextToText` models
(LLaVA, Mistral 3, ...) under the model contract, with the embedding stage that takes images.

The language model is transformers' own (packed through our attention function, as any
generic model); the vision tower and projector run transformers' code too, with their own
attention ("sdpa"), except Qwen-VL's (`VIT_TYPES`): slipstream's tower (models/qwen_vit.py)
takes `model.visual`'s place around the same parameters and runs over the collator's
host-built metadata, the images packed by their own lengths; and Mistral 3's, Gemma 4's and
Idefics3's / SmolVLM's, run by slipstream's passes over transformers' own modules
(models/pixtral_tower.py, gemma4_tower.py: real patches only; idefics3_tower.py) on
host-built inputs. One micro-batch runs the tower
once over all its images (`get_image_features`), and the features are written into the
packed rows the collator found on the host (`images["image_rows"]`, data/vision.py) by
`index_copy`: no `input_ids == image_token_id` on the device, no boolean mask, no host sync.
A frozen tower (its parameters and the pixels need no grad) records no autograd state.

Shapes: T tokens (flat, packed), D hidden, P image feature rows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from slipstream.data.gemma4_meta import KEYS as GEMMA4_KEYS
from slipstream.data.gemma4_meta import PATCHES as GEMMA4_PATCHES
from slipstream.data.idefics3_meta import KEYS as IDEFICS3_KEYS
from slipstream.data.idefics3_meta import POSITION_IDS as IDEFICS3_POSITIONS
from slipstream.data.pixtral_meta import KEYS as PIXTRAL_KEYS
from slipstream.data.pixtral_meta import PATCHES as PIXTRAL_PATCHES
from slipstream.data.qwen_vit_meta import KEYS as VIT_KEYS
from slipstream.data.qwen_vit_meta import VIT_TYPES
from slipstream.models import gemma4_tower, generic, idefics3_tower, pixtral_tower
from slipstream.models.common import FEATURE_INDEX, image_row_features, write_image_features
from slipstream.models.generic import GenericCausalLM, config_from_hf
from slipstream.models.qwen_vit import QwenVisionTower
from slipstream.models.spec import FamilySpec
from slipstream.models.weights import WeightMap

VISION_PARTS = {
    "tower": ("vision_tower", "vision_model", "visual"),
    "projector": ("multi_modal_projector", "merger", "connector"),  # Qwen-VL's merger: in its tower
}
MROPE_FIELD = "mrope_position_ids"  # data/vision.py: the batch's (3, T) Qwen-VL positions
CROPS = ("idefics3", "smolvlm")  # pixel inputs (images, crops, C, H, W): one crop an image


def vision_prefixes(hf_model: nn.Module) -> dict[str, str]:
    """{"tower": module path, "projector": module path} of the parts present (our names:
    the wrapper's children are transformers' own)."""
    found = {}
    for name, _ in hf_model.named_modules():
        for part, leaves in VISION_PARTS.items():
            if part not in found and name.rsplit(".", 1)[-1] in leaves:
                found[part] = name
    return found


class GenericImageTextLM(GenericCausalLM):
    """A transformers image-text model under the contract: `embed(ids, images)` writes the
    image features into their rows; `hidden_states`, `loss` and `forward` take `images`."""

    def __init__(self, cfg: Any, hf_model: nn.Module) -> None:
        super().__init__(cfg, hf_model)
        inner = getattr(hf_model, "model", None)
        self.qwen_vit = cfg.model_type in VIT_TYPES and hasattr(inner, "visual")
        if self.qwen_vit:  # slipstream's tower around transformers' parameters, same names
            inner.visual = QwenVisionTower.adopt(inner.visual)
        self.vision = vision_prefixes(hf_model)
        # LoRA stays off the vision side unless vision.train asks (train/vision.py).
        self.no_lora_prefixes = tuple(f"{p}." for p in self.vision.values())
        # Qwen3-VL's deepstack: the tower's intermediate features are added to the image rows
        # after the first decoder layers, as transformers' `_deepstack_process` does (by a
        # boolean mask there, by `index_add` over the host-built rows here).
        self._deepstack: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        language = getattr(getattr(hf_model, "model", None), "language_model", None)
        per_layer = getattr(getattr(language, "config", None), "hidden_size_per_layer_input", 0)
        self._per_layer_inputs = language.get_per_layer_inputs if per_layer else None
        visual = getattr(getattr(hf_model, "model", None), "visual", None)
        depth = len(getattr(visual, "deepstack_visual_indexes", None) or ())
        if depth:
            layers = hf_model.model.language_model.layers
            for k in range(depth):
                layers[k].register_forward_hook(self._deepstack_hook(k))

    def _deepstack_hook(self, k: int):
        def hook(module: nn.Module, args: Any, out: Any) -> Any:
            if self._deepstack is None:
                return out
            rows_P, feats = self._deepstack
            h = out[0] if isinstance(out, tuple) else out
            h = h.index_add(1, rows_P, feats[k][None].to(h.dtype))
            return (h, *out[1:]) if isinstance(out, tuple) else h

        return hook

    def embed(self, input_ids_T: torch.Tensor, images: dict[str, torch.Tensor] | None = None):
        """(T, D) input embeddings, image features in the rows `images["image_rows"]` names."""
        x_TD = self.input_embeddings()(input_ids_T)
        if images is None:
            return x_TD
        feats_PD, deepstack = self._image_features(images)
        rows_R = images["image_rows"]
        # Read by the deepstack hooks of this forward (and of its recompute in backward).
        deepstack = [image_row_features(f, images) for f in deepstack]
        self._deepstack = (rows_R, deepstack) if deepstack else None
        return write_image_features(x_TD, feats_PD, images)

    def _backbone_out(self, input_ids_T, seq, images=None, **kwargs):
        """The language model over the packed stream; with Qwen-VL's host-built 3-D
        positions (`images["mrope_position_ids"]`, (3, T)) in place of the 1-D ones."""
        if images is not None and MROPE_FIELD in images:
            kwargs["position_ids"] = images[MROPE_FIELD][:, None, :]
        if images is None:
            self._deepstack = None  # a text batch (or a decode step): no deepstack rows
        elif self._per_layer_inputs is not None:
            # Gemma 4's per-layer inputs from the ids, image rows as the pad token as
            # transformers does (from inputs_embeds alone it would invert the embedding:
            # a `nonzero`, and no id at all for an image row).
            pad, rows_P = self.config.hf["text_config"].get("pad_token_id", 0), images["image_rows"]
            ids_T = input_ids_T.index_fill(0, rows_P, pad if pad is not None else 0)
            kwargs["per_layer_inputs"] = self._per_layer_inputs(ids_T[None])
        return super()._backbone_out(input_ids_T, seq, images, **kwargs)

    def image_features(self, images: dict[str, torch.Tensor]) -> torch.Tensor:
        """(P, D): the tower and projector over every image of the batch, in order."""
        return self._image_features(images)[0]

    def reset_buffers(self) -> None:
        super().reset_buffers()
        if self.qwen_vit:
            self.hf.model.visual.reset_buffers()

    def _image_features(self, images: dict[str, Any]):
        """((P, D) features, [(P, D)] deepstack features per early layer, or [])."""
        if self.qwen_vit:  # slipstream's tower over the host-built metadata (no sync)
            tower = self.hf.model.visual
            return tower(images["pixel_values"].to(tower.dtype), images)
        if PIXTRAL_PATCHES in images:  # Mistral 3: slipstream's Pixtral pass (no sync)
            inner, hf = self.hf.model, self.hf.config
            feats = pixtral_tower.image_features(
                inner.vision_tower, inner.multi_modal_projector, hf.vision_feature_layer,
                hf.spatial_merge_size, images,
            )  # fmt: skip
            return feats, []
        if GEMMA4_PATCHES in images:  # Gemma 4: slipstream's pass over its tower (no sync)
            inner = self.hf.model
            return gemma4_tower.image_features(inner.vision_tower, inner.embed_vision, images), []
        if IDEFICS3_POSITIONS in images:  # Idefics3, SmolVLM: slipstream's pass (no sync)
            inner = self.hf.model
            return idefics3_tower.image_features(inner.vision_model, inner.connector, images), []
        # slipstream's entries, not the model's
        ours = ("image_rows", FEATURE_INDEX, MROPE_FIELD, *VIT_KEYS, *PIXTRAL_KEYS, *GEMMA4_KEYS,
                *IDEFICS3_KEYS)  # fmt: skip
        kwargs = {k: v for k, v in images.items() if k not in ours}
        pixels = kwargs.pop("pixel_values")
        if self.config.model_type in CROPS:  # every crop its own "batch row" of one image
            pixels = pixels[:, None]
            if "pixel_attention_mask" in kwargs:
                kwargs["pixel_attention_mask"] = kwargs["pixel_attention_mask"][:, None]
        dtype = next(self.hf.parameters()).dtype
        out = self.hf.model.get_image_features(
            pixel_values=pixels.to(dtype), return_dict=True, **kwargs
        )
        feats = out.pooler_output if hasattr(out, "pooler_output") else out
        deepstack = [_flat(f) for f in getattr(out, "deepstack_features", None) or ()]
        return _flat(feats), deepstack


def _flat(feats: Any) -> torch.Tensor:
    """(P, D) of a tower's output: per-image tensors or a (N, tokens, D) batch."""
    if isinstance(feats, (list, tuple)):
        feats = torch.cat(list(feats))
    return feats.reshape(-1, feats.shape[-1])


def _auto_class():
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText


def build(cfg: Any, trust_remote_code: bool = False) -> GenericImageTextLM:
    """transformers' image-text model of `cfg`, randomly initialised (generic.build)."""
    return generic.build(cfg, trust_remote_code, _auto_class(), GenericImageTextLM)


def load(hf, folder, dtype, device, quantize, source, trust_remote_code=False):
    """transformers' `from_pretrained` of the image-text model (generic.load)."""
    return generic.load(
        hf, folder, dtype, device, quantize, source, trust_remote_code, _auto_class(),
        GenericImageTextLM,
    )  # fmt: skip


SPEC = FamilySpec("generic_vision", config_from_hf, build, WeightMap, load)
