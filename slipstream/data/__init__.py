"""Data pipeline: rows -> chat messages -> token ids + targets -> packed batches.

What the trainer calls: `load_rows` / `load_split` (load.py: local files or a hub id, errors
naming the file and line), `tokenize_rows` (labels.py: the chat template, assistant-only
targets), `encode_rows` (rows.py: the one row loop every objective reads its rows through,
its `DataReport` of what was skipped, truncated or dropped, `row_columns`), `pack_examples`,
`packing_efficiency` and `epoch_order` (packing.py: best-fit decreasing, seeded order),
`collate` -> `Batch` (collate.py, through packed.py: the one packed-batch builder every
collator uses, its fields in one buffer, one non-blocking copy). Row formats,
auto-detected from the columns: formats.py. Demo data: `chitchat_rows` (chitchat.py).
"""

from slipstream.data.chitchat import chitchat_rows
from slipstream.data.collate import IGNORE_INDEX, Batch, collate
from slipstream.data.formats import FORMATS, detect_format, to_messages
from slipstream.data.labels import Example, encode_chat, tokenize_rows
from slipstream.data.load import load_rows, load_split, rows_from_list
from slipstream.data.packed import PackedBatch, PackedBuilder, PackedView
from slipstream.data.packing import epoch_order, pack_examples, packing_efficiency
from slipstream.data.rows import DataReport, RowError, encode_rows, row_columns

__all__ = [
    "FORMATS",
    "IGNORE_INDEX",
    "PackedBatch",
    "PackedBuilder",
    "PackedView",
    "Batch",
    "DataReport",
    "Example",
    "RowError",
    "chitchat_rows",
    "collate",
    "detect_format",
    "encode_rows",
    "encode_chat",
    "epoch_order",
    "load_rows",
    "load_split",
    "pack_examples",
    "packing_efficiency",
    "row_columns",
    "rows_from_list",
    "to_messages",
    "tokenize_rows",
]
