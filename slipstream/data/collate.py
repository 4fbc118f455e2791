"""SFT's collator: tokenized examples -> one packed batch (the builder: data/packed.py).

`labels[t]` is the target of position t: `input_ids[t+1]` when token t+1 is a target of the
same sequence, else -100; `label_positions` are the t with a target, so the model runs its
LM head on those rows only and never has to find them with a boolean mask (a host sync).
`input_ids`, `labels` and `label_positions` are views of one (pinned, when CUDA is present)
host buffer: `Batch.to(device)` is one non-blocking copy for all three plus the `SeqInfo`'s.
Examples with images add their model inputs and `image_rows`, the packed positions their
features fill, built here on the host (data/vision.py `build_with_images`), and, for models whose
image rows attend bidirectionally, the batch's `seq.image_spans`.

Shapes: T = total tokens in the batch, N = labelled positions (`num_labels`).
"""

from __future__ import annotations

from collections.abc import Sequence

from slipstream.data.labels import Example
from slipstream.data.packed import IGNORE_INDEX, PackedBatch, PackedBuilder, target_spans
from slipstream.data.vision import ImageExample, build_with_images

__all__ = ["IGNORE_INDEX", "Batch", "collate"]

Batch = PackedBatch  # SFT's batch is the builder's own, with no fields beside the labels


def collate(examples: Sequence[Example]) -> Batch:
    """Concatenate examples into one packed batch (see module docstring)."""
    if not examples:
        raise ValueError("collate: no examples; a batch needs at least one.")
    builder, start, with_images = PackedBuilder(), 0, []
    for ex in examples:
        if len(ex.input_ids) != len(ex.trainable):
            raise ValueError(
                f"collate: example has {len(ex.input_ids)} ids but {len(ex.trainable)} mask values."
            )
        builder.add(ex.input_ids, target_spans(ex.trainable))
        if isinstance(ex, ImageExample):
            with_images.append((start, ex))
        start += len(ex.input_ids)
    return build_with_images(builder, with_images, examples)
