"""Host-built metadata of Qwen-VL's vision tower (models/qwen_vit.py), from the images' patch
grids (`image_grid_thw`, host ints) and the vision config: everything transformers' tower
computes from `grid_thw` inside its forward (`.tolist()`, boolean masks, `repeat_interleave`:
21 host syncs a step on Qwen2.5-VL, 14 on Qwen3-VL) is computed here, in the collator or the
generation prefill, and reaches the device with the batch.

Patches arrive as the image processor emits them: per image, per frame, in spatial-merge-block
order (block row, block column, row in block, column in block), `merge`^2 patches a block
("unit": one feature row after the merger). The keys of the images dict (one place: `KEYS`):

- `SEQ`: SeqInfo over every frame of every image (h * w patches each): the full-attention
  blocks' boundaries (host lengths, device cu_seqlens);
- `ROTARY_POSITIONS` (N, 2) int64: each patch's (row, column), for the 2-D rotary embedding,
  in the order the blocks see the patches (Qwen2.5-VL: window order);
- Qwen2.5-VL (window attention, `fullatt_block_indexes` the full blocks): `WINDOW_SEQ`,
  SeqInfo over the windows (window_size / merge / patch units a side, the last ones of a row
  or column smaller: no empty window, where transformers pads and drops them), `WINDOW_INDEX`
  (U,) int64, the units in window order (image by image, frame by frame, window by window in
  raster order, raster inside a window), and `WINDOW_REVERSE` (U,) its inverse permutation;
- Qwen3-VL / Qwen3.5 (a learned square position table resampled to each grid, bilinear with
  aligned corners): `INTERP_INDEX` (N, 4) int64 rows of the flattened table and
  `INTERP_WEIGHT` (N, 4) float32 their weights (taps (r0, c0), (r0, c1), (r1, c0), (r1, c1)).

Shapes: N patches, U = N / merge^2 units (feature rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from slipstream.ops.packing import SeqInfo

SEQ = "vit_seq"
WINDOW_SEQ = "vit_window_seq"
ROTARY_POSITIONS = "vit_rotary_positions"
WINDOW_INDEX = "vit_window_index"
WINDOW_REVERSE = "vit_window_reverse"
INTERP_INDEX = "vit_interp_index"
INTERP_WEIGHT = "vit_interp_weight"
KEYS = (SEQ, WINDOW_SEQ, ROTARY_POSITIONS, WINDOW_INDEX, WINDOW_REVERSE, INTERP_INDEX,
        INTERP_WEIGHT)  # fmt: skip
SEQ_KEYS = (SEQ, WINDOW_SEQ)  # SeqInfo entries (moved by their own `.to`), the rest tensors

# The model types whose tower is models/qwen_vit.py (their image inputs carry these keys),
# with transformers' vision config class of each (a config.json dict is read through it, so
# its defaults apply).
CONFIG_CLASSES = {
    "qwen2_5_vl": "Qwen2_5_VLVisionConfig", "qwen3_vl": "Qwen3VLVisionConfig",
    "qwen3_5": "models.qwen3_5.configuration_qwen3_5.Qwen3_5VisionConfig",
    "qwen3_5_moe": "models.qwen3_5_moe.configuration_qwen3_5_moe.Qwen3_5MoeVisionConfig",
}  # fmt: skip
VIT_TYPES = tuple(CONFIG_CLASSES)


def vision_config(vision: Any, model_type: str | None = None) -> Any:
    """transformers' vision config object of `vision` (an object: itself; a config.json
    `vision_config` dict: through the class of `model_type`, the checkpoint's type)."""
    if not isinstance(vision, dict):
        return vision
    import importlib

    import transformers

    name = CONFIG_CLASSES.get(model_type or "")
    if name is None:
        raise ValueError(f"model_type {model_type!r}: slipstream's Qwen-VL tower takes "
                         f"{sorted(CONFIG_CLASSES)}")  # fmt: skip
    module, _, cls = name.rpartition(".")
    owner = importlib.import_module(f"transformers.{module}") if module else transformers
    return getattr(owner, cls)(**vision)


