"""Gated DeltaNet ops (slipstream/ops/gated_delta.py) against plain references: a per-token
recurrence written out here, transformers' own torch chunked rule and F.conv1d, each run one
sequence at a time, on packed batches whose sequences are longer than a chunk (and shorter,
and of one token), forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slipstream.ops.gated_delta import (
    causal_conv,
    chunk_gated_delta,
    conv_step,
    conv_tail_index,
    delta_step,
    l2norm,
)
from slipstream.ops.packing import SeqInfo

LENGTHS = [13, 1, 21, 8, 5]  # chunks of 4: 4, 1, 6, 2, 2 of them
H, K, V = 3, 5, 6


def _inputs(T, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(T, H, K, generator=g), torch.randn(T, H, K, generator=g)
    v = torch.randn(T, H, V, generator=g)
    decay = -F.softplus(torch.randn(T, H, generator=g))  # log decay <= 0
    beta = torch.rand(T, H, generator=g)
    return [x.requires_grad_() for x in (q, k, v, decay, beta)]


def recurrence(q, k, v, g, beta, lengths, reset=True):
    """S_t = e^g S + beta k (v - e^g S^T k)^T, o_t = S_t^T q, token by token; `reset=False`
    carries S from one packed sequence into the next (the leak slipstream must not have)."""
    q, k = l2norm(q) * K**-0.5, l2norm(k)
    outs, finals, S, t = [], [], torch.zeros(H, K, V), 0
    for n in lengths:
        S = torch.zeros(H, K, V) if reset else S
        for _ in range(n):
            S = S * g[t].exp()[:, None, None]
            delta = (v[t] - torch.einsum("hkv,hk->hv", S, k[t])) * beta[t][:, None]
            S = S + k[t][:, :, None] * delta[:, None, :]
            outs.append(torch.einsum("hkv,hk->hv", S, q[t]))
            t += 1
        finals.append(S)
    return torch.stack(outs), torch.stack(finals)


def _grads(out, inputs, seed=3):
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.device)
    return torch.autograd.grad((out * w).sum(), inputs)


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("chunk", [4, 64])
def test_chunked_equals_the_recurrence_per_sequence(chunk):
    seq = SeqInfo.from_lengths(LENGTHS)
    inputs = _inputs(sum(LENGTHS))
    o, final = chunk_gated_delta(*inputs, seq, chunk=chunk)
    o_ref, final_ref = recurrence(*inputs, LENGTHS)
    assert _rel(o, o_ref) < 1e-5 and _rel(final, final_ref) < 1e-5
    for got, want in zip(_grads(o, inputs), _grads(o_ref, inputs), strict=True):
        assert _rel(got, want) < 1e-5


def test_the_batch_is_sensitive_to_a_leaked_state():
    """The batch above would catch a state crossing a boundary: carrying it changes outputs."""
    inputs = _inputs(sum(LENGTHS))
    leaked, _ = recurrence(*inputs, LENGTHS, reset=False)
    o_ref, _ = recurrence(*inputs, LENGTHS)
    assert _rel(leaked, o_ref) > 1e-2


def test_chunked_equals_transformers_torch_rule():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    seq = SeqInfo.from_lengths(LENGTHS)
    inputs = _inputs(sum(LENGTHS), seed=1)
    o, final = chunk_gated_delta(*inputs, seq, chunk=4)
    ref, ref_final = [], []
    for part in zip(*(x.split(LENGTHS) for x in inputs), strict=True):
        out, state = torch_chunk_gated_delta_rule(
            *(x[None] for x in part), chunk_size=4, output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        ref.append(out[0])
        ref_final.append(state[0])
    o_ref = torch.cat(ref)
    assert _rel(o, o_ref) < 1e-5 and _rel(final, torch.stack(ref_final)) < 1e-5
    for got, want in zip(_grads(o, inputs), _grads(o_ref, inputs), strict=True):
        assert _rel(got, want) < 1e-5


def test_decode_steps_continue_the_prefill_state():
    """Prefill's final states, then one token at a time by `delta_step`, equal the
    recurrence over the longer sequences."""
    lengths = [9, 3]
    steps = 4
    inputs = [x.detach() for x in _inputs(sum(lengths) + 2 * steps, seed=2)]
    longer = [n + steps for n in lengths]
    o_ref, _ = recurrence(*inputs, longer)
    firsts = [torch.cat([p[:n] for p, n in zip(x.split(longer), lengths, strict=True)])
              for x in inputs]  # fmt: skip
    _, S = chunk_gated_delta(*firsts, SeqInfo.from_lengths(lengths), chunk=4)
    for j in range(steps):
        rows = [sum(longer[:b]) + lengths[b] + j for b in range(2)]
        o, S = delta_step(*(x[rows] for x in inputs), S)
        assert _rel(o, o_ref[rows]) < 1e-5


def test_conv_restarts_at_every_sequence():
    C, W = 7, 4
    seq = SeqInfo.from_lengths(LENGTHS)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(sum(LENGTHS), C, generator=g, requires_grad=True)
    w = torch.randn(C, 1, W, generator=g, requires_grad=True)
    y = causal_conv(x, w[:, 0], seq)
    ref = torch.cat(
        [
            F.conv1d(p.T[None], w, padding=W - 1, groups=C)[0, :, : p.shape[0]].T
            for p in x.split(LENGTHS)
        ]  # fmt: skip
    )
    assert _rel(y, ref) < 1e-6
    for got, want in zip(_grads(y, [x, w]), _grads(ref, [x, w]), strict=True):
        assert _rel(got, want) < 1e-6


def test_conv_state_then_steps_equal_the_full_conv():
    C, W, lengths, steps = 5, 4, [2, 6], 3
    g = torch.Generator().manual_seed(5)
    w = torch.randn(C, W, generator=g)
    longer = [n + steps for n in lengths]
    x = torch.randn(sum(longer), C, generator=g)
    full = causal_conv(x, w, SeqInfo.from_lengths(longer))
    first = torch.cat([p[:n] for p, n in zip(x.split(longer), lengths, strict=True)])
    tail = conv_tail_index(SeqInfo.from_lengths(lengths), W - 1)
    state = torch.cat([first, first.new_zeros(1, C)])[tail].transpose(1, 2)  # (N, C, J)
    for j in range(steps):
        rows = [sum(longer[:b]) + lengths[b] + j for b in range(2)]
        y, state = conv_step(x[rows], state, w)
        assert _rel(y, full[rows]) < 1e-6


@pytest.mark.gpu
def test_fla_path_equals_the_torch_path_on_cuda():
    """On CUDA with flash-linear-attention: fla's varlen kernel (what `gated_delta_rule` runs
    there) = our torch chunked form, forward and backward, with no host sync."""
    from slipstream.debug import count_syncs
    from slipstream.ops.gated_delta import fla_chunk_rule, gated_delta_rule

    if not torch.cuda.is_available() or fla_chunk_rule() is None:
        pytest.skip("needs CUDA and flash-linear-attention")
    seq = SeqInfo.from_lengths([300, 1, 77, 64], "cuda")
    inputs = [x.detach().cuda().requires_grad_() for x in _inputs(sum(seq.lengths), seed=6)]
    with count_syncs() as syncs:
        o = gated_delta_rule(*inputs, seq)
        grads = _grads(o, inputs)
    assert syncs.total == 0, syncs
    o_ref, _ = chunk_gated_delta(*inputs, seq)
    assert _rel(o, o_ref) < 1e-3
    for got, want in zip(grads, _grads(o_ref, inputs), strict=True):
        assert _rel(got, want) < 1e-3


def _fake_fla(monkeypatch, rule):
    """Install `rule` as fla.ops.gated_delta_rule.chunk_gated_delta_rule (None: fla absent)."""
    import sys
    import types

    from slipstream.ops.gated_delta import fla_chunk_rule

    if rule is None:
        monkeypatch.setitem(sys.modules, "fla", None)  # `import fla...` raises ImportError
    else:
        for name in ("fla", "fla.ops"):
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        module = types.ModuleType("fla.ops.gated_delta_rule")
        module.chunk_gated_delta_rule = rule
        monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", module)
    fla_chunk_rule.cache_clear()  # detection is cached: detect again
    return fla_chunk_rule


@pytest.fixture
def fresh_detection():
    from slipstream.ops.gated_delta import fla_chunk_rule

    yield
    fla_chunk_rule.cache_clear()  # the next caller detects the real installation again


def test_without_fla_the_torch_path_runs(monkeypatch, fresh_detection):
    """fla absent (as on this machine), or an fla whose kernel takes no cu_seqlens: no fla
    rule, and `gated_delta_rule` is the torch chunked form."""
    from slipstream.ops.gated_delta import gated_delta_rule

    assert _fake_fla(monkeypatch, None)() is None

    def no_varlen(q, k, v, g, beta, initial_state=None, output_final_state=False):
        raise AssertionError("a kernel without cu_seqlens must not be called")

    assert _fake_fla(monkeypatch, no_varlen)() is None
    seq = SeqInfo.from_lengths(LENGTHS)
    inputs = [x.detach() for x in _inputs(sum(LENGTHS), seed=7)]
    assert _rel(gated_delta_rule(*inputs, seq), recurrence(*inputs, LENGTHS)[0]) < 1e-5


def test_fla_gets_the_packed_batch_as_one_row_with_cu_seqlens(monkeypatch, fresh_detection):
    """A stand-in for fla's varlen kernel (the per-token recurrence over its cu_seqlens, in
    fla's (1, T, H, K) layout): what `fla_gated_delta` passes it and makes of its output equals
    the torch chunked form, final states included; the host cu_seqlens come along."""
    from slipstream.ops.gated_delta import fla_gated_delta

    calls = []

    def rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
             cu_seqlens=None, cu_seqlens_cpu=None, use_qk_l2norm_in_kernel=False):  # fmt: skip
        assert q.shape[0] == 1 and use_qk_l2norm_in_kernel and initial_state is None
        assert g.dtype == torch.float32 and cu_seqlens.dtype == torch.int64
        assert not cu_seqlens_cpu.is_cuda and torch.equal(cu_seqlens_cpu, cu_seqlens.cpu())
        calls.append(cu_seqlens.tolist())
        o, final = recurrence(q[0], k[0], v[0], g[0], beta[0], cu_seqlens.diff().tolist())
        return o[None], final if output_final_state else None

    assert _fake_fla(monkeypatch, rule)() is rule
    seq = SeqInfo.from_lengths(LENGTHS)
    inputs = [x.detach() for x in _inputs(sum(LENGTHS), seed=8)]
    o, final = fla_gated_delta(*inputs, seq, final=True)
    assert calls == [[0, 13, 14, 35, 43, 48]]
    o_ref, final_ref = chunk_gated_delta(*inputs, seq, chunk=4)
    assert _rel(o, o_ref) < 1e-5 and _rel(final, final_ref) < 1e-5
    assert fla_gated_delta(*inputs, seq)[1] is None
