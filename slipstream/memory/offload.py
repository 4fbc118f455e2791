"""Activation checkpointing per decoder layer, with the checkpoints offloaded to host memory.

`apply_checkpointing(model, mode)` wraps every layer of `model.model.layers` (any module called
as `layer(x_TD, seq, cos_sin) -> x_TD`) by swapping its class for a subclass whose `forward`
checkpoints; parameter and `state_dict()` names do not change.

- "recompute": `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)` per layer.
- "offload": `_OffloadedLayer`, an autograd Function. Forward runs the layer without a graph
  and keeps only a handle: the layer input is copied device->host on a copy stream into a
  host slot from `OffloadPool` (pinned, allocated on the first step, reused after). Backward of
  layer i first issues the reload of the next layer to come (i-1) into a free device buffer,
  then waits (an event, never a stream or host sync) for its own input, recomputes the layer
  with grad and backprops through it. With two buffers the reload of i-1 runs under layer i's
  recompute and backward; with one buffer it is issued when layer i frees the buffer.
  The last layer's input (its backward comes first) and inputs under `min_offload_bytes` stay
  on the device. RNG state (dropout) is restored for the recompute, as torch checkpoint does.
  Layers holding an MoE block with an auxiliary loss recompute instead (see `_has_side_outputs`).
- "none": the model is left as it is (an earlier wrapping is undone).

On CPU and on integrated GPUs "offload" means "recompute" (nothing to gain), unless
`force=True`: then the same pool runs with synchronous `copy_`s and plain tensors as host
slots and device buffers, so CPU tests exercise the real schedule and bookkeeping.

Statistics for benchmarks: `get_offload_pool(model).stats()` -> `OffloadStats` (bytes
offloaded/reloaded, steps, buffers, host pool size, allocations, max resident inputs) and,
with `timing=True` on CUDA, copy and exposed-wait times from CUDA events (reading them
synchronizes: call `stats()` between steps, never inside one). `pool.reset_stats()` starts a
new measurement; `pool.events` (with `record_events=True`) logs ("offload"|"prefetch"|
"backward_start"|"recompute"|"backward_end", layer) in order.

Shapes: T tokens, D hidden.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

log = logging.getLogger(__name__)

MODES = ("offload", "recompute", "none")
_POOLS: weakref.WeakKeyDictionary[nn.Module, OffloadPool] = weakref.WeakKeyDictionary()
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
    host_bytes: int  # host (pinned on CUDA) pool size
    host_allocations: int  # host slots allocated since the pool was made (not reset)
    max_resident: int  # most offloaded inputs on the device at once during backward
    d2h_ms: float | None = None  # sum of device->host copy durations (copy stream)
    h2d_ms: float | None = None  # sum of host->device copy durations (copy stream)
    exposed_ms: float | None = None  # time the compute stream stood waiting for reloads

    @property
    def h2d_gbps(self) -> float | None:
        return self.bytes_reloaded / self.h2d_ms / 1e6 if self.h2d_ms else None

    @property
    def d2h_gbps(self) -> float | None:  # while forward runs, so it overlaps compute
        return self.bytes_offloaded / self.d2h_ms / 1e6 if self.d2h_ms else None


class _SyncCopies:
    """CPU twin of `_CudaCopies`: copies happen at once, events are None."""

    def record_compute(self) -> None:
        return None

    def copy(self, kind: str, dst: torch.Tensor, src: torch.Tensor, after: Any) -> None:
        dst.copy_(src)

    def wait(self, event: Any) -> None:
        pass

    def release(self, device_tensor: torch.Tensor) -> None:
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

    def release(self, device_tensor: torch.Tensor) -> None:
        """About to drop a device tensor the copy stream may still write: keep it until then."""
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
                 "__weakref__")  # fmt: skip

    def __init__(self, index: int, x: torch.Tensor, slot: torch.Tensor) -> None:
        self.index, self.shape, self.dtype, self.nbytes = index, x.shape, x.dtype, x.nbytes
        self.slot = slot
        self.state = "host"  # host -> loading (reload issued) -> in_use -> done
        self.buffer: int | None = None
        self.ready: Any = None  # event: the reload into `buffer` has finished

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[: self.nbytes].view(self.dtype).view(self.shape)


class OffloadPool:
    """Host slots for offloaded layer inputs and the one or two device buffers they reload into.

    Host slots are kept per layer index and reused every step; a slot is only allocated when
    a layer has none free that is large enough (first step, or a longer batch).
    """

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
        self.owners: list[_Saved | None] = []
        self.buffer_free: list[Any] = []  # event: the last reader of the buffer has finished
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

    # -- forward ----------------------------------------------------------------------------
    def save(self, index: int, x_TD: torch.Tensor) -> _Saved | None:
        """Start copying `x_TD` to a host slot; None when it is too small to be worth it."""
        if x_TD.nbytes < self.min_offload_bytes:
            return None
        if self.copies is None:
            self.device = x_TD.device
            cuda = x_TD.device.type == "cuda"
            self.copies = _CudaCopies(x_TD.device, self.timing) if cuda else _SyncCopies()
        saved = _Saved(index, x_TD, self._take_slot(index, x_TD.nbytes))
        after = self.copies.record_compute()  # the copy may start once x_TD is written
        self.copies.copy("d2h", saved.view(saved.slot), x_TD, after)
        self.pending.append(weakref.ref(saved))
        self.max_nbytes = max(self.max_nbytes, saved.nbytes)
        self.bytes_offloaded += saved.nbytes
        self._note("offload", index)
        return saved

    def _take_slot(self, index: int, nbytes: int) -> torch.Tensor:
        free = self.free_slots.setdefault(index, [])
        for i, slot in enumerate(free):
            if slot.numel() >= nbytes:
                return free.pop(i)
        self.host_allocations += 1
        self.host_bytes += nbytes
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

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
        """The reloaded input, once the compute stream has waited (an event) for its copy."""
        assert saved.state == "in_use", f"layer {saved.index} input is {saved.state}"
        self.copies.wait(saved.ready)
        return saved.view(self.buffers[saved.buffer])

    def backward_end(self, index: int, saved: _Saved | None) -> None:
        """Layer `index`'s backward is enqueued: free its buffer and host slot."""
        if saved is not None:
            self.buffer_free[saved.buffer] = self.copies.record_compute()
            self.owners[saved.buffer] = None
            self.free_slots.setdefault(saved.index, []).append(saved.slot)
            saved.state, saved.buffer, saved.slot = "done", None, None
        self._note("backward_end", index)
        if index == 0:
            self.steps += 1
        self._prefetch_next()  # one buffer: the reload of the next layer can only go now

    def _prefetch_next(self) -> None:
        """Reload the next offloaded input backward will need, if a buffer is free and no
        prefetch is already waiting (at most one layer ahead, as the schedule promises)."""
        if any(o is not None and o.state == "loading" for o in self.owners):
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

    def _reload(self, saved: _Saved, buffer: int) -> None:
        after = self.buffer_free[buffer]  # the previous reader of this buffer is done
        n = saved.nbytes
        saved.ready = self.copies.copy("h2d", self.buffers[buffer][:n], saved.slot[:n], after)
        saved.state, saved.buffer = "loading", buffer
        self.owners[buffer] = saved
        self.bytes_reloaded += saved.nbytes
        resident = sum(o is not None for o in self.owners)
        self.max_resident = max(self.max_resident, resident)
        self._note("prefetch", saved.index)

    def _free_buffer(self, nbytes: int) -> int | None:
        if not self.buffers:
            self._allocate_buffers()
        for b, owner in enumerate(self.owners):
            if owner is None:
                if self.buffers[b].numel() < nbytes:  # a longer batch than any before
                    self.copies.release(self.buffers[b])
                    self.buffers[b] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                return b
        return None

    def _claim_buffer(self, saved: _Saved) -> int:
        """A buffer for `saved`, taking one back from a prefetch that is not in use if needed
        (only when backward runs in an unexpected order; correctness does not depend on it)."""
        buffer = self._free_buffer(saved.nbytes)
        if buffer is None:
            buffer = next(b for b, o in enumerate(self.owners) if o.state == "loading")
            victim = self.owners[buffer]
            victim.state, victim.buffer, victim.ready = "host", None, None
            self.pending.append(weakref.ref(victim))
            self.owners[buffer] = None
            buffer = self._free_buffer(saved.nbytes)
        return buffer

    def _allocate_buffers(self) -> None:
        nbytes, count = self.max_nbytes, 2
        if self.double_buffer is False:
            count = 1
        elif self.double_buffer == "auto" and self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)  # once per pool
            if free < (2 + _RECOMPUTE_RESERVE) * nbytes:
                count = 1
                _log_once(
                    f"activation offload: {free / 2**30:.1f} GiB free on {self.device} leaves no "
                    f"room for a second {nbytes / 2**20:.0f} MiB reload buffer; using one "
                    "(reloads will not overlap compute)"
                )
        self.buffers = [
            torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(count)
        ]
        self.owners, self.buffer_free = [None] * count, [None] * count


