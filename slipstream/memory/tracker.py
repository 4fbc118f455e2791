"""A live-tensor tracker: the bytes of every tensor storage alive at each op, and their peak.

`with LiveTensors(device) as live: step()` counts, through a `TorchDispatchMode`, each
storage an op returns on `device` (once per storage: views share it) until the storage is
freed (a weak reference's callback), so `live.peak` is the most tensor bytes alive at any
op boundary during the block, autograd's saved tensors and the backward's temporaries
included; `live.peak - live.start` what the block added. Storages alive before the block
are counted when `include=(tensors...)` names them (the model's parameters): their bytes
are in `live.start`. The number is the allocator's view without its caching or
fragmentation: what a device's `max_memory_allocated` reads (to its 512-byte rounding), and
what host RSS holds above the process's own code and libraries.

For measuring (benchmarks, the planner's validation tests): it adds a Python call per op.

`small_bytes=N` also keeps the peak of storages under N bytes and of the rest apart
(`small_peak`, `large_peak`, from `small_start`/`large_start`): on the host glibc keeps
freed small blocks in its heap (memory/host_heap.py) and maps large ones afresh, so peak RSS
is nearer the two peaks summed than the peak of their sum (`heap_held`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveTensors(TorchDispatchMode):
    """Live storage bytes on one device during the block: `current`, `peak`, `start`."""

    def __init__(
        self, device: str | torch.device = "cpu", include: Iterable = (), small_bytes: int = 0
    ) -> None:
        super().__init__()
        self.device = torch.device(device).type
        self.current = 0
        self.peak = 0
        self.start = 0
        self.small_bytes = small_bytes
        self.small_current = self.small_peak = self.small_start = 0
        self.large_peak = self.large_start = 0
        self._live: dict[int, int] = {}  # storage key -> bytes
        self._include = list(include)

    def __enter__(self):
        for t in self._include:
            if isinstance(t, torch.Tensor):
                self._track(t)
        self._include = []
        self.start = self.peak = self.current
        self.small_start = self.small_peak = self.small_current
        self.large_start = self.large_peak = self.current - self.small_current
        return super().__enter__()

    @property
    def heap_held(self) -> int:
        """Bytes the two peaks summed exceed the peak: freed small blocks a host heap still
        holds when the large ones peak (0 without `small_bytes`)."""
        if not self.small_bytes:
            return 0
        small, large = self.small_peak - self.small_start, self.large_peak - self.large_start
        return max(0, small + large - (self.peak - self.start))

    def _track(self, t: torch.Tensor) -> None:
        if t.device.type != self.device:
            return
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensor subclasses without one
            return
        key = storage._cdata
        if key in self._live:
            return
        nbytes = storage.nbytes()
        self._live[key] = nbytes
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        if nbytes < self.small_bytes:
            self.small_current += nbytes
            self.small_peak = max(self.small_peak, self.small_current)
        self.large_peak = max(self.large_peak, self.current - self.small_current)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        nbytes = self._live.pop(key, 0)
        self.current -= nbytes
        if nbytes < self.small_bytes:
            self.small_current -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out
