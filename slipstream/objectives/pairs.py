"""Preference pairs: TRL's data formats, tokenized as TRL's `DPOTrainer` (1.16) tokenizes them,
and packed as one example of two sequences.

Formats (columns): `chosen` and `rejected`, with `prompt` (explicit prompt) or without it
(implicit: chosen and rejected are whole texts or conversations sharing a prefix, which
becomes the prompt as TRL's `extract_prompt` finds it: the common prefix by characters for
strings, backing off one character when that is a space, by whole messages for
conversations). Each field is a string ("standard") or a list of {"role", "content"}
messages ("conversational"; a message's content may be a list of text parts, joined as
SFT joins them: data/formats.py), one kind a row. Optional `tools` and `chat_template_kwargs`
columns reach the chat template, as in TRL.

Tokens, as TRL makes them:
- standard: the eos token's text is appended to chosen and rejected unless they end with it;
  `tokenizer(prompt)` and `tokenizer(prompt + chosen)` (special tokens such as a BOS included);
- conversational: the chat template of the prompt with the generation prompt, and of
  prompt + chosen (the completion keeps whatever the template puts after the reply);
- the prompt is the common prefix of the prompt's ids and both full sequences' ids (a
  template or merge that changes the prompt's last tokens moves the boundary back, as in
  TRL); the completion is the rest of each sequence, and only completion tokens are scored.
- a sequence over `max_tokens` is dropped (`overlong: drop`) or keeps its start (`truncate`,
  TRL's `keep_start`); a pair whose prompt alone fills `max_tokens` is skipped.

A row missing a field, with a field of the wrong type, chosen equal to rejected, an empty
completion or a template error is counted under its reason and skipped (fatal with
`strict`), as SFT rows are.

Images (with an image-text checkpoint's `ImageProcessing`, data/vision.py): a conversational
pair whose prompt has image parts, `{"type": "image"}` taking the row's `images` in order or
inline values, as SFT's reader takes them (data/images.py `vision_messages`). The three texts
(prompt with the generation prompt, prompt + chosen, prompt + rejected) are rendered by the
chat template, their placeholders expanded to each image's token sequence by the checkpoint's
rule and tokenized (`ImageProcessing.encode_rendered`); the prompt length is their common
prefix as above, and every image token must lie inside it, so only completion tokens are
scored and a `truncate` cut never reaches an image. The pair keeps both sequences as
`ImageExample`s that share the prompt's image sources (no pixels: processed per batch, as in
SFT). Skipped and counted as SFT counts image rows (`image_count`, `image_missing`,
`image_unreadable`, `remote_image`, `unsupported_part`), plus `image_format` (images beside
a standard pair of strings) and `completion_image` (an image part in chosen or rejected: a
pair's images belong to its prompt); a row with images under a text checkpoint is
`image_part`.

Collated, a micro-batch of P pairs is 2P packed sequences, chosen then rejected of each pair
(sequence 2i is pair i's chosen, 2i+1 its rejected), with the scored positions and each
one's sequence index built on the host. A pair with images adds the prompt's images once
(`packed_images` with the rejected sequence owned by the chosen: one tower pass a pair, both
sequences' image rows gather the same features through `image_feature_index`), each
sequence's 3-D positions (Qwen-VL) and image spans (Gemma), as SFT's collator does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from slipstream.data.formats import text_content
from slipstream.data.images import has_images, undecoded_images, vision_messages
from slipstream.data.packed import PackedBuilder, PackedView, PerSpan, packed_field, target_spans
from slipstream.data.rows import DataReport, Encoded, LengthLimit, RowError, encode_rows
from slipstream.data.vision import ImageExample, ImageProcessing, build_with_images

PAIR_COLUMNS = ("chosen", "rejected")


@dataclass
class PairExample:
    """One pair: the two token sequences (prompt + completion) and the prompt's length,
    which is the same in both (the completion starts at `prompt_len`). A pair whose prompt
    has images keeps both sequences as ImageExamples (`images`: chosen's, rejected's; their
    ids are `chosen` and `rejected`) that share the prompt's images."""

    chosen: list[int]
    rejected: list[int]
    prompt_len: int
    ref: tuple[float, float] | None = None  # reference log-probs, when precomputed
    images: tuple[ImageExample, ImageExample] | None = None

    def __len__(self) -> int:
        return len(self.chosen) + len(self.rejected)

    def longest(self) -> int:
        return max(len(self.chosen), len(self.rejected))

    def cut(self, max_tokens: int) -> PairExample:
        if self.images is None:
            cut = self.chosen[:max_tokens], self.rejected[:max_tokens]
            return PairExample(*cut, self.prompt_len)
        # Every image token is in the prompt, which the limit keeps whole (LengthLimit).
        c, r = (ex.truncated(max_tokens) for ex in self.images)
        return PairExample(c.input_ids, r.input_ids, self.prompt_len, images=(c, r))

    def counts(self) -> tuple[int, int]:
        return len(self), len(self) - 2 * self.prompt_len


