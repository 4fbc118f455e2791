"""The offload pool: host slots for offloaded layer inputs, the device buffers they reload into,
the copy stream and its events, and the statistics benchmarks read.

`OffloadPool` is driven by `slipstream.memory.offload` (the layer wrapping and the autograd
Function): `save` (offloaded inputs) and `keep` (the last layer's input) in forward;
`backward_start`, `input_for`, `backward_end` in backward. It keeps the schedule the design
promises: when layer i's backward starts, the reload of the next offloaded input (i-1) is
issued into a free device buffer on the copy stream, so it runs under layer i's recompute and
backward; events, never stream or host syncs, order copies and compute. Too little free memory
for two buffers: one, said once in the log.

Device memory: the buffers are the only layer-input-sized device tensors the pool holds, so
backward holds at most `num_buffers` layer inputs. The last layer's input, which backward
needs first and so is never offloaded, is copied (device to device, on the compute stream,
one (T, D) copy per step) into a buffer at forward time and the original is freed: during the
last layer's backward that buffer holds it while the other takes the prefetch of the layer
below. With one buffer the last input occupies it, so the first reload is issued when the
last layer's backward ends ("single buffer" = one layer input on the device at any time).
Only when every buffer is taken (several graphs alive, e.g. two forwards before a backward)
does a last input stay in its own tensor, and a reload that finds every buffer held by such
inputs go to a tensor of its own; `live_device_inputs()` counts those too. Every device tensor
the copy stream writes is new from the caching allocator: its first write waits for an event
recorded on the compute stream after the allocation, and it is `record_stream`ed on the copy
stream, so dropping it (a grown buffer, a pool or graph freed mid-prefetch) never hands its
block out while a copy into it is queued.

On CUDA the host slots are pinned and copies run on a side stream (`_CudaCopies`); elsewhere
(`force=True` on CPU, for tests) `_SyncCopies` copies at once and events are None, so the same
bookkeeping runs everywhere.

Statistics: `pool.stats()` -> `OffloadStats`; with `timing=True` on CUDA its copy times come
from CUDA events, and reading them synchronizes: call `stats()` between steps, never inside
one. `pool.events` (with `record_events=True`) logs (what, layer) in order.

Shapes: T tokens, D hidden.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any

import torch

# One logger, and one set of messages said once, for the offload feature (offload.py too).
log = logging.getLogger("slipstream.memory.offload")
_LOGGED: set[str] = set()
# A second buffer is taken only if this many buffer sizes stay free besides both buffers:
# room for one layer's recompute (q, k, v, attention out, 3 MLP intermediates ~ 16 D per token).
_RECOMPUTE_RESERVE = 16


def _log_once(message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        log.warning(message)


@dataclass
class OffloadStats:
    """Counters since the last `reset_stats()`; times in ms, None unless `timing=True` on CUDA."""

    steps: int  # backward passes that reached layer 0
    bytes_offloaded: int
    bytes_reloaded: int
    num_buffers: int
    buffer_bytes: int  # size of each device reload buffer
    host_bytes: int  # host pool size; pinned slots are whole powers of two (_slot_bytes)
    host_allocations: int  # host slots allocated since the pool was made (not reset)
    max_resident: int  # most layer inputs the pool held on the device at once
    d2h_ms: float | None = None  # sum of device->host copy durations (copy stream)
    h2d_ms: float | None = None  # sum of host->device copy durations (copy stream)
    exposed_ms: float | None = None  # time the compute stream stood waiting for reloads

    @property
    def h2d_gbps(self) -> float | None:
        return self.bytes_reloaded / self.h2d_ms / 1e6 if self.h2d_ms else None


class _SyncCopies:
    """CPU twin of `_CudaCopies`: copies happen at once, events are None."""

    def record_compute(self) -> None:
        return None

    def copy(self, kind: str, dst: torch.Tensor, src: torch.Tensor, after: Any) -> None:
        dst.copy_(src)

    def place(self, dst: torch.Tensor, src: torch.Tensor, after: Any) -> None:
        dst.copy_(src)

    def wait(self, event: Any) -> None:
        pass

    def track(self, device_tensor: torch.Tensor) -> None:
        pass

    def timings(self) -> dict[str, float | None]:
        return {}


class _CudaCopies:
    """Copies on one side stream, ordered against the compute stream by events only."""

    def __init__(self, device: torch.device, timing: bool) -> None:
        self.device, self.timing = device, timing
        self.stream = torch.cuda.Stream(device)
        self.spans: dict[str, list] = {"d2h": [], "h2d": [], "wait": []}

    def _event(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=self.timing)
        event.record(stream)
        return event

    def record_compute(self) -> torch.cuda.Event:
        return self._event(torch.cuda.current_stream(self.device))

    def copy(self, kind: str, dst: torch.Tensor, src: torch.Tensor, after: Any):
        if after is not None:
            self.stream.wait_event(after)
        with torch.cuda.stream(self.stream):
            start = self._event(self.stream) if self.timing else None
            dst.copy_(src, non_blocking=True)
            done = self._event(self.stream)
        if src.device.type == "cuda":  # keep the source's memory until the copy has read it
            src.record_stream(self.stream)
        if self.timing:
            self.spans[kind].append((start, done))
        return done

    def place(self, dst: torch.Tensor, src: torch.Tensor, after: Any) -> None:
        """Device-to-device copy on the compute stream, after the copy stream's last write."""
        if after is not None:
            torch.cuda.current_stream(self.device).wait_event(after)
        dst.copy_(src)

    def track(self, device_tensor: torch.Tensor) -> None:
        """A new device tensor the copy stream will write: whenever it is dropped (a grown
        buffer, a pool or graph freed with a prefetch in flight), the caching allocator
        keeps its block until the copy stream's work queued by then has finished."""
        device_tensor.record_stream(self.stream)

    def wait(self, event: Any) -> None:
        compute = torch.cuda.current_stream(self.device)
        start = self._event(compute) if self.timing else None
        compute.wait_event(event)
        if self.timing:  # end - start = how long the compute stream stood still
            self.spans["wait"].append((start, self._event(compute)))

    def timings(self) -> dict[str, float | None]:
        """Sum of each span kind in ms. Synchronizes on the events: call between steps."""
        if not self.timing:
            return {}
        out = {}
        for kind, spans in self.spans.items():
            for _, end in spans:
                end.synchronize()
            out[kind] = sum(start.elapsed_time(end) for start, end in spans)
        return out


