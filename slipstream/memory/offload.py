"""Activation checkpointing per decoder layer, with the checkpoints offloaded to host memory.

`apply_checkpointing(model, mode)` wraps every layer of `model.decoder_layers()` (any module
called as `layer(x, *args, **kwargs)`, hidden states first, that returns x or a tuple (x,
*extra tensors), such as a MoE layer's router statistics: a native layer's `(x_TD, seq,
cos_sin)`, a transformers `GradientCheckpointingLayer`'s `(hidden_states, position_embeddings=
..., **kwargs)`) by swapping its class for a subclass whose `forward` checkpoints and returns
the same; parameter and `state_dict()` names do not change. The other arguments pass through
untracked; a call where one of them requires grad is recomputed by torch's checkpoint instead.

- "recompute": the same Function as offload, its input kept where it is (no pool). Not
  torch's `checkpoint(..., use_reentrant=False)`, which builds each op's graph node in forward
  (with grad on): those small long-lived allocations land between the layer's freed (T, F)
  temporaries on the host heap, which then cannot be reused by the next layer. Measured on
  CPU (8 SmolLM2-wide layers, 2,048 tokens, LoRA): 44 MB of RSS held per layer after forward
  with torch's checkpoint, 3 MB with the Function (one layer's temporaries, reused); at 30
  layers and 1,024 tokens 0.36 GB of a 2.1 GB peak. torch's checkpoint remains for a call
  whose other arguments require grad (`_tracked`).
- "offload": `_OffloadedLayer`, an autograd Function. Forward runs the layer without a graph
  and hands its input to the `OffloadPool` (slipstream.memory.pool: the copy schedule, the
  buffers and the statistics benchmarks read); backward gets it back, recomputes the layer
  with grad and backprops through it. RNG state (dropout) is restored for the recompute, as
  torch checkpoint does. A layer's extra outputs are outputs of the Function too, so a loss
  built on them (the MoE auxiliary loss) sends its gradient through the recompute's
  `autograd.grad` with the layer output's; an extra output no loss uses costs no backward work.
- "none": the model is left as it is (an earlier wrapping is undone).

On CPU and on integrated GPUs "offload" means "recompute" (nothing to gain), unless
`force=True`: then the same pool runs with synchronous `copy_`s and plain tensors as host
slots and device buffers, so CPU tests exercise the real schedule and bookkeeping.

Shapes: T tokens, D hidden.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import MutableMapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from slipstream.memory.pool import OffloadPool, OffloadStats, _log_once

MODES = ("offload", "recompute", "none")
_POOLS: weakref.WeakKeyDictionary[nn.Module, OffloadPool] = weakref.WeakKeyDictionary()
__all__ = ["MODES", "OffloadPool", "OffloadStats", "apply_checkpointing", "get_offload_pool"]


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

    Inputs: (layer, args, kwargs, x_TD, *params that require grad). The layer's other
    arguments `args`/`kwargs` (native: seq, cos_sin) pass through untracked (none needs
    grad); params are inputs so their gradients flow back through the engine like any other
    leaf's. Outputs: the layer's (out_TD, or (out_TD, *extras)).
    """

    @staticmethod
    def forward(ctx, layer, args, kwargs, x_TD, *params):
        plan: _Plan = layer._slipstream_plan
        ctx.layer, ctx.args, ctx.kwargs = layer, args, kwargs
        ctx.rng = _RngState(x_TD.device) if plan.preserve_rng_state else None
        dt = x_TD.device.type  # autocast as in forward, for the recompute
        on = dt != "meta" and torch.is_autocast_enabled(dt)  # meta: the memory planner's probe
        ctx.autocast = (dt, on, torch.get_autocast_dtype(dt) if on else None)
        ctx.set_materialize_grads(False)  # an unused extra output costs no backward work
        # Issue the copy before the layer runs so that it overlaps the layer's forward.
        # The last layer's input goes into a reload buffer (see `OffloadPool.keep`).
        if plan.pool is None:  # recompute: the input stays where it is
            ctx.saved = None
        else:
            save = plan.pool.keep if plan.last else plan.pool.save
            ctx.saved = save(plan.index, x_TD)
        ctx.save_for_backward(*(params if ctx.saved is not None else (x_TD, *params)))
        return layer._slipstream_base.forward(layer, x_TD, *args, **kwargs)

    @staticmethod
    def backward(ctx, *grad_outs):
        layer, saved = ctx.layer, ctx.saved
        plan: _Plan = layer._slipstream_plan
        pool = plan.pool if plan.pool is not None else _NO_POOL
        pool.backward_start(plan.index, saved)  # issues the prefetch of the next layer first
        if saved is not None:
            x_TD, params = pool.input_for(saved), ctx.saved_tensors
        else:
            x_TD, *params = ctx.saved_tensors
        x_TD = x_TD.detach().requires_grad_(ctx.needs_input_grad[3])
        device_type, autocast_on, autocast_dtype = ctx.autocast
        rng = ctx.rng.restored() if ctx.rng is not None else contextlib.nullcontext()
        autocast = (
            torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_on)
            if device_type != "meta"
            else contextlib.nullcontext()
        )
        pool._note("recompute", plan.index)
        with torch.enable_grad(), rng, autocast:
            outputs = layer._slipstream_base.forward(layer, x_TD, *ctx.args, **ctx.kwargs)
        outputs = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
        # An extra output may need no grad in the recompute though forward marked it as
        # needing it (MoE: layer 0's router under LoRA that leaves routers frozen).
        pairs = [(o, g) for o, g in zip(outputs, grad_outs) if g is not None and o.requires_grad]
        inputs = ([x_TD] if x_TD.requires_grad else []) + list(params)
        grads = [None] * len(inputs)
        if pairs:
            outs, grads_out = zip(*pairs)
            grads = torch.autograd.grad(outs, inputs, grads_out, allow_unused=True)
        del x_TD, outputs, pairs  # the buffer's readers are all enqueued now
        pool.backward_end(plan.index, saved)
        grad_x = grads[0] if ctx.needs_input_grad[3] else None
        return (None, None, None, grad_x, *grads[len(grads) - len(params) :])