class _RngState:
    """CPU and (on CUDA) device RNG state at forward time, so dropout recomputes identically."""

    def __init__(self, device: torch.device) -> None:
        self.device = device if device.type == "cuda" else None
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if self.device is not None else None

    @contextlib.contextmanager
    def restored(self):
        devices = [self.device] if self.device is not None else []
        with torch.random.fork_rng(devices=devices, device_type="cuda"):
            torch.set_rng_state(self.cpu)
            if self.device is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield


def _autocast_state(device_type: str) -> tuple[str, bool, torch.dtype | None]:
    if not torch.is_autocast_enabled(device_type):
        return device_type, False, None
    return device_type, True, torch.get_autocast_dtype(device_type)


@dataclass
class _Plan:
    """How one wrapped layer runs: its mode, position and the pool it offloads into."""

    mode: str
    index: int
    last: bool
    pool: OffloadPool | None
    preserve_rng_state: bool


class _OffloadedLayer(torch.autograd.Function):
    """Runs a layer without a graph; backward reloads its input, recomputes, backprops.

    Inputs: (layer, seq, cos_sin, x_TD, *params that require grad). `seq` and `cos_sin`
    pass through untracked (they never need grad); params are inputs so their gradients
    flow back through the engine like any other leaf's.
    """

    @staticmethod
    def forward(ctx, layer, seq, cos_sin, x_TD, *params):
        plan: _Plan = layer._slipstream_plan
        ctx.layer, ctx.seq, ctx.cos_sin = layer, seq, cos_sin
        ctx.rng = _RngState(x_TD.device) if plan.preserve_rng_state else None
        ctx.autocast = _autocast_state(x_TD.device.type)
        # Issue the copy before the layer runs so that it overlaps the layer's forward.
        ctx.saved = None if plan.last else plan.pool.save(plan.index, x_TD)
        ctx.save_for_backward(*(params if ctx.saved is not None else (x_TD, *params)))
        return layer._slipstream_base.forward(layer, x_TD, seq, cos_sin)

    @staticmethod
    def backward(ctx, grad_TD):
        layer, saved = ctx.layer, ctx.saved
        plan: _Plan = layer._slipstream_plan
        pool = plan.pool
        pool.backward_start(plan.index, saved)  # issues the prefetch of the next layer first
        if saved is not None:
            x_TD, params = pool.input_for(saved), ctx.saved_tensors
        else:
            x_TD, *params = ctx.saved_tensors
        x_TD = x_TD.detach().requires_grad_(ctx.needs_input_grad[3])
        device_type, autocast_on, autocast_dtype = ctx.autocast
        rng = ctx.rng.restored() if ctx.rng is not None else contextlib.nullcontext()
        autocast = torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_on)
        pool._note("recompute", plan.index)
        with torch.enable_grad(), rng, autocast:
            out_TD = layer._slipstream_base.forward(layer, x_TD, ctx.seq, ctx.cos_sin)
        inputs = ([x_TD] if x_TD.requires_grad else []) + list(params)
        grads = torch.autograd.grad(out_TD, inputs, grad_TD, allow_unused=True)
        del out_TD, x_TD  # the buffer's readers are all enqueued now
        pool.backward_end(plan.index, saved)
        grad_x = grads[0] if ctx.needs_input_grad[3] else None
        return (None, None, None, grad_x, *grads[len(grads) - len(params) :])


