"""count_syncs(): each sync op is seen on CPU, sync-free model code reads 0."""

import pytest
import torch
from torch import nn

from slipstream.debug import SyncCounts, count_syncs

x = torch.randn(6, 4)
mask = x > 0
ids = torch.tensor([3, 1, 3, 0])

SYNC_CASES = {
    "item": lambda: x[0, 0].item(),
    "tolist": lambda: ids.tolist(),
    "nonzero": lambda: mask.nonzero(),
    "nonzero as_tuple": lambda: torch.nonzero(mask, as_tuple=True),
    "where(cond)": lambda: torch.where(mask),
    "argwhere": lambda: torch.argwhere(mask),
    "masked_select": lambda: torch.masked_select(x, mask),
    "unique": lambda: torch.unique(ids),
    "unique sorted counts": lambda: ids.unique(sorted=True, return_counts=True),
    "unique dim": lambda: torch.unique(x, dim=0),
    "unique_consecutive": lambda: torch.unique_consecutive(ids),
    "bool getitem": lambda: x[mask],
    "bool getitem rows": lambda: x[mask[:, 0]],
    "bool setitem tensor": lambda: x.clone().__setitem__(mask, torch.zeros(())),
    "bool setitem values": lambda: x.clone().__setitem__(mask, x[mask] * 2),
    "index_put bool": lambda: x.clone().index_put_((mask,), torch.tensor(1.0)),
    "repeat_interleave": lambda: torch.arange(4).repeat_interleave(ids),
    "repeat_interleave counts": lambda: torch.repeat_interleave(ids),
    "bincount": lambda: torch.bincount(ids),
    "cpu": lambda: x.cpu(),
    "numpy": lambda: x.numpy(),
    "to cpu (cpu_copies)": None,  # handled in its own test
    "bool": lambda: bool(x[0, 0] > 0),
    "if tensor": lambda: 1 if (x.sum() > 0) else 0,
    "int": lambda: int(ids[0]),
    "float": lambda: float(x[0, 0]),
    "index": lambda: [0, 1, 2, 3][ids[0]],
    "equal": lambda: torch.equal(x, x),
    "allclose": lambda: torch.allclose(x, x),
    "cuda.synchronize": lambda: torch.cuda.synchronize() if torch.cuda.is_available() else None,
}


@pytest.mark.parametrize("name", [k for k, v in SYNC_CASES.items() if v is not None])
def test_each_sync_op_is_counted(name):
    if name == "cuda.synchronize" and not torch.cuda.is_available():
        # torch.cuda.synchronize raises without CUDA; check the wrapper is installed instead.
        with count_syncs() as c, pytest.raises((RuntimeError, AssertionError)):
            torch.cuda.synchronize()
        assert c.by_op == {"cuda.synchronize": 1}
        return
    with count_syncs() as c:
        SYNC_CASES[name]()
    assert c.total >= 1, name


def test_one_call_counts_once():
    with count_syncs() as c:
        x[0, 0].item()
        ids.tolist()
        bool(x[0, 0] > 0)
        x[mask]
        x.cpu()
    assert c.by_op == {
        "item": 1,
        "tolist": 1,
        "bool(tensor)": 1,
        "bool-mask index": 1,
        "cpu": 1,
    }
    assert c.total == 5
    text = str(c)
    assert "5 host syncs" in text and "test_debug.py" in text


def test_method_called_past_the_class_is_counted_by_the_function_mode():
    with count_syncs() as c:
        torch._C.TensorBase.tolist(ids)
        torch._C.TensorBase.cpu(x)
    assert c.by_op == {"tolist": 1, "cpu": 1}


def test_copies_to_cpu():
    # On a CPU run `.to(x.device)` is CPU->CPU; it only counts when asked.
    with count_syncs() as c:
        x.to("cpu")
        x.to(torch.device("cpu"), torch.float64)
        y = torch.empty(6, 4)
        y.copy_(x)
    assert c.total == 0
    with count_syncs(cpu_copies=True) as c:
        x.to("cpu")
        x.to(device="cpu")
        x.to(torch.float64)  # no device: not a copy to the host
    assert c.by_op == {"copy to cpu": 2}


def test_sync_free_ops_read_zero():
    w = torch.randn(4, 5, requires_grad=True)
    with count_syncs() as c:
        h = (x @ w).softmax(-1)
        g = h.index_select(0, ids)
        acc = torch.zeros(4, 5).scatter_add(0, ids[:, None].expand(-1, 5), g)
        order = torch.argsort(ids, stable=True)
        offsets = torch.cumsum(torch.zeros(4, dtype=torch.long).scatter_add(0, ids, ids), 0)
        y = x.clone()
        y[mask] = 0.0  # masked_fill_ on the device: no sync
        y.masked_fill_(~mask, 1.0)
        sel = torch.where(mask, x, 0.0)
        nz = torch.nonzero_static(mask.flatten(), size=4)
        rep = torch.arange(4).repeat_interleave(ids, output_size=7)
        rep2 = torch.arange(4).repeat_interleave(2)
        (acc.sum() + offsets.sum() + order.sum() + sel.sum() + nz.sum() + rep.sum()).backward()
    assert c.total == 0, str(c)
    assert rep2.numel() == 8


