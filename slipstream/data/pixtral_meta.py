"""Host-built inputs of Mistral 3's Pixtral tower (models/pixtral_tower.py), from the image
processor's pixels and each image's true size: transformers' tower reads `image_sizes` on the
host inside its forward (a sync per image, and again in the patch merger and the feature
split); here the collator or the generation prefill cuts each image's valid patches out of its
padded pixels and builds every index, once per batch, on the host. The keys of the images
dict (one place: `KEYS`):

- `PATCHES` (P, C * p * p): every image's valid patches, row-major, each flattened in the
  conv weight's (C, p, p) order (no padding: the processor's batch pads images to the largest,
  the tower never sees that padding);
- `POSITIONS` (P, 2) int64: each patch's (row, column) in its image (2-D RoPE);
- `SEQ`: SeqInfo over the images (h * w patches each): attention stays inside an image;
- `MERGE_INDEX` (Q * M,) int64: the patch rows of each merged feature row, in order (the
  patch merger's merge x merge blocks; an odd last row or column is dropped, as
  transformers' unfold drops it).

`pixel_values` (the padded batch) is replaced by `PATCHES`.

Shapes: P patches, Q merged rows, M = merge^2.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from slipstream.ops.packing import SeqInfo

PATCHES = "pixtral_patches"  # (P, C * p * p) float: the images' valid patches, row-major
POSITIONS = "pixtral_positions"  # (P, 2) int64: each patch's (row, column) in its image
MERGE_INDEX = "pixtral_merge_index"  # (Q * M,) int64: patch rows of each merged row, in order
SEQ = "pixtral_seq"  # SeqInfo over the images
KEYS = (PATCHES, POSITIONS, MERGE_INDEX, SEQ)
PIXTRAL_TYPES = ("mistral3",)


@dataclass(frozen=True)
class PixtralGeometry:
    """What the inputs depend on: the tower's `patch` size and the projector's `merge` size."""

    patch: int
    merge: int
    replaces = ("pixel_values",)  # the batch's padded pixels: PATCHES take their place

    @classmethod
    def of(cls, config: dict[str, Any]) -> PixtralGeometry:
        """From config.json (Mistral 3: `vision_config.patch_size`, `spatial_merge_size`)."""
        from transformers import Mistral3Config

        cfg = Mistral3Config(**{k: v for k, v in config.items() if k != "model_type"})
        return cls(cfg.vision_config.patch_size, cfg.spatial_merge_size)

    def metadata(self, images: dict[str, Any]) -> dict[str, Any]:
        """KEYS for a batch's concatenated image inputs (host tensors)."""
        return pixtral_metadata(images["pixel_values"], images["image_sizes"].tolist(), self)


def patch_rows(pixels_CHW: torch.Tensor, height: int, width: int, patch: int) -> torch.Tensor:
    """(h * w, C * p * p): the valid patches of one (padded) image, row-major, each flattened
    in the conv weight's (C, p, p) order. Host tensors."""
    c = pixels_CHW.shape[0]
    h, w = height // patch, width // patch
    x = pixels_CHW[:, : h * patch, : w * patch].reshape(c, h, patch, w, patch)
    return x.permute(1, 3, 0, 2, 4).reshape(h * w, c * patch * patch)


def pixtral_metadata(
    pixels_NCHW: torch.Tensor, sizes: Sequence[Sequence[int]], geo: PixtralGeometry
) -> dict[str, Any]:
    """KEYS (module docstring) of images given as the image processor's padded pixels and
    their true (height, width) sizes, on the host."""
    patch, merge = geo.patch, geo.merge
    grids = [(int(h) // patch, int(w) // patch) for h, w in sizes]
    patches = torch.cat([patch_rows(px, int(h), int(w), patch)
                         for px, (h, w) in zip(pixels_NCHW, sizes, strict=True)])  # fmt: skip
    positions, merge_index, start = [], [], 0
    for h, w in grids:
        positions += [(r, c) for r in range(h) for c in range(w)]
        # Merged row (br, bc) takes patches (br*m + i, bc*m + j), (i, j) row-major; the
        # projector lays them out channel-major, as F.unfold does (models/pixtral_tower.py).
        for br in range(h // merge):
            for bc in range(w // merge):
                merge_index += [start + (br * merge + i) * w + bc * merge + j
                                for i in range(merge) for j in range(merge)]  # fmt: skip
        start += h * w
    return {
        PATCHES: patches,
        POSITIONS: torch.tensor(positions, dtype=torch.int64).reshape(-1, 2),
        MERGE_INDEX: torch.tensor(merge_index, dtype=torch.int64),
        SEQ: SeqInfo.from_lengths([h * w for h, w in grids]),
    }
