"""Tokenization with the checkpoint's chat template, and which tokens are targets.

An `Example` is `input_ids` plus `trainable[t]`: is token t a target (predicted from t-1)?
The collator turns that into shifted labels. With `train_on="assistant"` only each assistant
turn's tokens are targets: its content and its end-of-turn token, not the role header before
it nor the newline a template may put after the end-of-turn token.

Most templates (Llama 3, Qwen, SmolLM2) have no `{% generation %}` markers, so the assistant
spans are found by rendering the conversation prefix by prefix: for assistant message i,
`render(messages[:i], add_generation_prompt=True)` ends where the reply starts and
`render(messages[:i+1])` ends after it. Both are tokenized and compared with the full
conversation's ids by longest common prefix, so a template that tokenizes a boundary
differently degrades by a token instead of shifting every later label.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from slipstream.data.formats import detect_format, row_format, to_messages
from slipstream.data.images import has_images, undecoded_images
from slipstream.data.rows import DataReport, Encoded, RowError, encode_rows, row_columns, unwrap_row

PARALLEL_MIN_ROWS = 20_000  # below this, process start-up costs more than it saves


@dataclass
class Example:
    """One tokenized example: ids and, per token, whether it is a training target."""

    input_ids: list[int]
    trainable: list[bool]

    def __len__(self) -> int:
        return len(self.input_ids)


def _render(tokenizer: Any, messages: list[dict], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def encode_chat(
    tokenizer: Any, messages: list[dict], train_on: str, expand: Callable[[str], str] | None = None
) -> Example:
    """Token ids of the templated conversation and its target mask (see module docstring).
    `expand` rewrites each rendered text before it is tokenized (image placeholders ->
    their token sequences, data/vision.py)."""
    texts = [_render(tokenizer, messages, False)]
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if train_on == "assistant":
        for i in turns:
            texts.append(_render(tokenizer, messages[:i], True) if i else "")
            texts.append(_render(tokenizer, messages[: i + 1], False))
    if expand is not None:
        texts = [expand(text) for text in texts]
    # One batched call: the fast tokenizer encodes all prefixes in Rust.
    encoded = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    ids = list(encoded[0])
    if train_on == "all":
        return Example(ids, [True] * len(ids))
    trainable = [False] * len(ids)
    for k in range(len(turns)):
        prefix, upto = list(encoded[1 + 2 * k]), list(encoded[2 + 2 * k])
        start = len(os.path.commonprefix([ids, prefix]))  # longest common prefix, of lists too
        end = len(os.path.commonprefix([ids, upto]))
        if end < len(upto):
            end = _turn_end_in_full(tokenizer, ids, upto, start, end)
        end = _strip_trailing_whitespace(tokenizer, ids, start, end)
        trainable[start:end] = [True] * (end - start)
    return Example(ids, trainable)


def _strip_trailing_whitespace(tokenizer: Any, ids: list[int], start: int, end: int) -> int:
    # Whitespace a template puts after the end-of-turn token (ChatML's "\n") is not a target.
    while end > start and not tokenizer.decode([ids[end - 1]]).strip():
        end -= 1
    return end


def _turn_end_in_full(tokenizer: Any, ids: list[int], upto: list[int], start: int, lcp: int) -> int:
    """End of an assistant turn whose rendering as the last message differs from the full
    conversation (Qwen3 adds an empty <think></think> block to the last reply only): the
    first end-of-turn token, the one that closes `upto`, at or after the reply's start."""
    eot = upto[_strip_trailing_whitespace(tokenizer, upto, 0, len(upto)) - 1]
    try:
        return ids.index(eot, start) + 1
    except ValueError:
        return lcp


def encode_text(tokenizer: Any, text: str) -> Example:
    """Raw text: the tokenizer's own bos (if any) and an eos appended, every token a target."""
    ids = list(tokenizer(text, add_special_tokens=True, verbose=False)["input_ids"])
    eos = tokenizer.eos_token_id
    if eos is not None and (not ids or ids[-1] != eos):
        ids.append(eos)
    return Example(ids, [True] * len(ids))


