"""Keep freed host memory for reuse: glibc's malloc told not to hand big blocks back (CPU runs).

glibc serves allocations above its mmap threshold (128 KiB, rising to at most 32 MiB as big
blocks are freed) with fresh `mmap`s and unmaps them on free, so every (T, F) activation of
every step comes back as new pages: each first touch is a page fault that zeroes 4 KiB. A
SmolLM2-shaped 6-layer LoRA step on 1,024 tokens took 60-95k minor faults; with the threshold
raised and trimming off, 3-5 (after the first step), and the step's CPU time fell from
1.52-1.77 s to 1.36-1.49 s (1 thread, AMD EPYC; docs/benchmarks.md), peak RSS within 5%
(the step reaches the same peak either way; freed blocks are reused, not kept twice).

`keep_freed_memory()` sets that for the process (`mallopt`, through ctypes); anything other
than glibc on Linux (musl, macOS) is left alone.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# Below it malloc takes memory from its heap and keeps what is freed there; above, a block is
# mapped afresh and unmapped on free. 32 MiB (glibc's documented maximum): a layer's (T, F)
# temporaries up to ~5k tokens stay in the heap, while a loss chunk's logits (up to 256 MiB)
# go back at once. At 1 GiB (before) the chunk came from the heap, and the next step's chunk
# did not fit the hole the small blocks allocated since had cut into it: a 4-layer LoRA step
# of 2,048 tokens held 1,013 MB of RSS at its second step, 856 MB at 32 MiB (its first step's
# peak either way). Mapping a 256 MiB chunk costs ~65k page faults, ~50 ms, against ~1 s
# of head matmuls over it.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = (1 << 31) - 1  # the largest a C int holds


def _is_glibc() -> bool:
    try:
        return sys.platform == "linux" and os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (ValueError, OSError, AttributeError):
        return False


@functools.cache
def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; whether it took effect."""
    if not _is_glibc():
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and (
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    )
