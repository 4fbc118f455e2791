"""keep_freed_memory(): a freed block under 32 MiB is reused, not unmapped and faulted in again;
a larger one (a loss chunk's logits) goes back to the system on free."""

from __future__ import annotations

import resource

import pytest
import torch

from slipstream.memory import host_heap


@pytest.mark.skipif(not host_heap._is_glibc(), reason="glibc's malloc only")
def test_freed_big_blocks_are_reused_without_page_faults():
    assert host_heap.keep_freed_memory()
    n = 24 << 18  # 24 MiB of float32: under the threshold we set
    torch.empty(n).fill_(1.0)  # allocated, touched and freed: kept in the heap now
    faults = []
    # The fewest of three tries: a small allocation made between a free and the next big one
    # (the interpreter's own) can carve the kept block, and that one try faults in fresh pages
    # (CI saw 16,384 once). Unmapped on every free, as without the fix, every try faults.
    for value in (2.0, 3.0, 4.0):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.empty(n).fill_(value)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    assert min(faults) < 1000, faults  # unmapped and mapped again it is 16,384 (4 KiB pages)


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) << 10 for x in f if x.startswith("VmRSS:"))


@pytest.mark.skipif(not host_heap._is_glibc(), reason="glibc's malloc only")
def test_blocks_over_the_threshold_go_back_on_free():
    """Kept in the heap, a loss chunk (up to 256 MiB) was cut by the small blocks allocated
    after it, and the next step's chunk took another: RSS grew by a chunk at step 2."""
    assert host_heap.keep_freed_memory()
    x = torch.empty(64 << 18).fill_(1.0)  # 64 MiB, touched
    held = _rss()
    del x
    assert held - _rss() > 60 << 20
