"""Tokenizing under torchrun: each rank tokenizes a contiguous slice of the rows, then every
rank gets every example back in row order, so all ranks pack the same batches. Without
torchrun `tokenize_sharded` is the plain call.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from slipstream import distributed as dist


def shard_rows(rows: Any) -> tuple[Any, int]:
    """This rank's contiguous slice of `rows` (a datasets.Dataset or list) and its first index."""
    n, world, r = len(rows), dist.world_size(), dist.rank()
    start, stop = n * r // world, n * (r + 1) // world
    if hasattr(rows, "select"):
        return rows.select(range(start, stop)), start
    return rows[start:stop], start


def tokenize_sharded(tokenize: Callable[[Any, int], tuple[list, Any]], rows: Any, what: str):
    """`tokenize(rows, first_row)` -> (examples, report), each rank on its slice (rows named
    by their number in the whole split), then every rank gets all examples in row order.
    A rank's error is gathered too and raised on every rank with that rank's message, so a
    bad shard stops the job at once instead of leaving the other ranks waiting in the next
    collective."""
    if dist.world_size() == 1:
        return tokenize(rows, 0)
    mine, start = shard_rows(rows)
    result, error = None, None
    try:
        result = tokenize(mine, start)
    except (ValueError, FileNotFoundError) as e:
        error = f"rank {dist.rank()} ({what} rows {start}-{start + len(mine) - 1}): {e}"
    gathered = dist.gather_objects((result, error))
    failed = [err for _, err in gathered if err is not None]
    if failed:
        dist.barrier()  # leave together: a rank tearing gloo down under a peer can abort it
        raise ValueError(failed[0])
    examples = [ex for part, _ in gathered for ex in part[0]]
    return examples, merge_reports([part[1] for part, _ in gathered])


def merge_reports(reports: list[Any]) -> Any:
    """Sum DataReports (of ranks or sources): counts add; the first skip reason wins."""
    first = reports[0]
    merged = type(first)()
    for report in reports:
        for name, value in vars(report).items():
            current = getattr(merged, name)
            if isinstance(value, Counter):
                current.update(value)
            elif isinstance(value, int):
                setattr(merged, name, current + value)
            elif not current:
                setattr(merged, name, value)
    return merged
