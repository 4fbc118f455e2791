"""attend() against plain per-sequence references; SeqInfo construction and its errors."""

from __future__ import annotations

import pytest
import torch
from helpers.models import compiled_graphs

from slipstream.debug import count_syncs
from slipstream.ops import attention
from slipstream.ops.attention import attend, dense_causal_mask
from slipstream.ops.packing import SeqInfo

LENGTHS = [5, 1, 9, 3]


def _qkv(T, H=4, G=2, Dh=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(T, h, Dh, generator=g, requires_grad=True)  # noqa: E731
    return mk(H), mk(G), mk(G)


def _reference(q, k, v, lengths, window=None, sinks=None, causal=True):
    """Each sequence alone, attention written out with an explicit causal(/window) mask."""
    outs, start = [], 0
    rep = q.shape[1] // k.shape[1]
    for n in lengths:
        qs, ks, vs = (x[start : start + n] for x in (q, k, v))
        ks, vs = ks.repeat_interleave(rep, 1), vs.repeat_interleave(rep, 1)
        scores = torch.einsum("thd,shd->hts", qs, ks) / q.shape[-1] ** 0.5
        i = torch.arange(n)
        allowed = i[:, None] >= i[None, :] if causal else torch.ones(n, n, dtype=torch.bool)
        if window is not None:
            allowed &= i[:, None] - i[None, :] < window
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            sink = sinks[:, None, None].expand(-1, n, 1)
            probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
        else:
            probs = torch.softmax(scores, -1)
        outs.append(torch.einsum("hts,shd->thd", probs, vs))
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("window", [None, 1, 3])
@pytest.mark.parametrize("per_sequence", [False, True])
def test_attend_matches_per_sequence_reference(window, per_sequence, monkeypatch):
    if per_sequence:  # force the long-batch path that runs one SDPA call per sequence
        monkeypatch.setattr(attention, "DENSE_MASK_MAX_TOKENS", 0)
    q, k, v = _qkv(sum(LENGTHS))
    out = attend(q, k, v, SeqInfo.from_lengths(LENGTHS), window=window)
    ref = _reference(q, k, v, LENGTHS, window=window)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("per_sequence", [False, True])
def test_attend_with_sinks_matches_reference(window, per_sequence, monkeypatch):
    if per_sequence:
        monkeypatch.setattr(attention, "DENSE_MASK_MAX_TOKENS", 0)
    q, k, v = _qkv(sum(LENGTHS), H=4, G=1)
    sinks = torch.randn(4, requires_grad=True)
    out = attend(q, k, v, SeqInfo.from_lengths(LENGTHS), window=window, sinks=sinks)
    ref = _reference(q, k, v, LENGTHS, window=window, sinks=sinks)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v, sinks))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v, sinks))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("per_sequence", [False, True])
def test_non_causal_attend_matches_per_sequence_reference(per_sequence, monkeypatch):
    """causal=False (vision towers): every query sees its whole sequence, on both CPU paths,
    forward and backward, without a host sync; refused with a KV cache."""
    if per_sequence:
        monkeypatch.setattr(attention, "DENSE_MASK_MAX_TOKENS", 0)
    q, k, v = _qkv(sum(LENGTHS))
    seq = SeqInfo.from_lengths(LENGTHS)
    with count_syncs() as c:
        out = attend(q, k, v, seq, causal=False)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    assert c.total == 0, str(c)
    ref = _reference(q, k, v, LENGTHS, causal=False)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
    assert (out - attend(q, k, v, seq)).abs().max() > 1e-3  # not the causal result
    seq.kv = object()
    with pytest.raises(ValueError, match="non-causal"):
        attend(q, k, v, seq, causal=False)


