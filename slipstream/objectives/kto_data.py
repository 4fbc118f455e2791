"""KTO data: TRL 1.16's unpaired preference format, tokenized as its `KTOTrainer` tokenizes it,
and packed micro-batches that carry each example's mismatched KL sequence.

Formats (columns):
- unpaired: `prompt`, `completion`, `label` (bool: desirable or not); prompt and completion
  both strings ("standard") or both lists of messages ("conversational");
- paired: `chosen`, `rejected` (and optionally `prompt`; without one the shared prefix is
  the prompt, as for DPO: objectives/pairs.py), converted as TRL's
  `unpair_preference_dataset`: each pair gives (prompt, chosen, True) and (prompt,
  rejected, False).
Optional `tools` and `chat_template_kwargs` reach the chat template.

Tokens, as TRL makes them: standard completions get the eos unless they end with it;
`prompt` alone (conversations: with the generation prompt) and `prompt + completion` are
tokenized, and the completion starts where the two first differ (`common_prefix_length`).
Only completion tokens are scored. Over `max_tokens` an example is dropped
(`data.overlong: drop`) or keeps its start (`truncate`, TRL's truncation); one whose prompt
alone fills `max_tokens` is skipped, as TRL drops it.

The KL estimate (TRL's): in each micro-batch of n examples, example i's KL sequence is its
own prompt followed by the completion of example i-1 (example 0 takes example n-1's), cut to
`max_tokens`: the mismatched pairs TRL builds by rotating completions by one within a batch.
Over a micro-batch the KL sequences hold exactly the prompts and completions of the
examples, so an example takes twice its tokens in the packer (`length`).

Images (an image-text checkpoint's `ImageProcessing`): a row whose conversational prompt has
image parts is read as DPO reads an image pair (objectives/pairs.py
`encode_image_completions`: TRL's vision format, the same counted skips); each example keeps
its sequence as an ImageExample, every image token inside the prompt. Collated, each row's
images are packed once (a pair's two examples share them through `image_feature_index`) and
KL sequence i takes prompt i's features through `kl_image_feature_index`: one copy of the
pixels serves both streams (`_put_images`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from slipstream.data.images import undecoded_images
from slipstream.data.packed import PackedBuilder, PackedView, packed_field
from slipstream.data.rows import DataReport, LengthLimit, RowError, encode_rows, row_columns
from slipstream.data.vision import (
    FEATURE_INDEX,
    MROPE_FIELD,
    ImageExample,
    ImageProcessing,
    image_inputs,
    packed_image_spans,
    packed_images,
    packed_positions_3d,
)
from slipstream.objectives.pairs import (
    _check_field,
    check_images_in_prompt,
    common_prefix,
    encode_image_completions,
    pair_has_images,
    parse_pair_row,
    token_ids,
)
from slipstream.ops.packing import SeqInfo

UNPAIRED = ("prompt", "completion", "label")


@dataclass
class KTOExample:
    """One (prompt, completion) sequence: `ids` with the completion from `prompt_len`. With
    images in the prompt, `images` is the sequence as an ImageExample (its ids are `ids`) and
    `row` the row it came from: a pair's two examples share their prompt's images."""

    ids: list[int]
    prompt_len: int
    desirable: bool
    images: ImageExample | None = None
    row: int = -1

    def __len__(self) -> int:
        return len(self.ids)


@dataclass
class RowExamples:
    """One row's examples (a pair's two, or one), judged together by the length limit: a
    pair with a side over it is cut or dropped whole."""

    examples: list[KTOExample]

    @property
    def prompt_len(self) -> int:
        return max(ex.prompt_len for ex in self.examples)

    def longest(self) -> int:
        return max(len(ex) for ex in self.examples)

    def cut(self, max_tokens: int) -> RowExamples:
        out = []
        for ex in self.examples:  # every image token is in the prompt, which the limit keeps
            images = ex.images.truncated(max_tokens) if ex.images is not None else None
            out.append(replace(ex, ids=ex.ids[:max_tokens], images=images))
        return RowExamples(out)

    def counts(self) -> tuple[int, int]:
        tokens = sum(len(ex) for ex in self.examples)
        return tokens, tokens - sum(ex.prompt_len for ex in self.examples)


def check_kto_columns(columns: Sequence[str], source: str = "data") -> bool:
    """True for paired data, False for unpaired; a one-line error for anything else."""
    if "chosen" in columns and "rejected" in columns:
        return True
    missing = [c for c in UNPAIRED if c not in columns]
    if missing:
        raise ValueError(
            f"train.objective=kto needs unpaired preference data (columns prompt, completion, "
            f"label) or pairs (chosen, rejected); {source} has no {' or '.join(missing)} "
            f"(columns: {sorted(columns)})"
        )
    return False


def _template_kwargs(row: Mapping[str, Any], conversational: bool) -> dict:
    if not conversational:
        return {}
    tools = row.get("tools")
    kwargs = {"tools": json.loads(tools) if isinstance(tools, str) else tools}
    kwargs.update(row.get("chat_template_kwargs") or {})
    return kwargs


def encode_unpaired(
    tokenizer: Any, prompt: Any, completion: Any, desirable: bool, kwargs: dict
) -> KTOExample:
    """The example TRL's KTOTrainer builds from one (prompt, completion, label)."""
    if isinstance(prompt, list) != isinstance(completion, list):
        raise RowError("mixed_formats", "prompt and completion mix strings and messages")
    if not completion:
        raise RowError("empty", "the completion is empty")
    eos = tokenizer.eos_token
    if isinstance(completion, str) and eos and not completion.endswith(eos):
        completion = completion + eos
    prompt_ids = token_ids(tokenizer, prompt, kwargs, generation_prompt=True) if prompt else []
    ids = token_ids(tokenizer, prompt + completion, kwargs)
    prompt_len = common_prefix(prompt_ids, ids)
    if prompt_len == len(ids):
        raise RowError("empty", "the completion has no tokens after the prompt")
    return KTOExample(ids, prompt_len, desirable)