@dataclass(frozen=True)
class VitGeometry:
    """What the metadata depends on: `kind` ("window" | "learned"), `patch`, `merge` (spatial
    merge size), `window` (Qwen2.5-VL's window side in units: window_size // merge // patch),
    `side` (the learned table's side: sqrt(num_position_embeddings))."""

    kind: str
    patch: int
    merge: int
    window: int = 0
    side: int = 0

    @classmethod
    def of(cls, vision: Any, model_type: str | None = None) -> VitGeometry:
        """From a vision config (transformers' object, or config.json's `vision_config` dict
        with the checkpoint's `model_type`: `vision_config`)."""
        vision = vision_config(vision, model_type)
        get = lambda k: getattr(vision, k, None)  # noqa: E731
        patch, merge = get("patch_size"), get("spatial_merge_size")
        if get("fullatt_block_indexes") is not None:
            return cls("window", patch, merge, window=get("window_size") // merge // patch)
        if get("num_position_embeddings") is not None:
            return cls("learned", patch, merge, side=int(get("num_position_embeddings") ** 0.5))
        raise ValueError(
            "vision_config has neither fullatt_block_indexes (Qwen2.5-VL) nor "
            "num_position_embeddings (Qwen3-VL, Qwen3.5): not a tower slipstream knows"
        )

    replaces = ()  # the tower takes the processor's patches as they are

    def metadata(self, images: dict[str, Any]) -> dict[str, Any]:
        """The metadata of a batch's concatenated image inputs (host tensors)."""
        return vit_metadata(images["image_grid_thw"].tolist(), self)


def vit_metadata(grids: Sequence[Sequence[int]], geo: VitGeometry) -> dict[str, Any]:
    """The tower metadata (module docstring) of images with these (t, h, w) patch grids, on
    the host: tensors and SeqInfos, moved to the device with the batch."""
    grids = [tuple(int(v) for v in g) for g in grids]
    for t, h, w in grids:
        if h % geo.merge or w % geo.merge:
            raise ValueError(f"image grid {(t, h, w)} is not a multiple of merge {geo.merge}")
    frames = [h * w for t, h, w in grids for _ in range(t)]
    rows, cols = zip(*(_block_order(h, w, geo.merge, t) for t, h, w in grids), strict=True)
    rows_N, cols_N = torch.cat(rows), torch.cat(cols)
    out: dict[str, Any] = {SEQ: SeqInfo.from_lengths(frames)}
    positions_N2 = torch.stack([rows_N, cols_N], dim=-1)
    if geo.kind == "window":
        index_U, lengths = window_order(grids, geo)
        unit = geo.merge**2
        out[WINDOW_SEQ] = SeqInfo.from_lengths([n * unit for n in lengths])
        out[WINDOW_INDEX] = index_U
        out[WINDOW_REVERSE] = torch.argsort(index_U)
        positions_N2 = positions_N2.view(-1, unit, 2)[index_U].reshape(-1, 2)
    else:
        sizes = [(h, w) for t, h, w in grids for _ in range(t * h * w)]
        heights, widths = (torch.tensor(s) for s in zip(*sizes, strict=True))
        r_taps, r_weights = _axis_taps(rows_N, heights, geo.side)
        c_taps, c_weights = _axis_taps(cols_N, widths, geo.side)
        out[INTERP_INDEX] = (r_taps[:, :, None] * geo.side + c_taps[:, None, :]).reshape(-1, 4)
        out[INTERP_WEIGHT] = (r_weights[:, :, None] * c_weights[:, None, :]).reshape(-1, 4)
    out[ROTARY_POSITIONS] = positions_N2.contiguous()
    return out


def _block_order(h: int, w: int, merge: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) (t*h*w,) of one image's patches in spatial-merge-block order."""
    shape = (h // merge, w // merge, merge, merge)
    rows = torch.arange(h).view(h // merge, 1, merge, 1).expand(shape).reshape(-1)
    cols = torch.arange(w).view(1, w // merge, 1, merge).expand(shape).reshape(-1)
    return rows.repeat(t), cols.repeat(t)


def window_order(grids: Sequence[tuple[int, int, int]], geo: VitGeometry):
    """((U,) int64 units in window order, [units in each window]) over all images."""
    indices, lengths, first = [], [], 0
    ws = geo.window
    for t, h, w in grids:
        uh, uw = h // geo.merge, w // geo.merge
        nh, nw = -(-uh // ws), -(-uw // ws)
        index = torch.arange(t * uh * uw).view(t, uh, uw)
        padded = F.pad(index, (0, nw * ws - uw, 0, nh * ws - uh), value=-1)
        windows = padded.view(t, nh, ws, nw, ws).permute(0, 1, 3, 2, 4).reshape(-1, ws * ws)
        lengths += (windows >= 0).sum(-1).tolist()  # host tensors: no device involved
        indices.append(windows[windows >= 0] + first)
        first += t * uh * uw
    return torch.cat(indices), lengths


def _axis_taps(index_N: torch.Tensor, size_N: torch.Tensor, side: int):
    """Bilinear taps (N, 2) into a `side`-long axis and their weights (N, 2) float32, corners
    aligned: position i of `size` maps to i * (side - 1) / (size - 1)."""
    src = index_N.to(torch.float32) * (side - 1) / (size_N - 1).clamp(min=1)
    floor = torch.floor(src)
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights
