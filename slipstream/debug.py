"""Host-sync audit: `count_syncs()` counts the operations that would stall the host on a GPU.

A host sync is any op whose result (a Python number, a data-dependent output shape, host
memory) is only known once the device has caught up: `.item()`, `.tolist()`, `nonzero`,
boolean-mask indexing, `unique`, `.cpu()`, `if tensor:` ... One per layer is 40 stalls a
step on a 40-layer model, each draining the launch queue.

Ops are judged by what they would do on CUDA, so the audit works on CPU tensors too: a CPU
test reading 0 proves the GPU path sync-free. Three interposers cooperate:
- the Tensor methods that sync without reaching the dispatcher as an op (`.tolist()`,
  `.numpy()`, `.cpu()`, `__bool__`, ...) and those judged by their arguments (`.to`,
  `__setitem__`: `x[mask] = 0.0`) are wrapped on `torch.Tensor` for the block;
- a TorchFunctionMode judges the same methods when they are called past the class attribute
  (`torch._C.TensorBase.tolist(x)`);
- a TorchDispatchMode sees aten ops, including those run by autograd in backward and
  those called from inside other torch functions (`_local_scalar_dense`, `nonzero`,
  `index` with a bool index, `_unique2`, ...).
The outermost interposer that judges a call counts it; the inner ones ignore it and what it
dispatches, so one `.item()` counts once.

Why the wrappers: the autograd engine runs every node under the torch-function mode stack it
captured when backward started (empty: `backward` and `autograd.grad` are overridable, so
they reach the mode's handler, which runs with the mode popped). A `.tolist()` in a custom
Function's backward or a checkpoint's recompute would never reach the mode; a class
attribute does not depend on the mode stack. The wrappers count calls from every thread.

Copies to the CPU count when the copy blocks: `.cpu()` and `.numpy()` always; `.to(...)` and
`copy_` from a device unless `non_blocking=True` into pinned memory. On a CPU run a
CPU->CPU `.to` counts only with `cpu_copies=True`.
"""

from __future__ import annotations

import contextlib
import os
import threading
import traceback
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Python-level methods that sync by themselves.
_SYNC_METHODS = {
    torch.Tensor.item: "item",
    torch.Tensor.tolist: "tolist",
    torch.Tensor.cpu: "cpu",
    torch.Tensor.numpy: "numpy",
    torch.Tensor.__array__: "numpy",
    torch.Tensor.__bool__: "bool(tensor)",
    torch.Tensor.__int__: "int(tensor)",
    torch.Tensor.__float__: "float(tensor)",
    torch.Tensor.__index__: "index(tensor)",
    torch.Tensor.__complex__: "complex(tensor)",
}

# aten overload packets that sync on CUDA whatever their arguments.
_SYNC_OPS = {
    aten._local_scalar_dense: "item",
    aten.is_nonzero: "bool(tensor)",
    aten.equal: "equal",
    aten.allclose: "allclose",
    aten.nonzero: "nonzero",
    aten.argwhere: "nonzero",
    aten.masked_select: "masked_select",
    aten.unique_dim: "unique",
    aten._unique: "unique",
    aten._unique2: "unique",
    aten.unique_consecutive: "unique",
    aten.unique_dim_consecutive: "unique",
    aten.bincount: "bincount",  # CUDA bincount reads max(x) back to size its output
}
_INDEX_PUT_OPS = {aten.index_put, aten.index_put_, aten._index_put_impl_}

# Every Tensor method the function mode judges, by attribute name: wrapped on the class for
# the block. Kept as found at import, so a wrapper never stands in for the real method.
_TENSOR_TO = torch.Tensor.to
_TENSOR_SETITEM = torch.Tensor.__setitem__
_WRAPPED_METHODS = {
    **{method.__name__: method for method in _SYNC_METHODS},
    "to": _TENSOR_TO,
    "__setitem__": _TENSOR_SETITEM,
}


