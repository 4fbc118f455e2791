"""Loading dataset rows through `datasets`: local jsonl/json/parquet/csv files or a hub id.

Text files are checked by us first, line by line, because `datasets`' own errors for a bad
JSON line or a non-UTF-8 byte name neither the file nor the line. JSON rows whose column
types do not fit one Arrow schema (e.g. `messages` a list in one row and a string in another)
are kept as one `_json` string column, so the malformed rows can be counted and skipped at
tokenization instead of failing the whole load.
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import Any

import datasets

from slipstream.sources import check_data_source, is_local_data


class EmptySplitError(ValueError):
    """eval_fraction of too few rows: one of the two splits would be empty."""


def _check_utf8(path: Path) -> None:
    decoder = codecs.getincrementaldecoder("utf-8")()
    line = 1
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as e:
                line += chunk[: e.start].count(b"\n")
                raise ValueError(
                    f"{path}:{line}: not UTF-8 text ({e.reason} at byte {e.start}); "
                    "re-encode the file as UTF-8."
                ) from None
            line += chunk.count(b"\n")
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise ValueError(f"{path}:{line}: not UTF-8 text (truncated character at end).") from None


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                # utf-8-sig on line 1: a byte-order mark (Windows editors write one) is no data
                text = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{path}:{lineno}: not UTF-8 text ({e.reason}); re-encode the file as UTF-8."
                ) from None
            if not text.strip():
                continue
            try:  # without its newline, or a cut-off line's error is at "line 2 column 1"
                row = json.loads(text.rstrip("\r\n"))
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{path}:{lineno}: invalid JSON ({e.msg} at column {e.colno})."
                ) from None
            if not isinstance(row, dict):
                raise ValueError(
                    f"{path}:{lineno}: a JSON line must be an object, got {type(row).__name__}."
                )
            rows.append(row)
    return rows


def _read_json(path: Path) -> list[dict]:
    _check_utf8(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))  # a byte-order mark is no data
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path}:{e.lineno}: invalid JSON ({e.msg} at column {e.colno})."
        ) from None
    if isinstance(data, dict):  # {"data": [...]} style: the one list-valued key
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise ValueError(f"{path}: expected a JSON list of rows (or an object with one list).")
        data = lists[0]
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of rows, got {type(data).__name__}.")
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            raise ValueError(f"{path}: row {i} must be an object, got {type(row).__name__}.")
    return data


def _rows_to_dataset(rows: list[dict]) -> datasets.Dataset:
    # Every key any row has (`Dataset.from_list` keeps only the first row's keys, which
    # dropped the prompt/completion of a file that starts with a messages row).
    keys = dict.fromkeys(key for row in rows for key in row)
    try:
        return datasets.Dataset.from_dict({k: [row.get(k) for row in rows] for k in keys})
    except Exception:  # Arrow could not unify the rows' types; keep each row as JSON text
        return datasets.Dataset.from_dict({"_json": [json.dumps(r) for r in rows]})


def load_rows(source: str, *, split: str | None = None) -> datasets.Dataset:
    """Rows from a local .jsonl/.json/.parquet/.csv file or a hub dataset id (`split`)."""
    path = Path(source).expanduser()
    suffix = path.suffix.lower()
    if is_local_data(source):  # else a hub id (sources.py: the same rule as the pre-check)
        check_data_source(source, "load_rows")
        if suffix == ".jsonl":
            ds = _rows_to_dataset(_read_jsonl(path))
        elif suffix == ".json":
            ds = _rows_to_dataset(_read_json(path))
        elif suffix == ".csv":
            _check_utf8(path)
            ds = datasets.Dataset.from_csv(str(path))
        else:
            ds = datasets.Dataset.from_parquet(str(path))
    else:
        try:
            ds = datasets.load_dataset(source, split=split or "train")
        except Exception as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(
                f"data source {source!r} is not a local file nor a loadable hub dataset: {first}"
            ) from None
    if len(ds) == 0:
        raise ValueError(f"data source {source!r} has no rows; the dataset is empty.")
    return ds


def load_split(
    source: str,
    *,
    eval_fraction: float = 0.0,
    seed: int = 0,
    split: str | None = None,
) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """(train rows, held-out rows or None): a seeded `eval_fraction` held out (separate eval
    files are `data.eval`, loaded with `load_rows`)."""
    rows = load_rows(source, split=split)
    if not eval_fraction:
        return rows, None
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"data.eval_fraction = {eval_fraction}; it must be in (0, 1).")
    num_eval = round(len(rows) * eval_fraction)
    if num_eval < 1 or num_eval >= len(rows):
        raise EmptySplitError(
            f"data.eval_fraction = {eval_fraction} of {len(rows)} rows leaves an empty split; "
            "use more rows or another fraction."
        )
    parts = rows.train_test_split(test_size=num_eval, seed=seed, shuffle=True)
    return parts["train"], parts["test"]


def rows_from_list(rows: list[dict[str, Any]]) -> datasets.Dataset:
    """An in-memory list of row dicts as a Dataset (same rules as a .jsonl file)."""
    if not rows:
        raise ValueError("the dataset is empty (0 rows).")
    return _rows_to_dataset(rows)