def test_module_forward_backward_reads_zero():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 8), nn.LayerNorm(8), nn.Linear(8, 16), nn.GELU())
    head = nn.Linear(16, 11)
    tokens = torch.randint(0, 11, (13,))
    labels = tokens.roll(-1)
    labels[-1] = -100
    with count_syncs() as c:
        loss = nn.functional.cross_entropy(head(model(tokens)), labels, ignore_index=-100)
        loss.backward()
    assert c.total == 0, str(c)
    assert head.weight.grad is not None


class _SyncingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        return a * 2

    @staticmethod
    def backward(ctx, grad):
        scale = grad.abs().max().item()  # a host sync hidden in backward
        return grad * 2 + 0 * scale


def test_sync_in_custom_backward_is_counted():
    a = torch.randn(5, requires_grad=True)
    out = _SyncingBackward.apply(a).sum()
    with count_syncs() as c:
        out.backward()
    assert c.by_op == {"item": 1}


def test_sync_in_autograd_backward_of_indexing_is_counted():
    a = torch.randn(6, 4, requires_grad=True)
    out = a[mask].sum()  # backward of a bool index is an index_put with the mask
    with count_syncs() as c:
        out.backward()
    assert c.total >= 1


def test_nested_blocks_both_count():
    with count_syncs() as outer:
        x[0, 0].item()
        with count_syncs() as inner:
            ids.tolist()
            mask.nonzero()
        x.sum()
    assert inner.by_op == {"tolist": 1, "nonzero": 1}
    assert outer.by_op == {"item": 1, "tolist": 1, "nonzero": 1}
    # The modes are gone after the block.
    with count_syncs() as after:
        pass
    ids.tolist()
    assert after.total == 0 and outer.total == 3


def test_patched_synchronize_restored():
    before = torch.cuda.synchronize
    with count_syncs():
        assert torch.cuda.synchronize is not before
    assert torch.cuda.synchronize is before


def test_wrapped_tensor_methods_restored():
    own = dict(vars(torch.Tensor))  # `__array__` is torch.Tensor's own; `tolist` inherited
    with count_syncs(), count_syncs():
        assert torch.Tensor.tolist is not torch._C.TensorBase.tolist
        assert torch.Tensor.__array__ is not own["__array__"]
    assert dict(vars(torch.Tensor)) == own
    assert torch.Tensor.tolist is torch._C.TensorBase.tolist


# --- syncs run by the autograd engine: backward-time recompute -----------------------------
# `Tensor.backward` goes through a torch-function handler, which runs it with the function
# mode off; these syncs were missed there (`.tolist()`, `.cpu()`) before the method wrappers.

BACKWARD_SYNCS = {
    "tolist": lambda t: t.tolist(),
    "item": lambda t: t.sum().item(),
    "cpu": lambda t: t.cpu(),
    "nonzero": lambda t: (t > 0).nonzero(),
    "bool-mask index": lambda t: t[t > 0],
}


class _SyncInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, sync):
        ctx.sync = sync
        return a * 2

    @staticmethod
    def backward(ctx, grad):
        ctx.sync(grad)
        return grad * 2, None


class _SyncLayer(nn.Module):
    """A decoder-layer stand-in (`layer(x, seq, cos_sin)`) that runs one sync per call."""

    def __init__(self, sync) -> None:
        super().__init__()
        self.proj, self.sync, self.calls = nn.Linear(4, 4), sync, 0

    def forward(self, x, seq, cos_sin):
        self.calls += 1
        self.sync(x.detach())  # detached: the sync itself adds nothing to the graph
        return torch.tanh(self.proj(x))


class _Stack(nn.Module):
    def __init__(self, sync, layers: int) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(_SyncLayer(sync) for _ in range(layers))

    def decoder_layers(self) -> nn.ModuleList:  # the model contract (models/contract.py)
        return self.model.layers

    def forward(self, x):
        for layer in self.model.layers:
            x = layer(x, None, None)
        return x


def _backward_calls(where: str, sync) -> tuple[SyncCounts, int]:
    """Counts over one backward whose recompute (or custom backward) runs `sync`, and how
    many times `sync` ran during it."""
    torch.manual_seed(0)
    x = torch.randn(6, 4, requires_grad=True)
    if where == "custom backward":
        out, calls = _SyncInBackward.apply(x, sync).sum(), lambda: 1
    else:
        from slipstream.memory.offload import apply_checkpointing

        model = _Stack(sync, layers=3)
        mode = "recompute" if where == "checkpoint recompute" else "offload"
        apply_checkpointing(model, mode, force=True, min_offload_bytes=0)
        out = model(x).sum()
        before = sum(layer.calls for layer in model.model.layers)
        calls = lambda: sum(layer.calls for layer in model.model.layers) - before  # noqa: E731
    with count_syncs() as c:
        out.backward()
    assert x.grad is not None
    return c, calls()


