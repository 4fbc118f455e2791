"""linear_cross_entropy vs F.cross_entropy(F.linear(h, w).float()), both backends."""

import pytest
import torch
import torch.nn.functional as F

from slipstream.debug import count_syncs
from slipstream.ops import loss as loss_mod
from slipstream.ops.loss import linear_cross_entropy

BACKENDS = ["chunked"] + (["torch"] if loss_mod.USE_TORCH_LCE else [])


def _inputs(T=37, V=101, D=24, ignore_every=3, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, D, generator=g, requires_grad=True)
    w = (torch.randn(V, D, generator=g) * 0.3).requires_grad_()
    b = torch.randn(V, generator=g, requires_grad=True) if bias else None
    y = torch.randint(0, V, (T,), generator=g)
    if ignore_every:
        y[::ignore_every] = -100
    return h, w, b, y


def _reference(h, w, b, y, reduction):
    return F.cross_entropy(F.linear(h, w, b).float(), y, ignore_index=-100, reduction=reduction)


def _grads(loss, tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_reference(backend, reduction, bias):
    h, w, b, y = _inputs(bias=bias)
    ref = _reference(h, w, b, y, reduction)
    # chunk_size=8 gives 5 chunks, the last one partial (37 = 4*8 + 5).
    out = linear_cross_entropy(h, w, y, reduction=reduction, bias=b, backend=backend, chunk_size=8)
    assert out.dtype == torch.float32 and out.shape == ()
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5), (out, ref)
    for got, want in zip(_grads(out, (h, w, b)), _grads(ref, (h, w, b))):
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_ignored_gives_zero_not_nan(backend):
    h, w, _, y = _inputs()
    y = torch.full_like(y, -100)
    out = linear_cross_entropy(h, w, y, backend=backend)
    assert out.item() == 0.0
    gh, gw = torch.autograd.grad(out, (h, w))
    assert gh.abs().max() == 0 and gw.abs().max() == 0


def test_default_chunk_size_and_module_switch(monkeypatch):
    h, w, _, y = _inputs(T=50, V=300, D=16)
    ref = _reference(h, w, None, y, "mean")
    monkeypatch.setattr(loss_mod, "USE_TORCH_LCE", False)
    monkeypatch.setattr(loss_mod, "_CHUNK_ELEMENTS", 300 * 7)  # 7 rows a chunk
    out = linear_cross_entropy(h, w, y)
    assert "_ChunkedLinearCrossEntropy" in out.grad_fn.next_functions[0][0].name()
    assert torch.allclose(out, ref, atol=1e-5)
    assert torch.allclose(torch.autograd.grad(out, h)[0], torch.autograd.grad(ref, h)[0], atol=1e-5)


def test_only_needed_grads_and_no_grad_mode():
    h, w, _, y = _inputs()
    w.requires_grad_(False)  # e.g. a frozen lm_head under LoRA
    out = linear_cross_entropy(h, w, y, backend="chunked", chunk_size=10)
    (gh,) = torch.autograd.grad(out, (h,))
    assert torch.allclose(
        gh, torch.autograd.grad(_reference(h, w, None, y, "mean"), h)[0], atol=1e-5
    )
    with torch.no_grad():
        out = linear_cross_entropy(h, w, y, backend="chunked")
    assert out.grad_fn is None
    assert torch.allclose(out, _reference(h, w, None, y, "mean"), atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_host_syncs(backend):
    h, w, b, y = _inputs(bias=True)
    with count_syncs() as c:
        out = linear_cross_entropy(h, w, y, bias=b, backend=backend, chunk_size=8)
        out.backward()
    assert c.total == 0, str(c)
    assert h.grad is not None and w.grad is not None


@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_close_to_float32_reference(backend):
    h, w, _, y = _inputs(T=64, V=256, D=32)
    ref = _reference(h, w, None, y, "mean")
    hb = h.detach().bfloat16().requires_grad_()
    wb = w.detach().bfloat16().requires_grad_()
    out = linear_cross_entropy(hb, wb, y, backend=backend, chunk_size=16)
    assert out.dtype == torch.float32
    assert abs(out.item() - ref.item()) < 0.05 * ref.item()
    out.backward()
    assert hb.grad.dtype == torch.bfloat16 and wb.grad.dtype == torch.bfloat16


def test_bad_arguments():
    h, w, _, y = _inputs()
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(h, w, y, reduction="none")
    with pytest.raises(ValueError, match="labels shape"):
        linear_cross_entropy(h, w, y[:-1])
    with pytest.raises(ValueError, match="backend"):
        linear_cross_entropy(h, w, y, backend="triton")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_bfloat16_sync_free_and_close(backend):
    h, w, _, y = _inputs(T=512, V=3001, D=64)
    ref = _reference(h, w, None, y, "mean")
    ref_gh, ref_gw = torch.autograd.grad(ref, (h, w))
    hb = h.detach().cuda().bfloat16().requires_grad_()
    wb = w.detach().cuda().bfloat16().requires_grad_()
    with count_syncs() as c:
        out = linear_cross_entropy(hb, wb, y.cuda(), backend=backend, chunk_size=128)
        out.backward()
    assert c.total == 0, str(c)
    assert abs(out.item() - ref.item()) < 0.02 * ref.item()
    for got, want in ((hb.grad, ref_gh), (wb.grad, ref_gw)):
        rel = (got.float().cpu() - want).norm() / want.norm()
        assert rel < 0.02, rel