def _encode_row(
    row: Mapping[str, Any],
    tokenizer: Any,
    fmt: str,
    train_on: str,
    max_tokens: int,
    overlong: str,
    auto: bool = False,
    images: Any = None,
) -> tuple[Example | None, str, bool, str]:
    """-> (example or None, status "ok" | "reason: detail" | "dropped: tokens", truncated?,
    the row's format: its own with `auto`, else `fmt`). Statuses, not RowErrors, so that
    the results of `datasets.map` processes come back as plain columns. `images` (a
    data.vision.ImageProcessing) encodes the rows that carry images."""
    fmt = row_format(row, fmt) if auto else fmt
    ex, status, truncated = _encode_as(row, tokenizer, fmt, train_on, max_tokens, overlong, images)
    return ex, status, truncated, fmt


def _encode_as(row, tokenizer, fmt, train_on, max_tokens, overlong, images=None):
    try:
        if images is not None and fmt == "messages" and has_images(row):
            return _encode_images(row, tokenizer, train_on, max_tokens, overlong, images)
        if images is not None and row.get("images"):  # LLaMA-Factory sharegpt + images, say
            raise RowError("image_format", f"images beside a {fmt!r} row; give TRL's messages")
        content = to_messages(row, fmt)
    except RowError as e:
        return None, f"{e.reason}: {e.detail}", False
    if isinstance(content, str):
        ex = encode_text(tokenizer, content)
    else:
        try:
            ex = encode_chat(tokenizer, content, train_on)
        except Exception as e:  # jinja raises for e.g. roles a template does not allow
            if type(e).__name__ not in ("TemplateError", "TemplateSyntaxError", "UndefinedError"):
                raise
            return None, f"template_error: {str(e).splitlines()[0] if str(e) else e!r}", False
    truncated = False
    if len(ex) > max_tokens:
        if overlong == "drop":
            return None, f"dropped: {len(ex)}", False
        ex = Example(ex.input_ids[:max_tokens], ex.trainable[:max_tokens])
        truncated = True
    return _checked(ex, truncated)


def _checked(ex: Example, truncated: bool):
    # Token 0 has nothing before it to predict it from, so it can never be a target.
    if not any(ex.trainable[1:]):
        return None, "all_masked: no target tokens (no assistant reply kept)", truncated
    return ex, "ok", truncated


def _encode_images(row, tokenizer, train_on, max_tokens, overlong, images):
    """An image row (data/vision.py); a cut may not fall before an image's last token."""
    ex = images.encode(row, tokenizer, train_on)
    if len(ex) <= max_tokens:
        return _checked(ex, False)
    if overlong == "drop":
        return None, f"dropped: {len(ex)}", False
    return _checked(ex.truncated(max_tokens), True)


def _map_fn(row, tokenizer, fmt, train_on, max_tokens, overlong, auto, images=None):
    ex, status, truncated, fmt = _encode_row(
        unwrap_row(row), tokenizer, fmt, train_on, max_tokens, overlong, auto, images
    )
    return {
        "ids": ex.input_ids if ex else [],
        "mask": ex.trainable if ex else [],
        "status": status,
        "truncated": truncated,
        "format": fmt,
    }