def _checkpointed_forward(self, x_TD: torch.Tensor, seq, cos_sin) -> torch.Tensor:
    """`forward` of a wrapped layer (see `_checkpointed_class`)."""
    plan: _Plan = self._slipstream_plan
    base = self._slipstream_base.forward
    if not torch.is_grad_enabled():  # eval / generation: nothing to save
        return base(self, x_TD, seq, cos_sin)
    if plan.mode == "recompute" or _has_side_outputs(self):
        return checkpoint(
            base, self, x_TD, seq, cos_sin, use_reentrant=False,
            preserve_rng_state=plan.preserve_rng_state,
        )  # fmt: skip
    params = [p for p in self.parameters() if p.requires_grad]
    if not (x_TD.requires_grad or params):
        return base(self, x_TD, seq, cos_sin)
    if isinstance(cos_sin, tuple | list) and any(getattr(t, "requires_grad", 0) for t in cos_sin):
        raise ValueError("cos_sin requires grad; activation offload passes it through untracked")
    return _OffloadedLayer.apply(self, seq, cos_sin, x_TD, *params)


def _has_side_outputs(layer: nn.Module) -> bool:
    """An MoE block with an auxiliary loss stores router stats that need the forward's graph;
    a graph-free forward would drop that gradient, so such layers recompute instead."""
    if not any(getattr(m, "aux_loss_coef", 0.0) > 0 for m in layer.modules()):
        return False
    _log_once("activation offload: MoE layers with router_aux_loss_coef > 0 recompute instead")
    return True


