"""The image side of the memory probe: the worst-case image micro-batch of an image-text
checkpoint, as the meta step (memory/probe.py) runs it.

A micro-batch of `train.tokens_per_batch` positions holds the most tower work when its
positions are image tokens of the largest pictures that fit: per image token the tower sees a
fixed number of patches (Qwen-VL: merge^2; LLaVA, Gemma 3: a fixed grid an image), so larger
images add the fewest non-image tokens. The probe takes a square picture of `SIDE` px (a
large photo; the checkpoint's image processor resizes it as it would a real one), halved until
one image fits, repeated as often as it fits, and the rest of the micro-batch text.

The picture goes through the data pipeline a real row takes (data/vision.py: the image
processor, the image-token sequence, the tower's host-built metadata, the 3-D positions, the
bidirectional spans); its pixels are moved to the meta device before the micro-batch's copies
are concatenated, so a 100k-token probe holds no pixel memory.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

SIDE = 1024  # px: the square picture the worst case assumes (halved until one image fits)


@dataclass
class ImageBatch:
    """A meta-device micro-batch with images: what `model.loss` takes, and what it assumed."""

    ids: torch.Tensor  # (T,) int64
    seq: Any  # SeqInfo (with Gemma's image spans)
    images: dict[str, Any]  # the model's image inputs (data/vision.py image_inputs)
    note: str

    def tensors(self) -> list[torch.Tensor]:
        """The image inputs' tensors, a SeqInfo's own included (what the step holds)."""
        out = []
        for v in self.images.values():
            out += [v] if isinstance(v, torch.Tensor) else [
                t for t in vars(v).values() if isinstance(t, torch.Tensor)]  # fmt: skip
        return out


def image_side(path: str) -> tuple[Any, Any] | None:
    """(the checkpoint's ImageProcessing, its tokenizer), or None for a text-only one."""
    from slipstream.checkpoint.tokenizer import load_tokenizer
    from slipstream.data.vision import ImageProcessing

    tokenizer = load_tokenizer(path)
    side = ImageProcessing.from_model(path, tokenizer)
    return None if side is None else (side, tokenizer)


def one_image(side: Any, tokenizer: Any, tokens: int):
    """An ImageExample of one square picture (SIDE px, halved until it fits `tokens`), or
    None when none fits (the real run could not hold an image either)."""
    from PIL import Image

    px = SIDE
    while px >= 16:
        prompt = [
            {"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (px, px))}]}
        ]
        ex = side.encode_prompt(prompt, tokenizer)
        if len(ex.input_ids) <= tokens:
            return ex
        px //= 2
    return None


def worst_case_batch(
    side: Any, tokenizer: Any, tokens: int, device: str = "meta"
) -> ImageBatch | None:
    """The micro-batch of `tokens` positions filled with copies of `one_image` (module
    docstring), on the meta device (or, to measure it for real, `device` with its pixels);
    None when no image fits."""
    from slipstream.data.labels import Example
    from slipstream.data.vision import image_fields, image_inputs
    from slipstream.ops.packing import SeqInfo

    ex = one_image(side, tokenizer, tokens)
    if ex is None:
        return None
    # The image's own tokens only (the prompt's template tokens cut), its pixels on meta before
    # the copies are concatenated (module docstring); the ints the host-built metadata reads
    # (grids, sizes, masks, positions) stay on the host.
    spans = ex.image_spans()
    a, b = spans[0][0], spans[-1][1]
    pixels = {k: v.to(device) if v.is_floating_point() else v for k, v in ex.images.items()}
    cut = None if ex.positions_3d is None else [p[a:b] for p in ex.positions_3d]
    ex = dataclasses.replace(ex, input_ids=ex.input_ids[a:b], trainable=ex.trainable[a:b],
                             positions_3d=cut, images=pixels)  # fmt: skip
    n, copies = len(ex.input_ids), tokens // len(ex.input_ids)
    examples: list[Any] = [ex] * copies
    if tokens > n * copies:
        rest = tokens - n * copies
        examples.append(Example([0] * rest, [True] * rest))
    fields, spans = image_fields([(i * n, ex) for i in range(copies)], examples)
    # One sequence: the decoder's memory does not depend on where sequences end (flash
    # attention), and the meta step makes one attention call a layer, not one per image.
    seq = SeqInfo.from_lengths([tokens])
    seq.image_spans = spans
    images = {k: v.to(device) for k, v in image_inputs(fields).items()}
    ids = torch.tensor([i for e in examples for i in e.input_ids], dtype=torch.int64)
    h, w = ex.sizes[0]
    rows = ex.image_tokens[0]
    note = (
        f"image side: the {tokens:,}-token micro-batch probed as {copies} images of {w}x{h} px "
        f"({rows:,} image tokens each; the worst case: a {SIDE}-px square picture resized by "
        f"the image processor, repeated as often as it fits) and {tokens - copies * rows:,} "
        "text tokens"
    )
    return ImageBatch(ids.to(device), seq.to(device), images, note)