def encode_image_row(
    side: ImageProcessing, tokenizer: Any, row: Mapping[str, Any], paired: bool
) -> list[KTOExample]:
    """A row whose prompt has images: its examples as `encode_kto_row` makes them, the
    prompt's placeholders expanded by the checkpoint's rule (objectives/pairs.py
    `encode_image_completions`, DPO's reader)."""
    if paired:
        prompt, chosen, rejected, kwargs = parse_pair_row(row, None, keep_parts=True)
        completions, labels = {"chosen": chosen, "rejected": rejected}, (True, False)
    else:
        label = _label(row)
        prompt = _check_field(row, "prompt", keep_parts=True)
        completion = _check_field(row, "completion", keep_parts=True)
        if not completion:
            raise RowError("empty", "the completion is empty")
        completions, labels = {"completion": completion}, (label,)
        kwargs = _template_kwargs(row, True)
    if not isinstance(prompt, list):
        raise RowError("image_format", "images beside a string prompt; give conversational "
                       "prompt messages with image parts")  # fmt: skip
    prompt_ids, full = encode_image_completions(side, tokenizer, row, prompt, completions, kwargs)
    out = []
    for ex, desirable in zip(full, labels, strict=True):
        prompt_len = common_prefix(prompt_ids, ex.input_ids)
        check_images_in_prompt(ex, prompt_len)
        out.append(KTOExample(ex.input_ids, prompt_len, desirable, images=ex))
    return out


def _label(row: Mapping[str, Any]) -> bool:
    label = row.get("label")
    if not isinstance(label, bool):
        raise RowError("label", f"'label' is {label!r}; give true (desirable) or false")
    if "prompt" not in row:
        raise RowError("missing_field", "no 'prompt'")
    return label


def encode_kto_row(tokenizer: Any, row: Mapping[str, Any], paired: bool) -> list[KTOExample]:
    """One row's examples: one for an unpaired row, two (chosen, rejected) for a pair."""
    if paired:
        prompt, chosen, rejected, kwargs = parse_pair_row(row, None)
        return [encode_unpaired(tokenizer, prompt, c, d, kwargs)
                for c, d in ((chosen, True), (rejected, False))]  # fmt: skip
    label = _label(row)
    prompt, completion = _check_field(row, "prompt"), _check_field(row, "completion")
    kwargs = _template_kwargs(row, isinstance(completion, list))
    return [encode_unpaired(tokenizer, prompt, completion, label, kwargs)]


