"""Prompts with images for `slipstream.generate`: chat messages whose content holds image
parts (TRL's format, inline values: data/images.py) are encoded by the checkpoint's image
processor (data/vision.py) and their image inputs packed in the prefill's layout (the prompts
one after another), so the prefill writes the features into their rows as training does."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def image_prompts(model: Any, prompts: Sequence[Any], tokenizer: Any) -> dict[int, Any]:
    """{prompt index: data.vision.ImageExample} of the chat prompts with image parts; a
    one-line ValueError when the model takes no images or a prompt's images are bad."""
    from slipstream.data.images import has_images
    from slipstream.data.rows import RowError
    from slipstream.data.vision import ImageProcessing

    indices = [
        i
        for i, p in enumerate(prompts)
        if isinstance(p, list) and p and all(isinstance(m, dict) for m in p)
        and has_images({"messages": p})
    ]  # fmt: skip
    if not indices:
        return {}
    folder = getattr(model, "checkpoint_path", None)
    side = ImageProcessing.from_model(str(folder), tokenizer) if folder is not None else None
    if side is None or not hasattr(model, "image_features"):
        raise ValueError(
            f"prompt {indices[0]} has images but the model takes none (no image processor "
            "files beside its checkpoint, or a text-only model)"
        )
    examples = {}
    for i in indices:
        try:
            examples[i] = side.encode_prompt(prompts[i], tokenizer)
        except RowError as e:
            raise ValueError(f"prompt {i}: {e.reason}: {e.detail}") from None
    return examples


def packed_prompt_images(examples: dict, lengths: Sequence[int]) -> dict | None:
    """The image inputs of the prompts in `examples` (index -> ImageExample) in the layout of
    all prompts packed in order (`lengths`), or None when none has images."""
    from slipstream.data.vision import packed_images

    if not examples:
        return None
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return packed_images([(starts[i], ex) for i, ex in sorted(examples.items())])