def test_per_sequence_picked_from_host_lengths(monkeypatch):
    """One call per sequence unless the batch is short and its sequences tiny; never the
    dense mask above DENSE_MASK_MAX_TOKENS."""
    wins = attention.per_sequence_wins
    assert wins([1024])  # causal flash skips the masked half: beats the dense mask
    assert wins([128] * 8) and wins([8] * 128)  # T=1024: T^2 dwarfs the calls' cost
    assert not wins([8] * 8)  # T=64 in 8 calls: the per-call cost dominates
    assert not wins([5, 1, 9, 3])
    monkeypatch.setattr(attention, "PER_SEQUENCE_CALL_COST", 10**9)
    assert wins([1] * (attention.DENSE_MASK_MAX_TOKENS + 1))
    assert not wins([1] * attention.DENSE_MASK_MAX_TOKENS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,sinks", [(None, False), (6, False), (None, True), (6, True)])
def test_per_sequence_path_equals_dense_mask_path(dtype, window, sinks, monkeypatch):
    """Forward and backward of the two CPU paths agree on a batch with long and tiny
    sequences (float32 tightly; bf16 within its rounding)."""
    lengths = [37, 1, 20, 2, 9]
    q, k, v = (x.detach().to(dtype).requires_grad_() for x in _qkv(sum(lengths), H=6, G=2))
    sink = torch.randn(6, requires_grad=True) if sinks else None
    seq = SeqInfo.from_lengths(lengths)
    results = []
    for cost, cap in ((10**9, 4096), (0, 0)):  # dense mask, then per sequence
        monkeypatch.setattr(attention, "PER_SEQUENCE_CALL_COST", cost)
        monkeypatch.setattr(attention, "DENSE_MASK_MAX_TOKENS", cap)
        assert attention.per_sequence_wins(lengths) == (cap == 0)
        out = attend(q, k, v, seq, window=window, sinks=sink)
        inputs = (q, k, v) + ((sink,) if sinks else ())
        results.append((out, *torch.autograd.grad(out.float().square().sum(), inputs)))
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    for a, b in zip(*results):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, **tol)


def test_per_sequence_training_attention_has_no_sync(monkeypatch):
    monkeypatch.setattr(attention, "DENSE_MASK_MAX_TOKENS", 0)
    q, k, v = _qkv(sum(LENGTHS))
    with count_syncs() as c:
        for window in (None, 3):
            attend(q, k, v, SeqInfo.from_lengths(LENGTHS), window=window).sum().backward()
    assert c.total == 0, str(c)


def test_sink_rescale_identity():
    """out_with_sink == out * sigmoid(lse - sink): the identity the CUDA path relies on."""
    scores = torch.randn(3, 6)
    v = torch.randn(6, 2)
    sink = torch.randn(3)
    with_sink = torch.softmax(torch.cat([scores, sink[:, None]], -1), -1)[:, :-1] @ v
    plain = torch.softmax(scores, -1) @ v
    lse = torch.logsumexp(scores, -1)
    torch.testing.assert_close(with_sink, plain * torch.sigmoid(lse - sink)[:, None])


def test_dense_mask_built_once_per_seqinfo():
    seq = SeqInfo.from_lengths([3, 2])
    m1 = dense_causal_mask(seq)
    assert dense_causal_mask(seq) is m1
    assert dense_causal_mask(seq, 2) is not m1
    expected = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]],
        dtype=torch.bool,
    )
    assert torch.equal(m1, expected)


def test_seqinfo_from_lengths():
    seq = SeqInfo.from_lengths([3, 1, 2])
    assert seq.cu_seqlens.dtype == torch.int32
    assert seq.cu_seqlens.tolist() == [0, 3, 4, 6]
    assert seq.position_ids.tolist() == [0, 1, 2, 0, 0, 1]
    assert seq.seq_ids.tolist() == [0, 0, 0, 1, 2, 2]
    assert seq.max_seqlen == 3
    assert seq.total_tokens == 6 and seq.to("cpu") is seq


@pytest.mark.parametrize(
    ("lengths", "message"),
    [([], "empty"), ([3, 0, 2], r"lengths\[1\] = 0"), ([2, -1], r"lengths\[1\] = -1"),
     ([2, 1.5], "not an int"), (torch.tensor([2, 3]), "host list")],
)  # fmt: skip
def test_seqinfo_bad_lengths(lengths, message):
    with pytest.raises(ValueError, match=message):
        SeqInfo.from_lengths(lengths)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_non_causal_attend_matches_cpu(dtype):
    """bf16: varlen with window (-1, -1); float32: one SDPA call per sequence (no flex)."""
    q, k, v = _qkv(sum(LENGTHS), H=4, G=2, Dh=64)
    ref = attend(q, k, v, SeqInfo.from_lengths(LENGTHS), causal=False)
    cuda = [x.detach().cuda().to(dtype) for x in (q, k, v)]
    out = attend(*cuda, SeqInfo.from_lengths(LENGTHS, device="cuda"), causal=False)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.float().cpu(), ref.detach(), atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("use_sinks", [False, True])
def test_cuda_attend_matches_cpu(window, use_sinks):
    q, k, v = _qkv(sum(LENGTHS), H=4, G=2, Dh=64)
    sinks = torch.randn(4) if use_sinks else None
    ref = attend(q, k, v, SeqInfo.from_lengths(LENGTHS), window=window, sinks=sinks)
    cuda = [x.detach().cuda().bfloat16() for x in (q, k, v)]
    seq = SeqInfo.from_lengths(LENGTHS, device="cuda")
    s = sinks.cuda() if use_sinks else None
    out = attend(*cuda, seq, window=window, sinks=s)
    torch.testing.assert_close(out.float().cpu(), ref.detach(), atol=3e-2, rtol=3e-2)