def tokenize_kto(
    rows: Any,
    tokenizer: Any,
    *,
    max_tokens: int,
    overlong: str = "drop",
    strict: bool = False,
    first_row: int = 0,
    images: ImageProcessing | None = None,
) -> tuple[list[KTOExample], DataReport]:
    """Rows (a `datasets.Dataset` or list of dicts) to examples, a pair's two in turn; every
    skip counted (a pair with a side over the limit is dropped whole). `images`: the
    checkpoint's image side (data/vision.py), which reads rows whose prompt has images."""
    paired = check_kto_columns(row_columns(rows))
    report, limit = DataReport(rows=len(rows)), LengthLimit(max_tokens, overlong)
    if images is not None:  # examples keep datasets.Image cells' bytes, not decoded pixels
        rows = undecoded_images(rows)
    fields = ("prompt", "chosen", "rejected") if paired else ("prompt", "completion")

    def encode(row: Mapping[str, Any], index: int):  # -> rows.Encoded
        row = {k: v for k, v in row.items() if v is not None}
        if images is not None and pair_has_images(row, fields):
            found = encode_image_row(images, tokenizer, row, paired)
            out = RowExamples([replace(ex, row=index) for ex in found])
        elif row.get("images"):
            raise RowError("image_part", "the row has images: image rows need a vision model")
        else:
            out = RowExamples(encode_kto_row(tokenizer, row, paired))
        limit.check_prompt(out.prompt_len)  # a KL sequence needs its prompt: even under drop
        return limit.encoded(out, report)

    rows_out = encode_rows(rows, encode, report, strict, first_row)
    examples = [ex for row in rows_out for ex in row.examples]
    report.kept = len(examples)  # examples, two a pair
    if not examples:
        raise ValueError(f"no usable KTO examples: {report.summary()}")
    return examples, report


def kl_sequences(examples: Sequence[KTOExample], max_tokens: int) -> list[KTOExample]:
    """Example i's prompt with example i-1's completion (module docstring), cut to max_tokens;
    with images, prompt i's (`ImageExample.followed_by_text`)."""
    out = []
    for i, ex in enumerate(examples):
        prev = examples[i - 1]
        ids = (ex.ids[: ex.prompt_len] + prev.ids[prev.prompt_len :])[:max_tokens]
        images = None if ex.images is None else ex.images.followed_by_text(ex.prompt_len, ids)
        out.append(KTOExample(ids, ex.prompt_len, ex.desirable, images, ex.row))
    return out


