"""Host-built inputs of the Idefics3 / SmolVLM tower pass (models/idefics3_tower.py), from the
image processor's crops and their pixel masks.

transformers' `Idefics3Model.get_image_features` finds the real crops by a boolean index over
all-zero pixels, cuts the pixel mask the same way, and splits its output by counts read back
to the host; its patch embedding derives each crop's patch grid and position ids from the
mask on the device (4 syncs over six images, CPU). Here the collator or the generation
prefill derives them on the host, once per batch, from the processor's `pixel_attention_mask`
(every crop the data side keeps is a real one: each crop is its own row of the tower's batch).
The keys of the images dict (one place: `KEYS`):

- `POSITION_IDS` (N, S) int64: each patch's row of the learned position table (S patches a
  crop), transformers' fractional-coordinate bucketing over the crop's real patch grid (0
  for padding patches, as transformers fills them);
- `KEY_MASK` (N, S) bool: the crop's real patches, the keys its attention may see; present
  only when some crop of the batch is padded (the mask is then dense per crop: padding
  patches still run as queries, as in transformers, whose connector takes every patch).

`pixel_attention_mask` is replaced by these keys; `pixel_values` stays.

Shapes: N crops, S = (H / p) * (W / p) patches a crop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

POSITION_IDS = "idefics3_position_ids"  # (N, S) int64: position-table rows
KEY_MASK = "idefics3_key_mask"  # (N, S) bool: real patches (only when some are padding)
KEYS = (POSITION_IDS, KEY_MASK)
IDEFICS3_TYPES = ("idefics3", "smolvlm")


@dataclass(frozen=True)
class Idefics3Geometry:
    """What the inputs depend on: the tower's patch size and patches a side of its table."""

    patch: int
    per_side: int
    replaces = ("pixel_attention_mask",)  # KEYS take its place

    @classmethod
    def of(cls, config: dict[str, Any]) -> Idefics3Geometry:
        """From config.json (`vision_config.patch_size`, `image_size`, transformers' defaults
        where it leaves them out)."""
        from transformers import AutoConfig

        kind = config["model_type"]
        cfg = AutoConfig.for_model(kind, **{k: v for k, v in config.items() if k != "model_type"})
        vision = cfg.vision_config
        return cls(vision.patch_size, vision.image_size // vision.patch_size)

    def metadata(self, images: dict[str, Any]) -> dict[str, Any]:
        """KEYS for a batch's concatenated image inputs (host tensors)."""
        pixels = images["pixel_values"]
        mask = images.get("pixel_attention_mask")
        if mask is None:
            mask = torch.ones(pixels.shape[0], *pixels.shape[-2:], dtype=torch.bool)
        return idefics3_metadata(mask, self)


def patch_mask(pixel_mask_NHW: torch.Tensor, patch: int) -> torch.Tensor:
    """(N, h, w) bool: patches with any real pixel (transformers' unfold-and-sum rule)."""
    grid = pixel_mask_NHW.unfold(1, patch, patch).unfold(2, patch, patch)
    return grid.sum(dim=(-1, -2)) > 0


def position_ids(mask_Nhw: torch.Tensor, per_side: int) -> torch.Tensor:
    """(N, h * w) int64: transformers' bucketed position ids of each crop's real patch grid
    (its float32 formula, here on the host), 0 at padding patches."""
    n, h, w = mask_Nhw.shape
    boundaries = torch.arange(1 / per_side, 1.0, 1 / per_side)
    rows = mask_Nhw[:, :, 0].sum(1)  # real patch rows and columns of each crop
    cols = mask_Nhw[:, 0, :].sum(1)
    frac_h = torch.arange(h, dtype=torch.float32)[None] * (1.0 / rows)[:, None]
    frac_w = torch.arange(w, dtype=torch.float32)[None] * (1.0 / cols)[:, None]
    bucket_h = torch.bucketize(frac_h.clamp(max=1.0 - 1e-6), boundaries, right=True)
    bucket_w = torch.bucketize(frac_w.clamp(max=1.0 - 1e-6), boundaries, right=True)
    ids = (bucket_h[:, :, None] * per_side + bucket_w[:, None, :]).reshape(n, -1)
    return torch.where(mask_Nhw.reshape(n, -1), ids, 0).to(torch.int64)


def idefics3_metadata(pixel_mask_NHW: torch.Tensor, geo: Idefics3Geometry) -> dict[str, Any]:
    """KEYS (module docstring) from the crops' pixel masks (N, H, W), on the host."""
    mask = patch_mask(pixel_mask_NHW.bool(), geo.patch)
    out: dict[str, Any] = {POSITION_IDS: position_ids(mask, geo.per_side)}
    if not bool(mask.all()):  # host tensors from the image processor
        out[KEY_MASK] = mask.reshape(mask.shape[0], -1)
    return out