def tokenize_rows(
    rows: Any,
    tokenizer: Any,
    *,
    format: str = "auto",
    train_on: str = "assistant",
    max_tokens: int,
    overlong: str = "truncate",
    strict: bool = False,
    num_proc: int | None = None,
    first_row: int = 0,
    limit_name: str = "max_tokens",
    images: Any = None,
) -> tuple[list[Example], DataReport]:
    """Tokenize a `datasets.Dataset` (or list of dicts) into Examples, counting every skip.

    `strict=True` makes the first malformed row an error. `num_proc=None` uses several
    processes only for datasets over 20k rows. `first_row` is the number of `rows[0]` in
    messages (a shard of a larger split names rows by their place in the split).
    `limit_name` is the setting that set `max_tokens`, named when every example is over it.
    `images` (data.vision.ImageProcessing, the checkpoint's image side) reads image rows.
    """
    fmt = _check_tokenize_args(rows, tokenizer, format, train_on, max_tokens, overlong)
    args = (tokenizer, fmt, train_on, max_tokens, overlong, format == "auto", images)
    if num_proc is None:
        num_proc = min(os.cpu_count() or 1, 8) if len(rows) > PARALLEL_MIN_ROWS else 1
    num_proc = 1 if images is not None else num_proc  # image rows: one process, in memory
    if images is not None:  # examples keep datasets.Image cells' bytes, not decoded pixels
        rows = undecoded_images(rows)
    report = DataReport(rows=len(rows), format=fmt)
    parallel = num_proc > 1 and hasattr(rows, "map")
    if parallel:
        rows = _encode_in_processes(rows, args, num_proc)

    def encode(row: Mapping[str, Any], index: int) -> Encoded:  # mapped: its process's result
        return _outcome(report, *(_from_mapped(row) if parallel else _encode_row(row, *args)))

    examples = encode_rows(rows, encode, report, strict, first_row)
    if not examples and report.dropped:
        raise ValueError(
            f"every example is longer than {limit_name} = {max_tokens} tokens (the shortest "
            f"has {min(report.dropped_lengths)}); raise {limit_name} or set data.overlong=truncate"
        )
    if not examples:
        raise ValueError(f"no usable examples: {report.summary()}")
    return examples, report


def _check_tokenize_args(rows, tokenizer, format, train_on, max_tokens, overlong) -> str:
    """One-line errors for bad settings or an empty dataset; returns the detected format."""
    if train_on not in ("assistant", "all"):
        raise ValueError(f"train_on = {train_on!r}; use 'assistant' or 'all'.")
    if overlong not in ("truncate", "drop"):
        raise ValueError(f"overlong = {overlong!r}; use 'truncate' or 'drop'.")
    if max_tokens < 2:
        raise ValueError(f"max_tokens = {max_tokens}; an example needs at least 2 tokens.")
    fmt = detect_format(row_columns(rows), format)  # row_columns: an empty dataset is an error
    if fmt != "text" and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"data format {fmt!r} needs a chat template but the tokenizer has none; give one "
            "as data.chat_template (a .jinja file or the template), or use data in 'text' format."
        )
    return fmt


def _encode_in_processes(rows: Any, args: tuple, num_proc: int) -> Any:
    """The rows tokenized by `datasets` in processes: one row of `_map_fn`'s columns each."""
    names = ("tokenizer", "fmt", "train_on", "max_tokens", "overlong", "auto", "images")
    return rows.map(
        _map_fn,
        fn_kwargs=dict(zip(names, args)),
        remove_columns=rows.column_names,
        num_proc=num_proc,
        desc="tokenizing",
    )


def _from_mapped(r: Mapping[str, Any]) -> tuple[Example | None, str, bool, str]:
    ex = Example(r["ids"], r["mask"]) if r["status"] == "ok" else None
    return ex, r["status"], r["truncated"], r["format"]


def _outcome(report: DataReport, ex, status: str, truncated: bool, fmt: str) -> Encoded:
    """One `_encode_row` result as the row loop takes it: a skip raises its RowError; the
    row's format and truncation are counted here, since a truncated row may be skipped."""
    report.formats[fmt] += 1
    report.truncated += truncated
    if status.startswith("dropped"):
        return Encoded(None, int(status.split(":")[1]))
    if ex is None:
        reason, _, detail = status.partition(": ")
        raise RowError(reason, detail)
    return Encoded(ex, len(ex), sum(ex.trainable[1:]))