@dataclass(eq=False)
class Stream:
    """Packed sequences with their scored positions: `input_ids`, `labels` (T,), `seq`;
    `positions` (N,) ascending; `segments` (N,) each position's sequence index; `images`
    the stream's image inputs (data/vision.py `image_inputs`) or None."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    seq: SeqInfo
    positions: torch.Tensor
    segments: torch.Tensor
    images: dict[str, Any] | None = None


def _add_stream(builder: PackedBuilder, examples: Sequence[KTOExample]) -> None:
    for s, ex in enumerate(examples):  # the completion's tokens are scored
        builder.add(ex.ids, [(ex.prompt_len, len(ex.ids))], segments=s)


KL_FIELDS = ("input_ids", "labels", "label_positions", "segments")


@dataclass(eq=False)
class KTOBatch(PackedView):
    """n examples packed (data/packed.py: `input_ids`, `labels`, `positions`, `seq`;
    `segments` each scored position's example; `desirable` (n,) float 1/0) and, when the
    loss estimates the KL term, their n KL sequences as one more stream in the same buffer
    (`kl`, with its own SeqInfo `kl_seq`). Host int: `num_examples`."""

    num_examples: int
    kl_seq: SeqInfo | None = None

    segments = packed_field("segments")
    desirable = packed_field("desirable")

    @property
    def main(self) -> Stream:
        images = image_inputs(self.packed.fields)
        return Stream(self.input_ids, self.labels, self.seq, self.positions, self.segments, images)

    @property
    def kl(self) -> Stream | None:
        if self.kl_seq is None:
            return None
        f = self.packed.fields
        images = image_inputs(f)
        if images is not None:  # the examples' image inputs, the KL sequences' rows
            for name in KL_IMAGE_FIELDS:
                images.pop(name, None)
                if f"kl_{name}" in f:
                    images[name] = f[f"kl_{name}"]
        return Stream(f["kl_input_ids"], f["kl_labels"], self.kl_seq, f["kl_label_positions"],
                      f["kl_segments"], images)  # fmt: skip

    def to(self, device: torch.device | str) -> KTOBatch:
        kl_seq = self.kl_seq.to(device) if self.kl_seq is not None else None
        return replace(self, packed=self.packed.to(device), kl_seq=kl_seq)


def collate_kto(examples: Sequence[KTOExample], *, with_kl: bool, max_tokens: int) -> KTOBatch:
    """Pack examples (and their KL sequences, module docstring) into one batch: one host
    buffer, one copy to the device (plus a SeqInfo's for each stream)."""
    if not examples:
        raise ValueError("collate_kto: no examples; a batch needs at least one.")
    builder = PackedBuilder(segments=("scored", torch.int64))
    _add_stream(builder, examples)
    builder.put("desirable", torch.tensor([float(ex.desirable) for ex in examples]))
    kl_seq, kl_examples = None, []
    if with_kl:
        kl_examples = kl_sequences(examples, max_tokens)
        kl_builder = PackedBuilder(segments=("scored", torch.int64))
        _add_stream(kl_builder, kl_examples)
        kl = kl_builder.build()
        for name in KL_FIELDS:
            builder.put(f"kl_{name}", getattr(kl, name) if name != "segments" else
                        kl.fields["segments"])  # fmt: skip
        kl_seq = kl.seq
    spans = ((), ())
    if any(ex.images is not None for ex in examples):
        spans = _put_images(builder, examples, kl_examples)
    batch = builder.build()
    batch.seq.image_spans = spans[0]  # Gemma 3: each image's rows see one another
    if kl_seq is not None:
        kl_seq.image_spans = spans[1]
    return KTOBatch(batch, len(examples), kl_seq)


# The image fields a KL stream has its own of (`kl_` + name): which packed rows take which
# features, and Qwen-VL's 3-D positions; the model inputs are the examples'.
KL_IMAGE_FIELDS = ("image_rows", FEATURE_INDEX, MROPE_FIELD)


def _put_images(
    builder: PackedBuilder, examples: Sequence[KTOExample], kl_examples: Sequence[KTOExample]
) -> tuple[tuple, tuple]:
    """The batch's images, once a row: a pair's two examples (the same row, the same image
    sources) share their prompt's (the second owned by the first, `packed_images`), and KL
    sequence i takes the features of prompt i through `kl_image_feature_index`. -> the
    (examples', KL sequences') image spans (Gemma 3)."""
    owner_of: dict[int, int] = {}  # row -> its first entry in `placed`
    placed, owners, owned = [], [], []  # owned: each example's entry, or None
    start = 0
    for ex in examples:
        owned.append(None)
        if ex.images is not None:
            owner = owner_of.get(ex.row)  # rows of two data sources may share a number
            if owner is None or placed[owner][1].sources != ex.images.sources:
                owner = owner_of[ex.row] = len(placed)
            owned[-1] = owner
            owners.append(owner)
            placed.append((start, ex.images))
        start += len(ex)
    kl_placed, start = [], 0
    for kl, entry in zip(kl_examples, owned, strict=True) if kl_examples else ():
        if entry is not None:  # prompt i's images, placed at the KL sequence's rows
            owners.append(entry)
            kl_placed.append((start, kl.images))
        start += len(kl)
    fields = packed_images(placed + kl_placed, owners)
    rows = fields.pop("image_rows")
    index = fields.pop(FEATURE_INDEX, torch.arange(rows.numel()))
    R = sum(len(ex.feature_rows()) for _, ex in placed)
    for name, tensor in fields.items():  # model inputs and tower metadata, shared
        builder.put(name, tensor)
    builder.put("image_rows", rows[:R])
    if owners[: len(placed)] != list(range(len(placed))):  # a pair's prompt once
        builder.put(FEATURE_INDEX, index[:R].clone())
    for prefix, stream in (("", examples), ("kl_", kl_examples)):
        positions = (
            packed_positions_3d([ex.ids if ex.images is None else ex.images for ex in stream])
            if stream
            else None
        )
        if positions is not None:
            builder.put(prefix + MROPE_FIELD, positions)
    if kl_placed:
        builder.put("kl_image_rows", rows[R:].clone())
        builder.put(f"kl_{FEATURE_INDEX}", index[R:].clone())
    return packed_image_spans(placed), packed_image_spans(kl_placed)