def test_seqinfo_to_copies_the_host_buffer_instead_of_rebuilding(monkeypatch):
    seq = SeqInfo.from_lengths([3, 1, 2])

    def no_rebuild(*args, **kwargs):
        raise AssertionError("SeqInfo.to rebuilt the metadata from the lengths")

    monkeypatch.setattr(SeqInfo, "from_lengths", no_rebuild)
    moved = seq.to("meta")  # a device other than the CPU, available everywhere
    assert moved.device.type == "meta" and moved.lengths == seq.lengths
    assert moved.cu_seqlens.shape == (4,) and moved.position_ids.dtype == torch.int64
    assert moved.seq_ids.shape == (6,) and moved.max_seqlen == 3


# ------------------------------------------------------------------------- FlexAttention path


def _tiles_by_brute_force(lengths, window, block):
    """(partial, full) tiles from the dense token mask over the padded stream."""
    padded = -(-sum(lengths) // block) * block
    pad = padded - sum(lengths)
    allowed = dense_causal_mask(
        SeqInfo.from_lengths(list(lengths) + ([pad] if pad else [])), window
    )
    tiles = allowed.view(padded // block, block, padded // block, block).permute(0, 2, 1, 3)
    any_, all_ = tiles.flatten(2).any(-1), tiles.flatten(2).all(-1)
    return any_ & ~all_, all_


@pytest.mark.parametrize("window", [None, 5, 16, 40])
@pytest.mark.parametrize(
    "lengths", [[5, 1, 9, 3], [16, 16], [40], [7, 30, 2, 25, 1, 11], [1] * 19, [64]]
)
def test_flex_block_tiles_match_the_token_mask(lengths, window):
    partial, full = attention.flex_block_tiles(lengths, window, block=8)
    ref_partial, ref_full = _tiles_by_brute_force(lengths, window, block=8)
    assert torch.equal(full, ref_full)
    assert torch.equal(partial, ref_partial)


@pytest.mark.parametrize("window", [None, 3, 130])
@pytest.mark.parametrize("use_sinks", [False, True])
@pytest.mark.parametrize("lengths", [LENGTHS, [100, 150, 7], [128, 128]])
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_path_matches_reference(lengths, window, use_sinks):
    """The CUDA-only FlexAttention path, run eagerly on CPU (forward: flex has no CPU backward),
    over a stream padded to FLEX_BLOCK with a host-built BlockMask."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    q, k, v = (x.detach() for x in _qkv(sum(lengths), seed=3))
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0]) if use_sinks else None
    seq = SeqInfo.from_lengths(lengths)
    out = attention._flex(q, k, v, seq, window, sinks, None)
    ref = _reference(q, k, v, lengths, window=window, sinks=sinks)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    assert attention.flex_block_mask(seq, window) is attention.flex_block_mask(seq, window)


@pytest.mark.parametrize("window", [None, 64, 200])
@pytest.mark.parametrize("lengths", [[100, 150, 7], [300, 20, 500, 3], [1] * 200, [256]])
def test_flex_block_mask_equals_create_block_mask(lengths, window):
    """The host-built mask is the BlockMask torch's own `create_block_mask` derives from the
    same mask_mod: the same partial and full tiles, in both directions (forward, backward)."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    seq = SeqInfo.from_lengths(lengths)
    ours = attention.flex_block_mask(seq, window)
    T = attention.flex_padded_tokens(seq)
    ref = flex.create_block_mask(ours.mask_mod, None, None, T, T, device="cpu")
    for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(ours, name), getattr(ref, name)), name
    assert torch.equal(ours.to_dense(), ref.to_dense())


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_flex_compiles_once_across_batch_lengths():
    """Packed batches change length every step: the flex call compiled with dynamic shapes
    over the FLEX_BLOCK-padded stream, with the BlockMask's tile counts marked dynamic, must
    be reused, not recompiled per batch (dynamo's guards on CPU with the eager backend; the
    gpu test below runs the real kernels, backward included)."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    torch._dynamo.reset()
    fn = attention._compiled_flex("eager")  # the CUDA path's wrapper, with dynamo's guards
    graphs = []
    for lengths in ([700, 300, 24], [1500, 9, 400], [64] * 20 + [3], [130]):  # 8, 15, 11, 2 tiles
        seq = SeqInfo.from_lengths(lengths)
        padded = attention.flex_padded_tokens(seq)
        # 8 query heads and 8 tiles at first: dynamo gives equal sizes one symbol, so an
        # unmarked tile count would be tied to the head count and recompile at 15 tiles.
        q, k, v = (torch.randn(1, h, padded, 16) for h in (8, 2, 2))
        fn(q, k, v, block_mask=attention.flex_block_mask(seq), enable_gqa=True)
        graphs.append(compiled_graphs())
    assert graphs == [graphs[0]] * 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("window", [None, 128])
def test_cuda_flex_matches_cpu_across_lengths_without_recompiling(window):
    """GPT-OSS attention (sinks: always the flex path) over batches of changing length:
    output and gradients against the CPU float32 path, one compiled graph for all of them."""
    compiled_after_first = None
    for i, lengths in enumerate(([700, 300, 24], [1500, 9, 400], [64] * 20 + [3])):
        q, k, v = _qkv(sum(lengths), H=8, G=2, Dh=64, seed=i)
        sinks = torch.randn(8, generator=torch.Generator().manual_seed(i), requires_grad=True)
        ref = attend(q, k, v, SeqInfo.from_lengths(lengths), window=window, sinks=sinks)
        ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v, sinks))
        cuda = [x.detach().cuda().requires_grad_() for x in (q, k, v, sinks)]
        out = attend(*cuda[:3], SeqInfo.from_lengths(lengths, "cuda"), window, sinks=cuda[3])
        grads = torch.autograd.grad(out.square().sum(), cuda)
        torch.testing.assert_close(out.cpu(), ref.detach(), atol=2e-3, rtol=2e-3)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g.cpu(), r, atol=2e-2, rtol=2e-2)
        compiled_after_first = compiled_after_first or compiled_graphs()
    assert compiled_graphs() == compiled_after_first


@pytest.mark.parametrize("params", ["2.11", "2.12+"])
@pytest.mark.parametrize("window", [None, 3])
def test_varlen_arguments_follow_the_installed_signature(params, window, monkeypatch):
    """torch 2.11's varlen_attn has window_size but no enable_gqa (its flash kernel takes
    fewer kv heads as they are); 2.12 added enable_gqa. (left, right) = (window-1, 0) or
    (-1, 0) means causal. Checked with a stand-in that records the call (CUDA-only op)."""
    varlen = pytest.importorskip("torch.nn.attention.varlen")
    names = {"window_size", "scale"} | ({"enable_gqa"} if params == "2.12+" else set())
    monkeypatch.setattr(attention, "_varlen_params", lambda: frozenset(names))
    calls = []

    def fake(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
        calls.append((cu_q, max_q, kwargs))
        return torch.zeros_like(q)

    monkeypatch.setattr(varlen, "varlen_attn", fake)
    q, k, v = _qkv(sum(LENGTHS))
    seq = SeqInfo.from_lengths(LENGTHS)
    assert attention._varlen_supports()
    attention._varlen(q, k, v, seq, window, None)
    ((cu, max_q, kwargs),) = calls
    assert cu is seq.cu_seqlens and max_q == max(LENGTHS)
    assert kwargs["window_size"] == ((window - 1, 0) if window else (-1, 0))
    if window is None:  # non-causal (vision towers): no limit on either side
        attention._varlen(q, k, v, seq, None, None, causal=False)
        assert calls[-1][2]["window_size"] == (-1, -1)
    assert kwargs.get("enable_gqa") == (True if params == "2.12+" else None)
    monkeypatch.setattr(attention, "_varlen_params", lambda: frozenset({"is_causal"}))  # 2.10
    assert not attention._varlen_supports()


def test_varlen_only_for_half_precision_flash_shapes():
    bf16 = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    assert attention._varlen_fits(bf16)
    assert not attention._varlen_fits(bf16.float())  # FlashAttention: fp16/bf16 only
    assert not attention._varlen_fits(torch.zeros(4, 2, 60, dtype=torch.bfloat16))
    assert not attention._varlen_fits(torch.zeros(4, 2, 512, dtype=torch.bfloat16))


@pytest.mark.skipif(not attention.CPU_HALF_IN_FLOAT32, reason="a CPU with AMX keeps bf16")
@pytest.mark.parametrize("per_sequence", [False, True])
def test_cpu_bf16_attention_is_computed_in_float32(per_sequence, monkeypatch):
    """Without AMX, bf16 SDPA is slower than float32 on CPU: inputs are upcast, output cast
    back, so the result is float32 attention rounded once to bf16."""
    if per_sequence:
        monkeypatch.setattr(attention, "DENSE_MASK_MAX_TOKENS", 0)
    q, k, v = (x.detach().to(torch.bfloat16) for x in _qkv(sum(LENGTHS), Dh=16))
    seq = SeqInfo.from_lengths(LENGTHS)
    out = attend(q, k, v, seq)
    assert out.dtype == torch.bfloat16
    want = attend(q.float(), k.float(), v.float(), seq).to(torch.bfloat16)
    assert torch.equal(out, want)