WHERE = ["custom backward", "checkpoint recompute", "offload recompute"]


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("name", list(BACKWARD_SYNCS))
def test_sync_in_backward_counted_once_per_call(where, name):
    c, calls = _backward_calls(where, BACKWARD_SYNCS[name])
    assert calls == (1 if where == "custom backward" else 3)  # every layer recomputed once
    assert c.by_op == {name: calls}, str(c)


@pytest.mark.parametrize("where", WHERE)
def test_sync_free_recompute_reads_zero(where):
    def no_sync(t):
        t.clone()[t > 0] = 0.0  # masked_fill_ on the device, as in forward
        t.to(torch.float64)

    c, calls = _backward_calls(where, no_sync)
    assert calls >= 1 and c.total == 0, str(c)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
def test_cuda_copies_and_masks():
    xd = torch.randn(64, 8, device="cuda")
    md = xd > 0
    with count_syncs() as c:
        xd.cpu()
        xd.to("cpu")
        torch.empty(64, 8).copy_(xd)
    assert c.by_op == {"cpu": 1, "copy to cpu": 2}, str(c)
    pinned = torch.empty(64, 8, pin_memory=True)
    with count_syncs() as c:
        pinned.copy_(xd, non_blocking=True)  # the offload path: async
        xd.to("cpu", non_blocking=True)
        xd.clone()[md] = 0.0  # masked_fill_ on the device
        xd.to("cuda")
    assert c.total == 0, str(c)
    with count_syncs() as c:
        xd[md]
        torch.cuda.synchronize()
        torch.cuda.current_stream().synchronize()
    assert c.by_op == {
        "bool-mask index": 1,
        "cuda.synchronize": 1,
        "stream.synchronize": 1,
    }, str(c)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_compiled_flex_attention_runs_inside_count_syncs():
    """Under count_syncs' modes dynamo would not run the compiled flex graph and its eager
    fallback fails ("no rule registered for HigherOrderOperator flex_attention"); the call
    runs opaque to the audit, and syncs around it are still counted."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    from slipstream.debug import opaque_to_audit
    from slipstream.ops import attention
    from slipstream.ops.packing import SeqInfo

    fn = torch.compile(flex.flex_attention, dynamic=True, backend="eager")
    seq = SeqInfo.from_lengths([100, 28])
    q, k, v = (torch.randn(1, 2, 128, 16) for _ in range(3))
    mask = attention.flex_block_mask(seq)
    ref = fn(q, k, v, block_mask=mask)
    with count_syncs() as c:
        with opaque_to_audit():
            out = fn(q, k, v, block_mask=mask)
        out.sum().item()
    torch.testing.assert_close(out, ref)
    assert c.by_op == {"item": 1}
    # A user's function mode above ours stays on; only the counters come off, then return.
    with count_syncs() as c, torch.device("cpu"):
        stack = [torch._C._get_function_stack_at(i) for i in range(2)]
        with opaque_to_audit():
            inside = torch._C._len_torch_function_stack()
            out = fn(q, k, v, block_mask=mask)
        after = [torch._C._get_function_stack_at(i) for i in range(2)]
        torch.ones(2).sum().item()
    assert inside == 1 and after == stack
    torch.testing.assert_close(out, ref)
    assert c.by_op == {"item": 1}
    with opaque_to_audit():  # outside a block: a no-op
        torch.testing.assert_close(fn(q, k, v, block_mask=mask), ref)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_compiled_flex_runs_inside_count_syncs_on_another_thread():
    """CUDA backward (offload and checkpoint recomputes) runs on autograd's device thread,
    which inherits the dispatch-mode stack but not Python thread state nor the function-mode
    stack: the flex call there must run opaque to the audit too."""
    import threading

    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    from torch.utils._python_dispatch import (
        _get_current_dispatch_mode_stack,
        _pop_mode,
        _push_mode,
    )

    from slipstream.debug import _DispatchCounter, opaque_to_audit
    from slipstream.ops import attention
    from slipstream.ops.packing import SeqInfo

    fn = torch.compile(flex.flex_attention, dynamic=True, backend="eager")
    mask = attention.flex_block_mask(SeqInfo.from_lengths([100, 28]))
    q, k, v = (torch.randn(1, 2, 128, 16) for _ in range(3))
    fn(q, k, v, block_mask=mask)
    errors = []
    with count_syncs():
        mode = next(
            m for m in _get_current_dispatch_mode_stack() if isinstance(m, _DispatchCounter)
        )

        def device_thread():  # as the engine does: the dispatch-mode stack restored, no more
            _push_mode(mode)
            try:
                with opaque_to_audit():
                    fn(q, k, v, block_mask=mask)
            except Exception as e:  # noqa: BLE001
                errors.append(e)
            finally:
                _pop_mode()

        t = threading.Thread(target=device_thread)
        t.start()
        t.join()
    assert not errors, errors