class _Saved:
    """One offloaded layer input: where its bytes are and what state they are in."""

    __slots__ = ("index", "shape", "dtype", "nbytes", "slot", "state", "buffer", "ready",
                 "own", "__weakref__")  # fmt: skip

    def __init__(self, index: int, x: torch.Tensor, slot: torch.Tensor | None) -> None:
        self.index, self.shape, self.dtype, self.nbytes = index, x.shape, x.dtype, x.nbytes
        self.slot = slot  # host slot; None for a kept (never offloaded) input
        # offloaded: host -> loading (reload issued) -> in_use -> done; kept: kept -> in_use
        self.state = "host" if slot is not None else "kept"
        self.buffer: int | None = None
        self.ready: Any = None  # event: the reload into `buffer` has finished
        self.own: torch.Tensor | None = None  # flat bytes on the device outside the buffers

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[: self.nbytes].view(self.dtype).view(self.shape)


class OffloadPool:
    """Host slots for offloaded layer inputs and the one or two device buffers they reload into."""

    def __init__(
        self,
        *,
        pin: bool = True,
        min_offload_bytes: int = 1 << 20,
        double_buffer: bool | str = "auto",
        timing: bool = False,
        record_events: bool = False,
    ) -> None:
        self.pin, self.min_offload_bytes = pin, min_offload_bytes
        self.double_buffer, self.timing = double_buffer, timing
        self.events: list[tuple[str, int]] | None = [] if record_events else None
        self.copies: _SyncCopies | _CudaCopies | None = None  # made on the first offload
        self.device: torch.device | None = None
        self.buffers: list[torch.Tensor] = []  # flat uint8 device buffers
        # Weak: a graph dropped without backward (a forward only for its loss) frees its
        # buffer instead of holding it for good.
        self.owners: list[weakref.ref[_Saved] | None] = []
        self.buffer_free: list[Any] = []  # event: the last compute-stream use has finished
        self.buffer_written: list[Any] = []  # event: the last copy-stream write has finished
        self.own_inputs: weakref.WeakSet[_Saved] = weakref.WeakSet()  # kept outside buffers
        self.free_slots: dict[int, list[torch.Tensor]] = {}
        self.pending: list[weakref.ref[_Saved]] = []  # offloaded, not reloaded, forward order
        self.max_nbytes = self.host_allocations = self.host_bytes = 0
        self.reset_stats()

    # -- statistics -------------------------------------------------------------------------
    def reset_stats(self) -> None:
        self.steps = self.bytes_offloaded = self.bytes_reloaded = self.max_resident = 0
        if isinstance(self.copies, _CudaCopies):
            self.copies.spans = {"d2h": [], "h2d": [], "wait": []}

    def stats(self) -> OffloadStats:
        t = self.copies.timings() if self.copies is not None else {}
        return OffloadStats(
            self.steps, self.bytes_offloaded, self.bytes_reloaded, len(self.buffers),
            self.buffers[0].numel() if self.buffers else 0, self.host_bytes,
            self.host_allocations, self.max_resident, t.get("d2h"), t.get("h2d"), t.get("wait"),
        )  # fmt: skip

    def _note(self, what: str, index: int) -> None:
        if self.events is not None:
            self.events.append((what, index))

    def _owner(self, buffer: int) -> _Saved | None:
        ref = self.owners[buffer]
        return ref() if ref is not None else None

    def live_device_inputs(self) -> int:
        """Layer-input-sized device tensors the pool holds now: its buffers, plus kept inputs
        that found no free buffer."""
        return len(self.buffers) + sum(s.own is not None for s in self.own_inputs)

    def _count_resident(self) -> None:
        resident = sum(self._owner(b) is not None for b in range(len(self.buffers)))
        resident += sum(s.own is not None for s in self.own_inputs)
        self.max_resident = max(self.max_resident, resident)

    # -- forward ----------------------------------------------------------------------------
    def save(self, index: int, x_TD: torch.Tensor) -> _Saved | None:
        """Start copying `x_TD` to a host slot; None when it is too small to be worth it."""
        if x_TD.nbytes < self.min_offload_bytes:
            return None
        self._start(x_TD)
        saved = _Saved(index, x_TD, self._take_slot(index, x_TD.nbytes))
        after = self.copies.record_compute()  # the copy may start once x_TD is written
        self.copies.copy("d2h", saved.view(saved.slot), x_TD, after)
        self.pending.append(weakref.ref(saved))
        self.max_nbytes = max(self.max_nbytes, saved.nbytes)
        self.bytes_offloaded += saved.nbytes
        self._note("offload", index)
        return saved

    def keep(self, index: int, x_TD: torch.Tensor) -> _Saved | None:
        """The last layer's input: copy it into a free buffer so the caller's tensor can be
        freed (backward reads it from there first). None when under the size threshold."""
        if x_TD.nbytes < self.min_offload_bytes:
            return None
        self._start(x_TD)
        saved = _Saved(index, x_TD, None)
        self.max_nbytes = max(self.max_nbytes, saved.nbytes)
        buffer = self._free_buffer(saved.nbytes)
        if buffer is None:  # every buffer taken by another live graph: keep the tensor itself
            saved.own = x_TD.detach().contiguous().view(-1).view(torch.uint8)
            self.own_inputs.add(saved)
        else:
            self.copies.place(saved.view(self.buffers[buffer]), x_TD, self.buffer_written[buffer])
            self.buffer_free[buffer] = self.copies.record_compute()  # the copy-stream's next
            saved.buffer, self.owners[buffer] = buffer, weakref.ref(saved)  # write waits on it
        self._count_resident()
        self._note("keep", index)
        return saved

    def _start(self, x_TD: torch.Tensor) -> None:
        if self.copies is None:
            self.device = x_TD.device
            cuda = x_TD.device.type == "cuda"
            self.copies = _CudaCopies(x_TD.device, self.timing) if cuda else _SyncCopies()

    def _take_slot(self, index: int, nbytes: int) -> torch.Tensor:
        """A free host slot of layer `index` (reused every step) that holds `nbytes`, else a new
        one; free slots too small for it are dropped then, so a layer never holds more slots
        than it has inputs offloaded at once."""
        free = self.free_slots.setdefault(index, [])
        for i, slot in enumerate(free):
            if slot.numel() >= nbytes:
                return free.pop(i)
        self.host_bytes -= sum(slot.numel() for slot in free)
        free.clear()
        size = self._slot_bytes(nbytes)
        self.host_allocations += 1
        self.host_bytes += size
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)

    def _slot_bytes(self, nbytes: int) -> int:
        """Pinned: the next power of two, the block torch's pinned CachingHostAllocator hands
        out anyway (its default rounding), so `host_bytes` is the pinned memory the pool holds
        (dropped slots go back to torch's pinned cache, still pinned) and a slightly longer
        batch still fits the slot."""
        return 1 << (nbytes - 1).bit_length() if self.pin and nbytes > 1 else nbytes

    # -- backward ---------------------------------------------------------------------------
    def backward_start(self, index: int, saved: _Saved | None) -> None:
        """Layer `index`'s backward begins: have its own input reloading, prefetch the next."""
        self._note("backward_start", index)
        if saved is not None and saved.state == "done":
            raise RuntimeError(
                "activation offload frees each layer input after its first backward; "
                "for retain_graph=True / double backward use mode='recompute'"
            )
        if saved is not None:
            if saved.state == "host":
                self._reload(saved, self._claim_buffer(saved))  # not prefetched: exposed copy
            saved.state = "in_use"
        self._prefetch_next()

    def input_for(self, saved: _Saved) -> torch.Tensor:
        """The layer's input on the device, once the compute stream has waited (an event)
        for its reload; a kept input was written on the compute stream itself."""
        assert saved.state == "in_use", f"layer {saved.index} input is {saved.state}"
        if saved.ready is not None:
            self.copies.wait(saved.ready)
        return saved.view(saved.own if saved.own is not None else self.buffers[saved.buffer])

    def backward_end(self, index: int, saved: _Saved | None) -> None:
        """Layer `index`'s backward is enqueued: free its buffer and host slot."""
        if saved is not None:
            if saved.buffer is not None:
                self.buffer_free[saved.buffer] = self.copies.record_compute()
                self.owners[saved.buffer] = None
            if saved.slot is not None:
                self.free_slots.setdefault(saved.index, []).append(saved.slot)
            saved.state, saved.buffer, saved.slot, saved.own = "done", None, None, None
        self._note("backward_end", index)
        if index == 0:
            self.steps += 1
        self._prefetch_next()  # one buffer: the reload of the next layer can only go now

    def _prefetch_next(self) -> None:
        """Reload the next offloaded input backward will need, if a buffer is free and no
        prefetch is already waiting (at most one layer ahead, as the schedule promises)."""
        if any((o := self._owner(b)) is not None and o.state == "loading"
               for b in range(len(self.buffers))):  # fmt: skip
            return
        nxt = self._next_pending()
        if nxt is None:
            return
        buffer = self._free_buffer(nxt.nbytes)
        if buffer is not None:
            self._reload(nxt, buffer)

    def _next_pending(self) -> _Saved | None:
        while self.pending:
            saved = self.pending[-1]()
            if saved is not None and saved.state == "host":
                return saved
            self.pending.pop()  # reloaded already, or its graph was dropped
        return None

    def _reload(self, saved: _Saved, buffer: int | None) -> None:
        n = saved.nbytes
        if buffer is None:  # every buffer holds another live graph's last input
            saved.own = self._device_bytes(n)
            self.own_inputs.add(saved)
            after = self.copies.record_compute()  # the allocator may hand out a block in use
            saved.ready = self.copies.copy("h2d", saved.own, saved.slot[:n], after)
        else:
            after = self.buffer_free[buffer]  # the previous reader of this buffer is done
            dst = self.buffers[buffer][:n]
            saved.ready = self.copies.copy("h2d", dst, saved.slot[:n], after)
            self.buffer_written[buffer] = saved.ready
            self.owners[buffer] = weakref.ref(saved)
        saved.state, saved.buffer = "loading", buffer
        self.bytes_reloaded += saved.nbytes
        self._count_resident()
        self._note("prefetch", saved.index)

    def _free_buffer(self, nbytes: int) -> int | None:
        if not self.buffers:
            self._allocate_buffers()
        for b in range(len(self.buffers)):
            if self._owner(b) is None:
                if self.buffers[b].numel() < nbytes:  # a longer batch than any before
                    self.buffers[b] = self._device_bytes(nbytes)
                    self.buffer_free[b] = self.copies.record_compute()  # see _allocate_buffers
                    self.buffer_written[b] = None
                return b
        return None

    def _claim_buffer(self, saved: _Saved) -> int | None:
        """A buffer for `saved`, taking one back from a prefetch that is not in use if needed
        (only when backward runs in an unexpected order; correctness does not depend on it).
        None when every buffer holds an input in use or kept for a later backward."""
        buffer = self._free_buffer(saved.nbytes)
        if buffer is None:
            loading = [b for b in range(len(self.buffers)) if self._owner(b).state == "loading"]
            if not loading:
                return None
            buffer = loading[0]
            victim = self._owner(buffer)
            victim.state, victim.buffer, victim.ready = "host", None, None
            self.pending.append(weakref.ref(victim))
            self.owners[buffer] = None
            buffer = self._free_buffer(saved.nbytes)
        return buffer

    def _device_bytes(self, nbytes: int) -> torch.Tensor:
        """A new flat device tensor for the copy stream to write into."""
        flat = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.copies.track(flat)
        return flat

    def _allocate_buffers(self) -> None:
        nbytes = self.max_nbytes
        count = self._buffer_count(nbytes)
        self.buffers = [self._device_bytes(nbytes) for _ in range(count)]
        # A new block may be one that kernels still queued on the compute stream use (the
        # allocator reuses a freed block at once, in stream order): the copy stream's first
        # write waits on an event recorded now, as each later one waits on its last reader.
        self.buffer_free = [self.copies.record_compute()] * count
        self.owners, self.buffer_written = [None] * count, [None] * count

    def _buffer_count(self, nbytes: int) -> int:
        if self.double_buffer is False:
            return 1
        if self.double_buffer == "auto" and self.device.type == "cuda":
            free = _free_device_bytes(self.device)  # once per pool
            if free < (2 + _RECOMPUTE_RESERVE) * nbytes:
                _log_once(
                    f"activation offload: {free / 2**30:.1f} GiB free on {self.device} leaves no "
                    f"room for a second {nbytes / 2**20:.0f} MiB reload buffer; using one "
                    "(reloads will not overlap compute)"
                )
                return 1
        return 2


def _free_device_bytes(device: torch.device) -> int:
    """What new tensors can get on `device`: free device memory plus what torch's caching
    allocator has reserved but not allocated (`mem_get_info` counts that as used)."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
