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

Collated, a micro-batch of P pairs is 2P packed sequences, chosen then rejected of each pair
(sequence 2i is pair i's chosen, 2i+1 its rejected), with the scored positions and each
one's sequence index built on the host.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from slipstream.data.formats import text_content
from slipstream.data.packed import PackedBuilder, PackedView, PerSpan, packed_field
from slipstream.data.rows import DataReport, Encoded, LengthLimit, RowError, encode_rows

PAIR_COLUMNS = ("chosen", "rejected")


@dataclass
class PairExample:
    """One pair: the two token sequences (prompt + completion) and the prompt's length,
    which is the same in both (the completion starts at `prompt_len`)."""

    chosen: list[int]
    rejected: list[int]
    prompt_len: int
    ref: tuple[float, float] | None = None  # reference log-probs, when precomputed

    def __len__(self) -> int:
        return len(self.chosen) + len(self.rejected)

    def longest(self) -> int:
        return max(len(self.chosen), len(self.rejected))

    def cut(self, max_tokens: int) -> PairExample:
        return PairExample(self.chosen[:max_tokens], self.rejected[:max_tokens], self.prompt_len)

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


def _check_field(row: Mapping[str, Any], key: str) -> Any:
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


def parse_pair_row(row: Mapping[str, Any], eos_token: str | None) -> tuple[Any, Any, Any, dict]:
    """(prompt, chosen, rejected, template kwargs) of one row, checked; RowError if bad."""
    chosen, rejected = _check_field(row, "chosen"), _check_field(row, "rejected")
    if "prompt" in row:
        prompt = _check_field(row, "prompt")
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
    try:
        out = tokenizer.apply_chat_template(
            content,
            tokenize=True,
            return_dict=True,
            add_generation_prompt=generation_prompt,
            **kwargs,
        )
    except Exception as e:  # jinja's errors for roles or fields a template does not allow
        if "Template" not in type(e).__name__ and type(e).__name__ != "UndefinedError":
            raise
        first_line = str(e).splitlines()[0] if str(e) else repr(e)
        raise RowError("template_error", first_line) from None
    return list(out["input_ids"])


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


def tokenize_pairs(
    rows: Any,
    tokenizer: Any,
    *,
    max_tokens: int,
    overlong: str = "drop",
    strict: bool = False,
    first_row: int = 0,
) -> tuple[list[PairExample], DataReport]:
    """Tokenize preference rows (a `datasets.Dataset` or list of dicts); every skip counted."""
    report, limit = DataReport(rows=len(rows)), LengthLimit(max_tokens, overlong)

    def encode(row: Mapping[str, Any], index: int) -> Encoded:
        row = {k: v for k, v in row.items() if v is not None or k in PAIR_COLUMNS}
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
    num_chosen = 0
    for i, ex in enumerate(examples):
        for j, seq_ids in enumerate((ex.chosen, ex.rejected)):
            p, n, prompt = ex.prompt_len, len(seq_ids), score_prompt and j == 0
            extra = {"ref_logps": ref_logps[i][j]} if ref_logps is not None else {}
            scored = builder.add(
                seq_ids, [(1, p), (p, n)] if prompt else [(p, n)],
                segments=PerSpan((2 * P + i, 2 * i + j)) if prompt else 2 * i + j,
                completion_tokens=float(n - p), **extra,
            )  # fmt: skip
            num_chosen += scored if j == 0 else 0
    return PairBatch(builder.build(), P, num_chosen)
