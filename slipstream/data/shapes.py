"""Pictures of coloured shapes with questions about them, generated from a seed: an offline
image+text task whose answers can be checked (docs/vision.md, benchmarks/vision_shapes.py).

Each picture is `SIZE` x `SIZE` pixels on a light grey background with 1-3 shapes, drawn
with PIL. Three questions, one a row:

- "What colour is the shape?": one shape (square, circle or triangle) of one of `COLOURS`;
  the answer is the colour's name.
- "What shape is it?": one shape of any colour; the answer is `square`, `circle` or
  `triangle`.
- "How many squares are there?": 1-3 squares of one colour, none overlapping; the answer is
  the digit.

Position, size and (for the first two) the other attribute vary at random, so neither the
question nor the shape's place tells the answer. A row is TRL's vision format:
`{"messages": [user: [image part, text part], assistant: answer], "images": ["pics/7.png"]}`
with the picture's path relative to the jsonl file. `write_shapes(folder, ...)` writes
`train.jsonl`, `eval.jsonl` and `pics/`; train and eval come from different seeds.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

SIZE = 56
BACKGROUND = (235, 235, 235)
COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 200, 30),
}
SHAPES = ("square", "circle", "triangle")
QUESTIONS = {
    "colour": "What colour is the shape?",
    "shape": "What shape is it?",
    "count": "How many squares are there?",
}
COUNTS = (1, 2, 3)


def _draw(draw: Any, shape: str, box: tuple[int, int, int, int], fill: tuple) -> None:
    x0, y0, x1, y1 = box
    if shape == "square":
        draw.rectangle(box, fill=fill)
    elif shape == "circle":
        draw.ellipse(box, fill=fill)
    else:
        draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=fill)


def _boxes(rng: random.Random, n: int, low: int, high: int) -> list[tuple[int, int, int, int]]:
    """`n` non-overlapping squares' boxes (sides in [low, high]) inside the picture."""
    while True:
        boxes = []
        for _ in range(n):
            side = rng.randint(low, high)
            x, y = rng.randint(1, SIZE - side - 2), rng.randint(1, SIZE - side - 2)
            boxes.append((x, y, x + side, y + side))
        apart = all(
            a[2] + 2 < b[0] or b[2] + 2 < a[0] or a[3] + 2 < b[1] or b[3] + 2 < a[1]
            for i, a in enumerate(boxes)
            for b in boxes[i + 1 :]
        )
        if apart:
            return boxes


def shape_example(rng: random.Random, task: str) -> tuple[Any, str]:
    """(a PIL picture, its answer) for `task` ("colour", "shape" or "count")."""
    from PIL import Image, ImageDraw

    picture = Image.new("RGB", (SIZE, SIZE), BACKGROUND)
    draw = ImageDraw.Draw(picture)
    colour = rng.choice(sorted(COLOURS))
    if task == "count":
        n = rng.choice(COUNTS)
        for box in _boxes(rng, n, 8, 14):
            _draw(draw, "square", box, COLOURS[colour])
        return picture, str(n)
    shape = rng.choice(SHAPES)
    (box,) = _boxes(rng, 1, 16, 30)
    _draw(draw, shape, box, COLOURS[colour])
    return picture, colour if task == "colour" else shape


def shape_rows(num_rows: int, folder: Path, *, seed: int = 0, prefix: str = "") -> list[dict]:
    """`num_rows` rows (tasks in turn), their pictures saved as `folder/pics/{prefix}{i}.png`."""
    rng = random.Random(seed)
    (folder / "pics").mkdir(parents=True, exist_ok=True)
    rows = []
    tasks = sorted(QUESTIONS)
    for i in range(num_rows):
        task = tasks[i % len(tasks)]
        picture, answer = shape_example(rng, task)
        name = f"pics/{prefix}{i}.png"
        picture.save(folder / name)
        parts = [{"type": "image"}, {"type": "text", "text": QUESTIONS[task]}]
        rows.append({
            "messages": [{"role": "user", "content": parts},
                         {"role": "assistant", "content": answer}],
            "images": [name], "task": task,
        })  # fmt: skip
    return rows


def write_shapes(folder: str | Path, train_rows: int = 1200, eval_rows: int = 150,
                 seed: int = 0) -> tuple[Path, Path]:  # fmt: skip
    """train.jsonl and eval.jsonl (different seeds) and their pictures under `folder`."""
    folder = Path(folder)
    paths = []
    for split, n, s in (("train", train_rows, seed), ("eval", eval_rows, seed + 1)):
        rows = shape_rows(n, folder, seed=s, prefix=f"{split}-")
        path = folder / f"{split}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths.append(path)
    return paths[0], paths[1]