_CLASSES: dict[type, type] = {}


def _checkpointed_class(cls: type) -> type:
    """A subclass of the layer's class whose forward checkpoints. Swapping `__class__` keeps
    the module tree, parameter names and hooks exactly as they were (FSDP2 does the same)."""
    if cls not in _CLASSES:
        attrs = {"forward": _checkpointed_forward, "_slipstream_base": cls}
        _CLASSES[cls] = type(f"Checkpointed{cls.__name__}", (cls,), attrs)
    return _CLASSES[cls]


def _layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"{type(model).__name__} has no model.layers ModuleList; apply_checkpointing "
            "needs a slipstream CausalLM (slipstream.load_model)."
        )
    return layers


def _unwrap(layer: nn.Module) -> None:
    base = type(layer).__dict__.get("_slipstream_base")
    if base is not None:
        layer.__class__ = base
        del layer._slipstream_plan


def _offload_supported(model: nn.Module) -> str | None:
    """None when offload helps on the model's device, else why not."""
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    if device.type != "cuda":
        return f"activation offload needs a CUDA device (model is on {device}); recomputing"
    if torch.cuda.get_device_properties(device).is_integrated:
        return "activation offload: integrated GPU shares host memory; recomputing instead"
    return None


def apply_checkpointing(
    model: nn.Module,
    mode: str = "offload",
    *,
    min_offload_bytes: int = 1 << 20,
    double_buffer: bool | str = "auto",
    preserve_rng_state: bool = True,
    timing: bool = False,
    force: bool = False,
    record_events: bool = False,
) -> OffloadPool | None:
    """Checkpoint every decoder layer of `model` in place: "offload", "recompute" or "none".

    Apply after LoRA and after the model is on its device. Returns the `OffloadPool` when
    offloading (also `get_offload_pool(model)`), else None. `force=True` runs the offload
    schedule on CPU too (synchronous copies; for tests). `timing=True` records CUDA events
    for copy and exposed-wait times (`pool.stats()`).
    """
    if mode not in MODES:
        raise ValueError(f"activation checkpointing mode {mode!r}; use one of {', '.join(MODES)}")
    if double_buffer not in (True, False, "auto"):
        raise ValueError(f"double_buffer={double_buffer!r}; use True, False or 'auto'")
    layers = _layers(model)
    for layer in layers:
        _unwrap(layer)
    _POOLS.pop(model, None)
    if mode == "none":
        return None
    pool = None
    if mode == "offload":
        reason = None if force else _offload_supported(model)
        if reason is not None:
            _log_once(reason)
            mode = "recompute"
        else:
            pin = torch.cuda.is_available() and next(model.parameters()).is_cuda
            pool = OffloadPool(
                pin=pin, min_offload_bytes=min_offload_bytes, double_buffer=double_buffer,
                timing=timing, record_events=record_events,
            )  # fmt: skip
            _POOLS[model] = pool
    for i, layer in enumerate(layers):
        layer.__class__ = _checkpointed_class(type(layer))
        layer._slipstream_plan = _Plan(mode, i, i == len(layers) - 1, pool, preserve_rng_state)
    return pool


def get_offload_pool(model: nn.Module) -> OffloadPool | None:
    """The pool `apply_checkpointing(model, "offload")` made, or None."""
    return _POOLS.get(model)