def check_pair_columns(columns: Sequence[str], objective: str, source: str = "data") -> None:
    """A one-line error when the data has no `chosen`/`rejected` columns (e.g. SFT data)."""
    missing = [c for c in PAIR_COLUMNS if c not in columns]
    if missing:
        raise ValueError(
            f"train.objective={objective} needs preference data with columns chosen, rejected "
            f"(and optionally prompt); {source} has no {' or '.join(missing)} "
            f"(columns: {sorted(columns)}). Use train.objective=sft for this data."
        )


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], Mapping)


def _check_field(row: Mapping[str, Any], key: str, keep_parts: bool = False) -> Any:
    """A field checked: a string, or messages with their text parts joined (`keep_parts`:
    content lists kept as they are, for the image reader)."""
    value = row.get(key)
    if value is None:
        raise RowError("missing_field", f"no {key!r}")
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        messages = []
        for i, m in enumerate(value):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
                raise RowError("wrong_type", f"{key!r} message {i} has no 'role' string")
            if not isinstance(m.get("content"), (str, list)):
                raise RowError("wrong_type", f"{key!r} message {i} has no 'content' string")
            if keep_parts:
                messages.append(dict(m))
                continue
            try:  # text parts joined (data/formats.py); an image part is its own skip reason
                messages.append({**m, "content": text_content(m["content"], f"message {i}")})
            except RowError as e:
                raise RowError(e.reason, f"{key!r} {e.detail}") from None
        return messages
    raise RowError("wrong_type", f"{key!r} is {type(value).__name__}, expected str or list")


