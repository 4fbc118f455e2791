"""Best-fit-decreasing packing of examples into token budgets.

A batch is a list of example indices whose lengths sum to at most `tokens_per_batch`; the
model sees them as one flat packed stream (no padding). Best-fit decreasing: place examples
longest first, each into the open batch with the least room that still fits it. On chat data
this fills budgets to >= 98% (the waste is almost all in the last few batches).
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence


def pack_examples(lengths: Sequence[int], tokens_per_batch: int) -> list[list[int]]:
    """Indices of `lengths` grouped into batches of at most `tokens_per_batch` tokens.

    Deterministic: ties are broken by example index.
    """
    if tokens_per_batch < 1:
        raise ValueError(f"tokens_per_batch = {tokens_per_batch}; it must be >= 1.")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if order and lengths[order[0]] > tokens_per_batch:
        i = order[0]
        raise ValueError(
            f"example {i} has {lengths[i]} tokens, over tokens_per_batch = {tokens_per_batch}; "
            "raise the budget or set data.max_tokens (with overlong: truncate | drop) below it."
        )
    batches: list[list[int]] = []
    # Open batches sorted by remaining room: (room, batch index). Full batches leave the list.
    open_rooms: list[tuple[int, int]] = []
    for i in order:
        n = lengths[i]
        if n < 1:
            raise ValueError(f"example {i} has {n} tokens; every example needs >= 1 token.")
        pos = bisect.bisect_left(open_rooms, (n, -1))
        if pos < len(open_rooms):
            room, b = open_rooms.pop(pos)
        else:
            room, b = tokens_per_batch, len(batches)
            batches.append([])
        batches[b].append(i)
        if room - n > 0:
            bisect.insort(open_rooms, (room - n, b))
    return batches


def packing_efficiency(
    lengths: Sequence[int], batches: Sequence[Sequence[int]], tokens_per_batch: int
) -> float:
    """Real tokens / (number of batches * budget): 1.0 means no budget left unused."""
    if not batches:
        return 0.0
    used = sum(lengths[i] for batch in batches for i in batch)
    return used / (len(batches) * tokens_per_batch)


def epoch_order(num_batches: int, *, seed: int, epoch: int) -> list[int]:
    """The order to visit batches in this epoch: a seeded shuffle, different each epoch."""
    order = list(range(num_batches))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order