def _checkpointed_forward(self, x_TD: torch.Tensor, *args, **kwargs):
    """`forward` of a wrapped layer (see `_checkpointed_class`)."""
    plan: _Plan = self._slipstream_plan
    base = self._slipstream_base.forward
    if not torch.is_grad_enabled():  # eval / generation: nothing to save
        return base(self, x_TD, *args, **kwargs)
    if _tracked(args, kwargs):
        return checkpoint(
            base, self, x_TD, *args, use_reentrant=False,
            preserve_rng_state=plan.preserve_rng_state, **kwargs,
        )  # fmt: skip
    params = [p for p in self.parameters() if p.requires_grad]
    if not (x_TD.requires_grad or params):
        return base(self, x_TD, *args, **kwargs)
    return _OffloadedLayer.apply(self, args, kwargs, x_TD, *params)


class _NoPool:
    """What recompute's backward calls of a pool: nothing to prefetch, note or release."""

    def backward_start(self, index: int, saved: None) -> None:
        pass

    def backward_end(self, index: int, saved: None) -> None:
        pass

    def _note(self, what: str, index: int) -> None:
        pass


_NO_POOL = _NoPool()


def _tracked(args: tuple, kwargs: dict) -> bool:
    """Whether any tensor among a layer's other arguments (one level into tuples) requires
    grad: offload passes them through untracked, so such a call is recomputed instead. So is
    a call given a mutable mapping (transformers' Gemma 4 `shared_kv_states`): a side channel
    the layer writes tensors into, which offload's graph-free forward would leave without
    grad (the K/V a later layer reuses would send it none)."""
    values = [*args, *kwargs.values()]
    if any(isinstance(v, MutableMapping) for v in values):
        return True
    values += [t for v in values if isinstance(v, tuple | list) for t in v]
    return any(isinstance(v, torch.Tensor) and v.requires_grad for v in values)


_CLASSES: dict[type, type] = {}


def _checkpointed_class(cls: type) -> type:
    """A subclass of the layer's class whose forward checkpoints. Swapping `__class__` keeps
    the module tree, parameter names and hooks exactly as they were (FSDP2 does the same)."""
    if cls not in _CLASSES:
        attrs = {"forward": _checkpointed_forward, "_slipstream_base": cls}
        _CLASSES[cls] = type(f"Checkpointed{cls.__name__}", (cls,), attrs)
    return _CLASSES[cls]


def _layers(model: nn.Module) -> nn.ModuleList:
    layers = getattr(model, "decoder_layers", None)
    if layers is None:
        raise ValueError(
            f"{type(model).__name__} has no decoder_layers(); apply_checkpointing needs a "
            "slipstream model (slipstream.load_model)."
        )
    return layers()


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