def extract_prompt(chosen: Any, rejected: Any) -> tuple[Any, Any, Any]:
    """(prompt, chosen, rejected) from an implicit-prompt pair, as TRL's `extract_prompt`:
    the prefix up to the first difference (by character or by message)."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":  # the space goes with the completion
                idx -= 1
            break
    # No difference within the shorter one: TRL's loop leaves idx at its last value.
    return chosen[:idx], chosen[idx:], rejected[idx:]


def parse_pair_row(
    row: Mapping[str, Any], eos_token: str | None, keep_parts: bool = False
) -> tuple[Any, Any, Any, dict]:
    """(prompt, chosen, rejected, template kwargs) of one row, checked; RowError if bad.
    `keep_parts`: messages keep their content parts (an image pair, `encode_image_pair`)."""
    chosen, rejected = (_check_field(row, k, keep_parts) for k in PAIR_COLUMNS)
    if "prompt" in row:
        prompt = _check_field(row, "prompt", keep_parts)
    else:
        if type(chosen) is not type(rejected):
            raise RowError("mixed_formats", "chosen and rejected are of different kinds")
        prompt, chosen, rejected = extract_prompt(chosen, rejected)
    conversational = [_is_messages(v) for v in (prompt, chosen, rejected) if v]
    if isinstance(prompt, list) != isinstance(chosen, list) or len(set(conversational)) > 1:
        raise RowError("mixed_formats", "prompt, chosen and rejected mix strings and messages")
    if chosen == rejected:
        raise RowError("identical", "chosen equals rejected")
    if not chosen or not rejected:
        raise RowError("empty", "chosen or rejected is empty")
    kwargs: dict[str, Any] = {}
    if isinstance(chosen, list):
        tools = row.get("tools")
        kwargs = {"tools": json.loads(tools) if isinstance(tools, str) else tools}
        kwargs.update(row.get("chat_template_kwargs") or {})
    elif eos_token:
        chosen = chosen if chosen.endswith(eos_token) else chosen + eos_token
        rejected = rejected if rejected.endswith(eos_token) else rejected + eos_token
    return prompt, chosen, rejected, kwargs


def token_ids(
    tokenizer: Any, content: Any, kwargs: dict, generation_prompt: bool = False
) -> list[int]:
    """A text's ids (`tokenizer(text)`, special tokens included) or a conversation's through
    the chat template, as TRL's `_tokenize`; a template's error is RowError template_error."""
    if isinstance(content, str):
        return list(tokenizer(text=content)["input_ids"])
    out = _template(tokenizer, content, kwargs, generation_prompt, tokenize=True)
    return list(out["input_ids"])


def _template(tokenizer: Any, messages: list, kwargs: dict, generation_prompt: bool,
              tokenize: bool) -> Any:  # fmt: skip
    """The chat template over `messages` (its ids, or its text); RowError template_error."""
    try:
        return tokenizer.apply_chat_template(
            messages,
            tokenize=tokenize,
            return_dict=tokenize,
            add_generation_prompt=generation_prompt,
            **kwargs,
        )
    except Exception as e:  # jinja's errors for roles or fields a template does not allow
        if "Template" not in type(e).__name__ and type(e).__name__ != "UndefinedError":
            raise
        first_line = str(e).splitlines()[0] if str(e) else repr(e)
        raise RowError("template_error", first_line) from None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def encode_pair(tokenizer: Any, row: Mapping[str, Any]) -> PairExample:
    """The pair's token sequences as TRL's DPOTrainer builds them (module docstring)."""
    prompt, chosen, rejected, kwargs = parse_pair_row(row, tokenizer.eos_token)
    prompt_ids = token_ids(tokenizer, prompt, kwargs, generation_prompt=True) if prompt else []
    chosen_ids = token_ids(tokenizer, prompt + chosen, kwargs)
    rejected_ids = token_ids(tokenizer, prompt + rejected, kwargs)
    prompt_len = min(common_prefix(prompt_ids, chosen_ids), common_prefix(prompt_ids, rejected_ids))
    if prompt_len == len(chosen_ids) or prompt_len == len(rejected_ids):
        raise RowError("empty", "chosen or rejected has no tokens after the prompt")
    return PairExample(chosen_ids, rejected_ids, prompt_len)


def pair_has_images(
    row: Mapping[str, Any], keys: Sequence[str] = ("prompt", *PAIR_COLUMNS)
) -> bool:
    """Whether a row carries images: a non-empty `images` column or an image part in one of
    its message fields `keys` (KTO's: prompt, completion)."""
    return bool(row.get("images")) or any(has_images({"messages": row.get(k)}) for k in keys)


def _completion_text(messages: list[dict], key: str) -> list[dict]:
    """Chosen's or rejected's messages with their text parts joined; RowError
    completion_image for an image part (a pair's images belong to its prompt)."""
    out = []
    for i, m in enumerate(messages):
        try:
            out.append({**m, "content": text_content(m["content"], f"message {i}")})
        except RowError as e:
            if e.reason != "image_part":
                raise RowError(e.reason, f"{key!r} {e.detail}") from None
            raise RowError(
                "completion_image", f"{key!r} message {i} has an image; put a row's images "
                "in its prompt"
            ) from None  # fmt: skip
    return out


def encode_image_completions(
    side: ImageProcessing,
    tokenizer: Any,
    row: Mapping[str, Any],
    prompt: Any,
    completions: Mapping[str, Any],
    kwargs: dict,
) -> tuple[list[int], list[ImageExample]]:
    """(the prompt's ids, prompt + each completion as an ImageExample) of a row whose prompt
    has images (module docstring): the template's texts with each image's token sequence in
    place of its placeholder, all sharing the row's images. `completions`: field name ->
    messages (a pair's chosen and rejected, KTO's completion); RowError image_format when
    they are strings, completion_image when they hold an image."""
    if not all(isinstance(c, list) for c in completions.values()):
        raise RowError(
            "image_format", "images beside string completions; give conversational prompt "
            "messages with image parts"
        )  # fmt: skip
    replies = [_completion_text(c, key) for key, c in completions.items()]
    messages, sources = vision_messages({"messages": prompt, "images": row.get("images")})
    texts = [_template(tokenizer, messages, kwargs, True, tokenize=False)]
    texts += [_template(tokenizer, messages + c, kwargs, False, tokenize=False) for c in replies]
    prompt_ex, *full = side.encode_rendered(texts, sources, tokenizer)
    return prompt_ex.input_ids, full


def check_images_in_prompt(ex: ImageExample, prompt_len: int) -> None:
    """RowError when an image token lies past the prompt (only completions are scored)."""
    if prompt_len == len(ex.input_ids):
        raise RowError("empty", "the completion has no tokens after the prompt")
    rows = ex.feature_rows()
    if rows and rows[-1] >= prompt_len:
        raise RowError("template_error", "the template puts an image after the shared prompt")


def encode_image_pair(side: ImageProcessing, tokenizer: Any, row: Mapping[str, Any]) -> PairExample:
    """A pair whose prompt has images (module docstring), as TRL's DPOTrainer tokenizes a
    vision pair."""
    prompt, chosen, rejected, kwargs = parse_pair_row(row, tokenizer.eos_token, keep_parts=True)
    prompt_ids, (c, r) = encode_image_completions(
        side, tokenizer, row, prompt, {"chosen": chosen, "rejected": rejected}, kwargs
    )
    prompt_len = min(common_prefix(prompt_ids, c.input_ids), common_prefix(prompt_ids, r.input_ids))
    for ex in (c, r):
        check_images_in_prompt(ex, prompt_len)
    return PairExample(c.input_ids, r.input_ids, prompt_len, images=(c, r))


def tokenize_pairs(
    rows: Any,
    tokenizer: Any,
    *,
    max_tokens: int,
    overlong: str = "drop",
    strict: bool = False,
    first_row: int = 0,
    images: ImageProcessing | None = None,
) -> tuple[list[PairExample], DataReport]:
    """Tokenize preference rows (a `datasets.Dataset` or list of dicts); every skip counted.
    `images`: the checkpoint's image side (data/vision.py), which reads pairs with images."""
    report, limit = DataReport(rows=len(rows)), LengthLimit(max_tokens, overlong)
    if images is not None:  # examples keep datasets.Image cells' bytes, not decoded pixels
        rows = undecoded_images(rows)

    def encode(row: Mapping[str, Any], index: int) -> Encoded:
        row = {k: v for k, v in row.items() if v is not None or k in PAIR_COLUMNS}
        if images is not None and pair_has_images(row):
            return limit.encoded(encode_image_pair(images, tokenizer, row), report)
        if row.get("images"):
            raise RowError("image_part", "the row has images: image pairs need a vision model")
        return limit.encoded(encode_pair(tokenizer, row), report)

    examples = encode_rows(rows, encode, report, strict, first_row)
    if not examples:
        raise ValueError(f"no usable preference pairs: {report.summary()}")
    return examples, report


@dataclass(eq=False)
class PairBatch(PackedView):
    """P pairs packed as 2P sequences (chosen, rejected, chosen, ...), a view of the packed
    batch (data/packed.py): `input_ids`, `labels`, `positions` (the scored positions),
    `seq`; `segments` (N,) each scored position's slot: its sequence index for completion
    tokens, 2P + i for pair i's chosen prompt tokens (scored only when `score_prompt`:
    ORPO's NLL covers the prompt); `completion_tokens` (2P,) float; `ref_logps` (2P,) when
    precomputed. Host ints: `num_pairs`, `num_chosen_tokens` (targets in the chosen
    sequences, ORPO's NLL count)."""

    num_pairs: int
    num_chosen_tokens: int

    segments = packed_field("segments")
    completion_tokens = packed_field("completion_tokens")
    ref_logps = packed_field("ref_logps", optional=True)


def collate_pairs(
    examples: Sequence[PairExample],
    *,
    score_prompt: bool = False,
    ref_logps: Sequence[tuple[float, float]] | None = None,
) -> PairBatch:
    """Pack pairs into one batch (see PairBatch); `ref_logps` per pair when precomputed."""
    if not examples:
        raise ValueError("collate_pairs: no pairs; a batch needs at least one.")
    P = len(examples)
    fields = dict(segments=("scored", torch.int64), completion_tokens=("sequence", torch.float32))
    if ref_logps is not None:
        fields["ref_logps"] = ("sequence", torch.float32)
    builder = PackedBuilder(**fields)
    num_chosen, start = 0, 0
    placed, owners, sequences = [], [], []  # the image sequences, (start, ImageExample) each
    for i, ex in enumerate(examples):
        for j, seq_ids in enumerate((ex.chosen, ex.rejected)):
            p, n, prompt = ex.prompt_len, len(seq_ids), score_prompt and j == 0
            extra = {"ref_logps": ref_logps[i][j]} if ref_logps is not None else {}
            # ORPO's prompt tokens, an image's own tokens left out (never targets)
            spans = _prompt_spans(ex) if prompt else []
            scored = builder.add(
                seq_ids, [*spans, (p, n)],
                segments=PerSpan((*[2 * P + i] * len(spans), 2 * i + j)),
                completion_tokens=float(n - p), **extra,
            )  # fmt: skip
            num_chosen += scored if j == 0 else 0
            if ex.images is not None:  # the rejected's images are its chosen's
                owners.append(len(placed) - j)
                placed.append((start, ex.images[j]))
            sequences.append(ex.images[j] if ex.images is not None else seq_ids)
            start += n
    return PairBatch(build_with_images(builder, placed, sequences, owners), P, num_chosen)


def _prompt_spans(ex: PairExample) -> list[tuple[int, int]]:
    """The chosen prompt's scored spans (ORPO): every prompt token after the first, an image's
    own tokens (placeholders, begin/end markers) left out."""
    if ex.images is None:
        return [(1, ex.prompt_len)]
    return target_spans(ex.images[0].trainable[: ex.prompt_len])