def _is_mask(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


def _index_has_mask(index: object) -> bool:
    if isinstance(index, tuple | list):
        return any(_is_mask(i) for i in index)
    return _is_mask(index)


def _non_blocking(args: tuple, kwargs: dict) -> bool:
    """`non_blocking` of a `.to(...)`/`copy_` call: the first positional bool, or the kwarg."""
    positional = next((a for a in args[1:] if isinstance(a, bool)), False)
    return bool(kwargs.get("non_blocking", positional))


def _target_device(args: tuple, kwargs: dict) -> torch.device | None:
    """The device a `Tensor.to(...)` call names, or None when it names none."""
    for a in (*args[1:], kwargs.get("device")):
        if isinstance(a, str | torch.device):
            return torch.device(a)
        if isinstance(a, torch.Tensor):
            return a.device
    return None


class SyncCounts:
    """Result of `count_syncs()`: `.total`, `.by_op` (name -> count), `.sites` (name -> first
    call site outside torch, "file:line")."""

    def __init__(self) -> None:
        self.by_op: dict[str, int] = {}
        self.sites: dict[str, str] = {}

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def add(self, name: str) -> None:
        if name not in self.by_op:
            self.sites[name] = _call_site()
        self.by_op[name] = self.by_op.get(name, 0) + 1

    def __str__(self) -> str:
        if not self.by_op:
            return "0 host syncs"
        parts = [f"{n} x{c} (first at {self.sites[n]})" for n, c in sorted(self.by_op.items())]
        return f"{self.total} host syncs: " + ", ".join(parts)

    __repr__ = __str__


_HERE = os.path.abspath(__file__)
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


def _call_site() -> str:
    # Only paid when a sync is first seen per op name, so cost does not matter.
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if path != _HERE and not path.startswith(_TORCH_DIR) and "contextlib" not in path:
            return f"{os.path.basename(path)}:{frame.lineno}"
    return "?"


class _FunctionCounter(TorchFunctionMode):
    def __init__(self, counts: SyncCounts, cpu_copies: bool) -> None:
        super().__init__()
        self.counts, self.cpu_copies = counts, cpu_copies
        # Per thread: the wrappers see every thread, and a call being counted in one (say a
        # loader's `.to`) must not hide a sync in another (the autograd device thread).
        self._depth = threading.local()

    @property
    def quiet(self) -> int:
        return getattr(self._depth, "n", 0)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Torch looks methods up on the class by name, so `func` may be one of our wrappers.
        return self.run(getattr(func, "_slipstream_method", func), func, args, kwargs or {})

    def run(self, method, func, args: tuple, kwargs: dict):
        """Call `func`, counting it as `method` unless an outer interposer already did."""
        name = self._sync_name(method, args, kwargs)
        if name is None:
            return func(*args, **kwargs)
        if name and not self.quiet:
            self.counts.add(name)
        self._depth.n = self.quiet + 1  # this call and what it dispatches are accounted for
        try:
            return func(*args, **kwargs)
        finally:
            self._depth.n -= 1

    def _sync_name(self, func, args: tuple, kwargs: dict) -> str | None:
        """A name to count; "" to run without counting what it dispatches; None to pass."""
        if func in _SYNC_METHODS:
            return _SYNC_METHODS[func]
        if func is _TENSOR_TO and args and isinstance(args[0], torch.Tensor):
            dst = _target_device(args, kwargs)
            if dst is None or dst.type != "cpu":
                return None
            if args[0].device.type != "cpu" and _non_blocking(args, kwargs):
                return ""  # async copy into pinned memory: the host does not wait
            if args[0].device.type != "cpu" or self.cpu_copies:
                return "copy to cpu"
            return ""
        if func is _TENSOR_SETITEM and len(args) == 3:
            index, value = args[1], args[2]
            # `x[mask] = 0.0` becomes masked_fill_ on the device: no sync (index_put_ checks
            # for one bool index and a one-element CPU value, which a Python number becomes).
            parts = index if isinstance(index, tuple) else (index,)
            tensors = [i for i in parts if isinstance(i, torch.Tensor)]
            if isinstance(value, int | float | bool) and len(tensors) == 1 and _is_mask(tensors[0]):
                return ""
        return None


class _DispatchCounter(TorchDispatchMode):
    def __init__(self, counts: SyncCounts, functions: _FunctionCounter) -> None:
        super().__init__()
        self.counts, self.functions = counts, functions

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.functions.quiet:
            name = self._sync_name(func, args, kwargs)
            if name:
                self.counts.add(name)
        return func(*args, **kwargs)

    def _sync_name(self, func, args: tuple, kwargs: dict) -> str | None:
        packet = func.overloadpacket
        if packet in _SYNC_OPS:
            return _SYNC_OPS[packet]
        if packet is aten.index and _index_has_mask(args[1]):
            return "bool-mask index"
        if packet in _INDEX_PUT_OPS and _index_has_mask(args[1]):
            return "bool-mask index_put"
        # Tensor repeats: the output length is sum(repeats), read back unless given.
        if (
            packet is aten.repeat_interleave
            and func is not aten.repeat_interleave.self_int
            and kwargs.get("output_size") is None
        ):
            return "repeat_interleave"
        if packet is aten._to_copy:
            src, dst = args[0], kwargs.get("device")
            to_host = dst is not None and torch.device(dst).type == "cpu"
            if to_host and src.device.type != "cpu" and not kwargs.get("non_blocking"):
                return "copy to cpu"
        if packet is aten.copy_:
            dst, src = args[0], args[1]
            if dst.device.type == "cpu" and src.device.type != "cpu":
                # The offload path's copy into a pinned buffer on a side stream is async.
                if _non_blocking(args[1:], kwargs) and dst.is_pinned():
                    return None
                return "copy to cpu"
        return None


def _wrap_sync_function(counts: SyncCounts, fn, name: str):
    def counted(*args, **kwargs):
        counts.add(name)
        return fn(*args, **kwargs)

    return counted


def _wrap_method(functions: _FunctionCounter, method, fn):
    """`fn` (the class attribute now: `method`, or an outer block's wrapper) judged as `method`."""

    def counted(*args, **kwargs):
        return functions.run(method, fn, args, kwargs)

    counted._slipstream_method = method
    return counted


@contextlib.contextmanager
def count_syncs(cpu_copies: bool = False) -> Iterator[SyncCounts]:
    """Count host-sync ops run inside the block, forward and backward, on any device.

    `with count_syncs() as c: loss.backward()` then `c.total`, `c.by_op`, `print(c)`.
    """
    from unittest import mock  # (imports asyncio: only when a block is counted)

    counts = SyncCounts()
    functions = _FunctionCounter(counts, cpu_copies)
    # Explicit synchronize calls are plain Python functions: wrap them for the block.
    syncs = [
        (torch.cuda, "synchronize", "cuda.synchronize"),
        (torch.cuda.Stream, "synchronize", "stream.synchronize"),
        (torch.cuda.Event, "synchronize", "event.synchronize"),
    ]
    if hasattr(torch, "accelerator") and hasattr(torch.accelerator, "synchronize"):
        syncs.append((torch.accelerator, "synchronize", "accelerator.synchronize"))
    replacements = [
        (owner, attr, _wrap_sync_function(counts, getattr(owner, attr), name))
        for owner, attr, name in syncs
    ]
    replacements += [
        (torch.Tensor, attr, _wrap_method(functions, method, getattr(torch.Tensor, attr)))
        for attr, method in _WRAPPED_METHODS.items()
    ]
    with contextlib.ExitStack() as patched:
        for owner, attr, value in replacements:  # put back as found (inherited: deleted again)
            patched.enter_context(mock.patch.object(owner, attr, value))
        with _DispatchCounter(counts, functions), functions:
            yield counts


@contextlib.contextmanager
def opaque_to_audit() -> Iterator[None]:
    """Run a call to compiled code with count_syncs' modes off, when a block is active.

    Dynamo will not run a compiled graph under a user's dispatch or function mode: it falls
    back to eager, where some ops (FlexAttention's higher-order op) have no rule for such a
    mode and fail, or build what the compiled kernel avoids (flex's T x T scores). A compiled
    graph holds no host syncs (dynamo breaks the graph at each), so nothing countable is
    skipped; on a GPU, `torch.cuda.set_sync_debug_mode` still sees the region.
    """
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode

    # Found on the mode stacks, not by a Python thread-local: CUDA backward (offload and
    # checkpoint recomputes) runs on autograd's device thread, which inherits the mode stacks
    # but not Python thread state. Only our two modes come off; any other (a user's
    # `torch.device(...)` context, say) stays where it was.
    function_stack = (
        lambda: [
            torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())
        ],
        torch._C._pop_torch_function_stack,
        torch._C._push_on_torch_function_stack,
    )
    dispatch_stack = (_get_current_dispatch_mode_stack, _pop_mode, _push_mode)
    with (
        _without(_FunctionCounter, *function_stack),
        _without(_DispatchCounter, *dispatch_stack),
    ):
        yield


@contextlib.contextmanager
def _without(kind: type, stack, pop, push) -> Iterator[None]:
    """The mode stack with the modes of `kind` taken out for the block, then as it was."""
    modes = stack()
    keep = [m for m in modes if not isinstance(m, kind)]
    if len(keep) == len(modes):
        yield
        return
    for _ in modes:
        pop()
    for m in keep:
        push(m)
    try:
        yield
    finally:
        for _ in keep:
            pop()
        for m in modes:
            push(m)
