"""Host-built inputs of Gemma 4's vision tower (models/gemma4_tower.py), from the image
processor's patches and their (x, y) positions.

transformers' `Gemma4VisionModel` runs every image padded to `max_soft_tokens * k^2` patches
(k the pooling kernel), masks the padding in attention, pools by a one-hot matrix over all
padded positions and strips the empty pooled rows by a boolean index; `get_image_features`
then reads the per-image lengths on the host (5 syncs over six images, CPU). Here the
collator or the generation prefill drops each image's padding patches and orders its real
patches so that every k x k pooling block is k^2 consecutive rows, once per batch, on the
host. The keys of the images dict (one place: `KEYS`):

- `PATCHES` (P, 3 * p * p): every image's real patches (no padding), block by block: the
  pooled rows in the order transformers keeps them (x // k + (W / k) * (y // k), W the
  image's width in patches), each block's k^2 patches row-major;
- `POSITIONS` (P, 2) int64: each patch's (x, y) in its image (the position table and the
  2-D RoPE);
- `SEQ`: SeqInfo over the images (their real patch counts): attention stays inside an image.

Pooling is then a mean over groups of k^2 consecutive rows. Attention within an image does
not depend on the order of its patches (bidirectional; positions travel with the patches),
so the reordering changes nothing but the pooling's indexing.

`pixel_values` and `image_position_ids` (the padded batch) are replaced by these keys.

Shapes: P real patches (all images), Q = P / k^2 pooled rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from slipstream.ops.packing import SeqInfo

PATCHES = "gemma4_patches"  # (P, 3 * p * p) float: real patches, pooling block by block
POSITIONS = "gemma4_positions"  # (P, 2) int64: each patch's (x, y) in its image
SEQ = "gemma4_seq"  # SeqInfo over the images
KEYS = (PATCHES, POSITIONS, SEQ)
GEMMA4_TYPES = ("gemma4",)


@dataclass(frozen=True)
class Gemma4Geometry:
    """What the inputs depend on: the tower's pooling kernel `k` (k x k patches a row)."""

    k: int
    replaces = ("pixel_values", "image_position_ids")  # the padded batch: KEYS take its place

    @classmethod
    def of(cls, config: dict[str, Any]) -> Gemma4Geometry:
        """From config.json (Gemma 4: `vision_config.pooling_kernel_size`, default 3)."""
        return cls(int((config.get("vision_config") or {}).get("pooling_kernel_size", 3)))

    def metadata(self, images: dict[str, Any]) -> dict[str, Any]:
        """KEYS for a batch's concatenated image inputs (host tensors)."""
        return gemma4_metadata(images["pixel_values"], images["image_position_ids"], self.k)


def pooled_order(positions_N2: torch.Tensor, k: int) -> torch.Tensor:
    """(N,) int64: the order of one image's real patches ((x, y) each) that puts each pooling
    block's k^2 patches together, the blocks in transformers' pooled order and each block's
    patches row-major. ValueError when the patch grid does not tile into k x k blocks."""
    x, y = positions_N2[:, 0], positions_N2[:, 1]
    width, height = int(x.max()) + 1, int(y.max()) + 1
    if width % k or height % k or len(x) != width * height:
        raise ValueError(
            f"a Gemma 4 image of {width} x {height} patches ({len(x)} real) does not tile into "
            f"{k} x {k} pooling blocks; the image processor does not match this model"
        )
    block = x // k + (width // k) * (y // k)
    within = (y % k) * k + x % k
    return torch.argsort(block * k * k + within)


def gemma4_metadata(pixels_NLC: torch.Tensor, positions_NL2: torch.Tensor, k: int):
    """KEYS (module docstring) of images given as the image processor's padded patches
    (N, L, 3 * p * p) and their (x, y) positions (N, L, 2; (-1, -1) for padding), on the
    host."""
    patches, positions, lengths = [], [], []
    for px_LC, pos_L2 in zip(pixels_NLC, positions_NL2, strict=True):
        real = (pos_L2 != -1).all(-1)  # host tensors from the image processor
        pos, px = pos_L2[real], px_LC[real]
        order = pooled_order(pos, k)
        patches.append(px[order])
        positions.append(pos[order])
        lengths.append(len(order))
    return {
        PATCHES: torch.cat(patches),
        POSITIONS: torch.cat(positions).to(torch.int64),
        SEQ: SeqInfo.from_lengths(lengths),
    }
