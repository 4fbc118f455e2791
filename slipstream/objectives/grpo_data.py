"""GRPO's data: prompt rows in, prompt examples out; rolled-out completions packed into the
training micro-batches the loss reads.

Rows have a `prompt` column (a string, or a list of chat messages rendered with the chat
template and its generation prompt, as `slipstream.generate` renders them; a content of
text parts is joined as SFT joins it, data/formats.py) and any other
columns the reward functions read (kept as they are, handed to the rewards per completion).
A prompt over `max_prompt_tokens` is dropped (`data.overlong: drop`, counted) or keeps its
last tokens (`truncate`, TRL's left truncation); a row without a usable prompt is counted
and skipped (fatal with `data.strict`).

Prompts with images (TRL's vision format: `{"type": "image"}` parts taking the row's `images`
list, or inline image parts; data/images.py) under an image-text checkpoint are read by SFT's
image reader: the template's text with each placeholder expanded by the checkpoint's image
processor (data/vision.py `encode_rendered`), kept as the example's `image` (an ImageExample
holding the images' sources, not their pixels). Bad image rows are counted by the image
reader's reasons (image_missing, image_count, remote_image, ...); `image_format` for images
beside a string prompt; `image_part` for image rows under a text checkpoint; an image prompt
over `max_prompt_tokens` is dropped, never cut (`truncate` counts it as `image_truncated`).

A rolled-out micro-batch holds S prompt+completion sequences packed without padding. Only
completion tokens are scored: position t scores token t+1 when t+1 is past the prompt.
Built on the host per scored position (N of them): `advantages`, `scales` (the loss type's
per-token scale, 0 for a masked truncated completion: grpo_loss.token_scales), `mask`
(1 for tokens of unmasked completions), and on the device later `old_logps` (mu > 1) and
`ref_logps` (beta > 0). A micro-batch with image prompts carries each prompt's images once
(`sample_images`): its completions' rows take the same tower features through
`image_feature_index` (data/vision.py `packed_images` with owners).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from slipstream.data.formats import text_content
from slipstream.data.images import has_images, undecoded_images, vision_messages
from slipstream.data.packed import PackedBuilder, PackedView, packed_field
from slipstream.data.rows import DataReport, Encoded, RowError, encode_rows
from slipstream.data.vision import ImageExample, ImageProcessing, build_with_images
from slipstream.objectives.pairs import _template  # the pairs' template_error rule


@dataclass
class PromptExample:
    """One prompt: its token ids, the raw prompt (for the rewards), the row's other columns
    and its row index in the source; `image`: a prompt with images, as an ImageExample of
    `prompt_ids` (its images' sources, sizes and rows)."""

    prompt_ids: list[int]
    prompt: Any
    columns: dict[str, Any]
    row: int
    image: ImageExample | None = None


@dataclass
class PromptBatch:
    """The prompts of one packed batch, before the rollout (host only)."""

    examples: list[PromptExample]

    def to(self, device: Any) -> PromptBatch:
        return self


def check_prompt_column(columns: Sequence[str], source: str = "data") -> None:
    if "prompt" not in columns:
        raise ValueError(
            f"train.objective=grpo needs a 'prompt' column (a string or chat messages); "
            f"{source} has columns {sorted(columns)}"
        )


def _encode(tokenizer: Any, prompt: Any) -> list[int]:
    from slipstream.generation.api import prompt_ids

    if isinstance(prompt, list):
        if not all(isinstance(m, Mapping) and isinstance(m.get("role"), str) for m in prompt):
            raise ValueError("'prompt' messages need a 'role' and 'content' each")
        # Text parts joined as SFT joins them; an image part raises RowError (its own reason).
        prompt = [
            {**m, "content": text_content(m.get("content"), f"'prompt' message {i}")}
            for i, m in enumerate(prompt)
        ]
    return prompt_ids(prompt, tokenizer)


def _encode_image_prompt(side: ImageProcessing, tokenizer: Any, row: Mapping[str, Any]):
    """A prompt with images (module docstring) -> its ImageExample; RowError if bad."""
    prompt = row["prompt"]
    if not isinstance(prompt, list):
        raise RowError("image_format", "images beside a string prompt; give conversational "
                       "prompt messages with image parts")  # fmt: skip
    messages, sources = vision_messages({"messages": prompt, "images": row.get("images")})
    text = _template(tokenizer, messages, {}, True, tokenize=False)
    (ex,) = side.encode_rendered([text], sources, tokenizer)
    return ex


def tokenize_prompts(
    rows: Any,
    tokenizer: Any,
    *,
    max_prompt_tokens: int,
    overlong: str = "drop",
    strict: bool = False,
    first_row: int = 0,
    images: ImageProcessing | None = None,
) -> tuple[list[PromptExample], DataReport]:
    """Prompt rows (a `datasets.Dataset` or list of dicts) -> examples; every skip counted.
    `images`: the checkpoint's image side (data/vision.py), which reads prompts with images."""
    report = DataReport(rows=len(rows), format="prompt")
    if images is not None:  # examples keep datasets.Image cells' bytes, not decoded pixels
        rows = undecoded_images(rows)

    def encode(row: Mapping[str, Any], index: int) -> Encoded:
        prompt = row.get("prompt")
        try:
            if not isinstance(prompt, (str, list)) or not prompt:
                raise ValueError(f"'prompt' is {type(prompt).__name__}, not text or messages")
            image = None
            if row.get("images") or has_images({"messages": prompt}):
                if images is None:
                    raise RowError("image_part", "the prompt has images: they need a vision model")
                image = _encode_image_prompt(images, tokenizer, row)
                ids = image.input_ids
            else:
                ids = _encode(tokenizer, prompt)
        except ValueError as e:
            raise RowError("bad_prompt", str(e)) from None
        if image is not None and len(ids) > max_prompt_tokens and overlong != "drop":
            raise RowError(
                "image_truncated", f"a prompt with images has {len(ids)} tokens, over "
                f"max_prompt_tokens {max_prompt_tokens}; it is never cut",
            )  # fmt: skip
        if len(ids) > max_prompt_tokens:
            if overlong == "drop":
                return Encoded(None, len(ids))
            ids = ids[-max_prompt_tokens:]
            report.truncated += 1
        columns = {k: v for k, v in row.items() if k != "prompt"}
        return Encoded(PromptExample(ids, prompt, columns, index, image), len(ids))

    return encode_rows(rows, encode, report, strict, first_row), report


@dataclass
class Sample:
    """One rolled-out completion of a prompt, as the packer sees it."""

    prompt_ids: list[int]
    completion_ids: list[int]
    advantage: float
    masked: bool  # a truncated completion with mask_truncated_completions
    image: ImageExample | None = None  # the prompt's (PromptExample.image), shared by its G

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


def sample_images(sequences: Sequence[Sample]) -> tuple[list, list, list]:
    """(placed, sequences, owners) of a micro-batch of samples, as data/vision.py's
    `build_with_images` takes them: each prompt's images placed once, at its first sample;
    the other samples of that prompt take the same feature rows (`image_feature_index`: the
    tower runs once a prompt). Qwen-VL: a completion's 3-D positions go on from its prompt's
    largest + 1 (transformers' rope_deltas)."""
    placed, owners, seen, full, start = [], [], {}, [], 0
    for s in sequences:
        ids = s.prompt_ids + s.completion_ids
        if s.image is None:
            full.append(ids)
        else:
            owners.append(seen.setdefault(id(s.image), len(placed)))
            placed.append((start, s.image))  # the prompt's image rows; the completion has none
            full.append(s.image.followed_by_text(len(s.image.input_ids), ids))
        start += len(ids)
    return placed, full, owners


@dataclass(eq=False)
class RolloutBatch(PackedView):
    """S packed prompt+completion sequences (module docstring), a view of the packed batch
    (data/packed.py): `input_ids`, `labels`, `positions`, `seq`, and per scored position
    `advantages`, `scales`, `mask`. Host ints: `num_sequences`, `completion_tokens`
    (unmasked scored tokens), `weight` (the loss type's normaliser share), `metric_scale`
    (weight / completion_tokens: token means logged per weight). Set on the device later:
    `old_logps`, `ref_logps`."""

    num_sequences: int
    completion_tokens: int
    weight: int
    metric_scale: float
    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None

    advantages = packed_field("advantages")
    scales = packed_field("scales")
    mask = packed_field("mask")


def collate_rollouts(sequences: Sequence[Sample], loss_type: str, max_completion: int):
    """Pack sequences into one RolloutBatch (host tensors; `.to(device)` moves them)."""
    from slipstream.objectives.grpo_loss import token_scales

    lengths = [len(s.completion_ids) for s in sequences]
    scales_S, weight = token_scales(lengths, [s.masked for s in sequences], loss_type)
    if loss_type == "dr_grpo":
        weight *= max_completion
    f32 = ("scored", torch.float32)
    builder = PackedBuilder(advantages=f32, scales=f32, mask=f32)
    for s, scale in zip(sequences, scales_S, strict=True):
        full = s.prompt_ids + s.completion_ids  # only the completion's tokens are scored
        builder.add(full, [(len(s.prompt_ids), len(full))], advantages=s.advantage,
                    scales=scale, mask=0.0 if s.masked else 1.0)  # fmt: skip
    tokens = sum(n for n, s in zip(lengths, sequences, strict=True) if not s.masked)
    packed = build_with_images(builder, *sample_images(sequences))
    return RolloutBatch(packed, len(sequences), tokens, weight, weight / max(tokens, 1))


def pack_sequences(lengths: list[int], budget: int, fallback: list[list[int]]) -> list[list[int]]:
    """Sequences (by index) into micro-batches of at most `budget` tokens, best-fit
    decreasing by real length; never more micro-batches than `fallback` (the prompt batches'
    own grouping, which fits by construction)."""
    from slipstream.data import pack_examples

    bins = pack_examples(lengths, budget)
    return bins if len(bins) <= len(fallback) else fallback


def split_to(bins: list[list[int]], count: int) -> list[list[int]]:
    """Split the fullest micro-batches (by sequences) in halves until there are `count`:
    under torchrun every rank runs the same number of micro-batches."""
    bins = [list(b) for b in bins]
    while len(bins) < count:
        i = max(range(len(bins)), key=lambda k: len(bins[k]))
        if len(bins[i]) < 2:
            raise AssertionError("cannot split a one-sequence micro-batch")
        half = len(bins[i]) // 2
        bins[i : i + 1] = [bins[i][:half], bins[i][half:]]
    return bins
