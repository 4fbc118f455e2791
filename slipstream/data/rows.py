"""The one row loop: every objective reads its dataset rows through `encode_rows`.

An objective gives `encode(row, index) -> Encoded` (`index`: the row's number in the split;
the result: its example, or a row dropped for its length) and raises `RowError(reason,
detail)` for a row it cannot use. The loop does what every objective shares: JSON-kept rows
unwrapped (`unwrap_row`), skips counted by reason with the first one named, or fatal with
`strict`, drops and kept examples counted in the `DataReport`. What is particular to an
objective (its format counts, what it truncated) the encoder writes to the report itself.
`LengthLimit` is the one drop-or-truncate step of examples that keep a prompt (preference
pairs, KTO rows, reward pairs). `row_columns` is the one column sniffer.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

EMPTY = "the dataset is empty (0 rows); check the data path or split."


class RowError(Exception):
    """A malformed row: `reason` is a short counter key, `detail` says what is wrong."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass
class DataReport:
    """What tokenization did with every row; `summary()` is the one line a run prints."""

    rows: int = 0
    kept: int = 0
    skipped: Counter = field(default_factory=Counter)
    truncated: int = 0
    dropped: int = 0
    tokens: int = 0
    target_tokens: int = 0
    first_skip: str = ""  # the first skipped row's reason, so the user can find it
    format: str = ""  # the row format read (detected or given)
    dropped_lengths: Counter = field(default_factory=Counter)  # tokens -> examples dropped
    formats: Counter = field(default_factory=Counter)  # format -> rows read in it (auto)

    def format_text(self) -> str:
        """The format read, or each format's row count when rows came in several."""
        if len(self.formats) > 1:
            return ", ".join(f"{k} {v} rows" for k, v in self.formats.most_common())
        return next(iter(self.formats), self.format)

    def summary(self) -> str:
        skipped = sum(self.skipped.values())
        why = ", ".join(f"{k} {v}" for k, v in sorted(self.skipped.items()))
        share = 100.0 * self.target_tokens / max(self.tokens, 1)
        fmt = f" ({self.format_text()})" if self.format_text() else ""
        line = f"data{fmt}: {self.rows} rows -> {self.kept} examples, {self.tokens} tokens "
        line += f"({share:.0f}% targets); skipped {skipped}"
        line += f" ({why}; first: {self.first_skip})" if skipped else ""
        return line + f"; truncated {self.truncated}; dropped {self.dropped} over the length limit"

    def warning(self) -> str | None:
        """A line of its own when more than a quarter of the rows were skipped or dropped."""
        skipped, lost = sum(self.skipped.values()), sum(self.skipped.values()) + self.dropped
        if lost * 4 <= self.rows:
            return None
        why = [f"{k} {v}" for k, v in self.skipped.most_common()]
        why += [f"over the length limit {self.dropped}"] if self.dropped else []
        first = f"; first: {self.first_skip}" if skipped else ""
        return (
            f"{lost} of {self.rows} rows ({100 * lost / self.rows:.0f}%) are not trained on "
            f"({', '.join(why)}{first})"
        )


@dataclass
class Encoded:
    """One row's result: its example with the tokens and target tokens it counts, or
    (`example` None) a row dropped over the length limit, `tokens` long."""

    example: Any
    tokens: int
    targets: int = 0


class Fits(Protocol):
    """An example `LengthLimit` judges: one or more sequences that share a prompt."""

    prompt_len: int  # tokens a cut must keep whole (0: none)

    def longest(self) -> int: ...  # its longest sequence's tokens
    def cut(self, max_tokens: int) -> Fits: ...  # every sequence cut to max_tokens
    def counts(self) -> tuple[int, int]: ...  # (tokens, target tokens) for the report


@dataclass(frozen=True)
class LengthLimit:
    """`data.max_tokens` and `data.overlong` ("drop" | "truncate") of examples that keep a
    prompt: an example whose longest sequence is over the limit is dropped, or cut to it
    (counted in `report.truncated`) when its prompt leaves room for a completion."""

    max_tokens: int
    overlong: str = "drop"

    def check_prompt(self, prompt_len: int) -> None:
        """RowError prompt_too_long when a prompt leaves no room under the limit."""
        if prompt_len >= self.max_tokens:
            raise RowError("prompt_too_long", f"prompt fills max_tokens={self.max_tokens}")

    def encoded(self, example: Fits, report: DataReport) -> Encoded:
        """The row's result for `encode_rows`: the example (cut if it must be) or a drop."""
        longest = example.longest()
        if longest > self.max_tokens:
            if self.overlong == "drop":
                return Encoded(None, longest)
            self.check_prompt(example.prompt_len)
            example = example.cut(self.max_tokens)
            report.truncated += 1
        return Encoded(example, *example.counts())


def unwrap_row(row: Mapping[str, Any]) -> Mapping[str, Any]:
    """A row as its fields: rows whose types did not fit one Arrow schema are kept as JSON
    text in a single `_json` column (data/load.py)."""
    if "_json" in row and len(row) == 1:
        return json.loads(row["_json"])
    return row


def row_columns(rows: Any) -> list[str]:
    """The dataset's columns: its column names, or every key some row has (rows kept as
    JSON, lists of dicts). ValueError for a dataset without rows."""
    if len(rows) == 0:
        raise ValueError(EMPTY)
    if hasattr(rows, "column_names") and list(rows.column_names) != ["_json"]:
        return list(rows.column_names)
    return list(dict.fromkeys(key for row in rows for key in unwrap_row(row)))


def encode_rows(
    rows: Any,
    encode: Callable[[Mapping[str, Any], int], Encoded],
    report: DataReport,
    strict: bool,
    first_row: int = 0,
) -> list:
    """`encode` each row (a `datasets.Dataset` or list of dicts) and count every outcome in
    `report` (module docstring); -> the kept examples, in row order. `first_row` is the
    number of `rows[0]` in messages (a shard names rows by their place in the split)."""
    if len(rows) == 0:
        raise ValueError(EMPTY)
    examples = []
    for index, row in enumerate(rows, start=first_row):
        try:
            out = encode(unwrap_row(row), index)
        except RowError as e:
            if strict:
                raise ValueError(
                    f"data row {index}: {e} (strict mode; fix or remove the row)."
                ) from None
            report.skipped[e.reason] += 1
            report.first_skip = report.first_skip or f"row {index}: {e}"
            continue
        if out.example is None:
            report.dropped += 1
            report.dropped_lengths[out.tokens] += 1
            continue
        examples.append(out.example)
        report.kept += 1
        report.tokens += out.tokens
        report.target_tokens += out.targets
    return examples
