"""Data pipeline: rows -> chat messages -> token ids + targets -> packed batches.

API (what the trainer calls):
    load_rows(source, *, split=None) -> datasets.Dataset
        local .jsonl/.json/.parquet/.csv file or a hub dataset id; errors name file and line.
    load_split(source, *, eval_fraction=0.0, seed=0, split=None)
        -> (train_rows, eval_rows | None); a seeded fraction held out.
    tokenize_rows(rows, tokenizer, *, format="auto", train_on="assistant", max_tokens,
                  overlong="truncate", strict=False, num_proc=None)
        -> (list[Example], DataReport); Example.input_ids / .trainable (per token: a target?);
        DataReport counts rows, kept, skipped by reason, truncated, dropped; .summary().
    pack_examples(lengths, tokens_per_batch) -> list[list[int]]   best-fit decreasing
    packing_efficiency(lengths, batches, tokens_per_batch) -> float
    epoch_order(num_batches, *, seed, epoch) -> list[int]         seeded batch order
    collate(examples) -> Batch(input_ids (T,), labels (T,) shifted, seq: SeqInfo, num_labels,
                               label_positions (N,))
    Batch.to(device) -> Batch                                     non-blocking copies
    chitchat_rows(num_rows, *, seed=0, max_turns=8, skip=0) -> list[dict]   (demo data)

Formats (auto-detected from columns, or `format=`): messages, sharegpt, prompt_completion,
alpaca, text; see `slipstream.data.formats`.
"""

from slipstream.data.chitchat import chitchat_rows
from slipstream.data.collate import IGNORE_INDEX, Batch, collate
from slipstream.data.formats import FORMATS, RowError, detect_format, to_messages
from slipstream.data.labels import DataReport, Example, encode_chat, tokenize_rows
from slipstream.data.load import load_rows, load_split, rows_from_list
from slipstream.data.packing import epoch_order, pack_examples, packing_efficiency

__all__ = [
    "FORMATS",
    "IGNORE_INDEX",
    "Batch",
    "DataReport",
    "Example",
    "RowError",
    "chitchat_rows",
    "collate",
    "detect_format",
    "encode_chat",
    "epoch_order",
    "load_rows",
    "load_split",
    "pack_examples",
    "packing_efficiency",
    "rows_from_list",
    "to_messages",
    "tokenize_rows",
]
