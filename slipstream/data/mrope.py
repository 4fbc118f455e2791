"""Qwen-VL's 3-D rotary positions (mRoPE), built on the host per sequence from the image
grids, as transformers' `get_rope_index` builds them for still images: a text token takes
(p, p, p) and advances p by one; an image of merged grid (1, h, w) takes (p, p + row,
p + column) over its h * w feature rows and advances p by max(h, w). Each packed sequence
starts at 0, so the positions of a micro-batch are its sequences' concatenated, (3, T)."""

from __future__ import annotations

from collections.abc import Sequence


def mrope_positions(
    ids: Sequence[int], image_token_id: int, grids: Sequence[Sequence[int]], merge: int
) -> list[list[int]]:
    """[t, h, w] position lists (each len(ids)) of one sequence; `grids` the (t, h, w) patch
    grid of each image in order, `merge` the spatial merge size."""
    out: list[list[int]] = [[], [], []]
    pos, t, images = 0, 0, iter(grids)
    while t < len(ids):
        if ids[t] != image_token_id:
            for axis in out:
                axis.append(pos)
            pos, t = pos + 1, t + 1
            continue
        _, gh, gw = (int(v) for v in next(images))
        h, w = gh // merge, gw // merge
        for row in range(h):
            for col in range(w):
                out[0].append(pos)
                out[1].append(pos + row)
                out[2].append(pos + col)
        pos, t = pos + max(h, w), t + h * w
    return out
