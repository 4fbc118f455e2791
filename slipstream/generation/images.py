"""Prompts with images for `slipstream.generate`: chat messages whose content holds image
parts (TRL's format, inline values: data/images.py) are encoded by the checkpoint's image
processor (data/vision.py) and their image inputs packed in the prefill's layout (the prompts
one after another), so the prefill writes the features into their rows as training does."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

SPANS_KEY = "image_spans"  # the prefill's SeqInfo.image_spans, beside the image tensors
# Qwen-VL: per prompt, where decoding's positions continue past its prompt length (host ints).
OFFSETS_KEY = "position_offsets"
# Per prompt with images: its own model inputs and token types (transformers' `generate`,
# for models whose layers slipstream's KV cache cannot hold: generation/hf_engine.py).
PROMPTS_KEY = "prompt_images"
HOST_KEYS = (SPANS_KEY, OFFSETS_KEY, PROMPTS_KEY)


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
    all prompts packed in order (`lengths`), or None when none has images; `SPANS_KEY`: the
    host spans whose rows attend bidirectionally (Gemma 3), for the prefill's SeqInfo;
    Qwen-VL's 3-D positions (`mrope_position_ids`) and `OFFSETS_KEY`, host ints per prompt:
    decode position minus cache position (0 for a text prompt)."""
    import torch

    from slipstream.data.vision import MROPE_FIELD, packed_image_spans, packed_images

    if not examples:
        return None
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    placed = [(starts[i], ex) for i, ex in sorted(examples.items())]
    out = packed_images(placed)
    out[PROMPTS_KEY] = {i: (ex.model_inputs(), ex.image_token_id) for i, ex in examples.items()}
    if spans := packed_image_spans(placed):  # host ints, for the prefill's SeqInfo
        out[SPANS_KEY] = spans
    if any(ex.positions_3d for ex in examples.values()):  # Qwen-VL: 3-D prompt positions
        mine = {i: ex.positions_3d for i, ex in examples.items() if ex.positions_3d}
        parts = [torch.tensor(mine[i]) if i in mine else torch.arange(n).expand(3, -1)
                 for i, n in enumerate(lengths)]  # fmt: skip
        out[MROPE_FIELD] = torch.cat(parts, dim=1).to(torch.int64)
        # Decoding goes on from the prompt's largest position + 1, as transformers' rope_deltas.
        out[OFFSETS_KEY] = tuple(
            max(map(max, mine[i])) + 1 - n if i in mine else 0 for i, n in enumerate(lengths)
        )
    return out
