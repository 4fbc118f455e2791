"""The generated shapes task (slipstream/data/shapes.py): deterministic, every answer true
of its picture (colour by pixel value, shape by how much of its box it fills, squares counted
as connected regions), train and eval pictures different."""

from __future__ import annotations

import hashlib
import json

import numpy as np
from PIL import Image

from slipstream.data.shapes import BACKGROUND, COLOURS, write_shapes


def _regions(mask: np.ndarray) -> list[np.ndarray]:
    """The 4-connected regions of a boolean mask, as arrays of (y, x)."""
    seen = np.zeros_like(mask)
    out = []
    for y, x in zip(*np.nonzero(mask)):
        if seen[y, x]:
            continue
        stack, cells = [(y, x)], []
        seen[y, x] = True
        while stack:
            cy, cx = stack.pop()
            cells.append((cy, cx))
            for ny, nx in ((cy + 1, cx), (cy - 1, cx), (cy, cx + 1), (cy, cx - 1)):
                inside = 0 <= ny < mask.shape[0] and 0 <= nx < mask.shape[1]
                if inside and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    stack.append((ny, nx))
        out.append(np.array(cells))
    return out


def test_rows_are_deterministic_and_every_answer_is_true_of_its_picture(tmp_path):
    train, held_out = write_shapes(tmp_path / "a", train_rows=60, eval_rows=30)
    again, _ = write_shapes(tmp_path / "b", train_rows=60, eval_rows=30)
    assert train.read_text() == again.read_text()
    digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
    assert digest(tmp_path / "a/pics/train-7.png") == digest(tmp_path / "b/pics/train-7.png")
    rows = [json.loads(x) for x in train.read_text().splitlines()]
    eval_rows = [json.loads(x) for x in held_out.read_text().splitlines()]
    assert {r["task"] for r in rows} == {"colour", "shape", "count"}
    pictures = lambda rs, d: {digest(d / r["images"][0]) for r in rs}  # noqa: E731
    assert not pictures(rows, tmp_path / "a") & pictures(eval_rows, tmp_path / "a")
    answers = {}
    for row in rows:
        pixels = np.asarray(Image.open(tmp_path / "a" / row["images"][0]).convert("RGB"))
        ink = (pixels != BACKGROUND).any(-1)
        colours = {tuple(c) for c in pixels[ink]}
        assert len(colours) == 1  # one colour, no anti-aliasing
        (colour,) = colours
        name = next(n for n, rgb in COLOURS.items() if rgb == colour)
        regions = _regions(ink)
        answer = row["messages"][1]["content"]
        answers.setdefault(row["task"], set()).add(answer)
        if row["task"] == "colour":
            assert answer == name and len(regions) == 1
        elif row["task"] == "count":
            assert answer == str(len(regions))
            for cells in regions:  # each region a filled square
                h, w = np.ptp(cells, axis=0) + 1
                assert h == w and len(cells) == h * w
        else:
            (cells,) = regions
            h, w = np.ptp(cells, axis=0) + 1
            fill = len(cells) / (h * w)  # square 1, circle ~pi/4, triangle ~1/2
            expected = "square" if fill > 0.95 else "circle" if fill > 0.65 else "triangle"
            assert answer == expected, (fill, answer)
    assert answers["count"] == {"1", "2", "3"} and len(answers["shape"]) == 3
