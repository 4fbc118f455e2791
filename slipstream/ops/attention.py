"""Attention over packed sequences: `attend(q, k, v, seq, window=None, sinks=None)`.

One entry point, three back ends chosen by device and installed torch:
- CUDA, no sinks, half precision: `torch.nn.attention.varlen.varlen_attn` (FlashAttention
  over cu_seqlens) where the installed torch has it with `window_size` (2.11+);
- CUDA otherwise: FlexAttention with a document-causal `BlockMask` (head dim >= 16; smaller,
  test-sized heads take the SDPA paths below, which run on CUDA too);
- CPU: one causal SDPA call per sequence (work and memory linear in each sequence's length
  squared; splitting by host lengths costs no sync), or, for short batches of many tiny
  sequences where the per-call cost dominates, one call with a block-diagonal (T, T) mask
  (`per_sequence_wins` decides from the host lengths). Half precision is computed in float32
  there unless the CPU has AMX tiles (see CPU_HALF_IN_FLOAT32).

Every derived structure (block mask, dense mask) is built once per `SeqInfo` and cached on
it, so a 28-layer model builds it once per forward, not 28 times.

`causal=False` (vision towers: each image, or window of one, sees all of itself): the same
back ends without the causal triangle; varlen with an unlimited window on both sides, and on
CUDA without varlen the per-sequence SDPA calls (FlexAttention's tile tables are causal).

Sinks (GPT-OSS): one learned logit per head that joins every softmax but attends to
nothing. With the log-sum-exp of the real scores, out_with_sink = out * sigmoid(lse - sink).

Shapes: T tokens, H query heads, G kv heads, Dh head dim.
"""

from __future__ import annotations

import bisect
import functools
import inspect
import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from slipstream.debug import opaque_to_audit
from slipstream.ops.packing import SeqInfo

# The dense (T, T) mask computes every cross-sequence score and throws it away; one causal
# call per sequence computes about sum(n^2) / 2 scores (the flash kernel skips the masked
# half) but pays a fixed cost per call. Measured on CPU (1 thread, SmolLM2 heads 9/3 x 64,
# forward + backward, benchmarks/bench_attention.py, docs/benchmarks.md): per-sequence wins
# from a single sequence (1.6x at T=1024) to 6-13x at T=1024 in 8-128 sequences and 26x at
# T=4096 in 32; the two break even at T=128 in 16 sequences of 8 (10.4 vs 11.4 ms, float32).
# A call costs about as much as PER_SEQUENCE_CALL_COST scores: dense when
# T^2 < sum(n^2) / 2 + that * N.
PER_SEQUENCE_CALL_COST = 1024
# Above this many packed tokens never the dense mask: at T=4096 the float mask alone is 64 MiB.
DENSE_MASK_MAX_TOKENS = 4096


@torch.compiler.disable  # regional compile (slipstream/compile.py) leaves the kernels out
def attend(
    q_THD: torch.Tensor,
    k_TGD: torch.Tensor,
    v_TGD: torch.Tensor,
    seq: SeqInfo,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    causal: bool = True,
    image_spans: bool = True,
) -> torch.Tensor:
    """Causal attention within each packed sequence -> (T, H, Dh); `causal=False`: every
    query sees its whole sequence (a vision tower's images; training batches only).

    window: each query sees at most the last `window` keys of its own sequence (itself
    included). sinks: (H,) per-head sink logits. softcap: scores become
    softcap * tanh(scores / softcap) (Gemma 2). When generating, `seq.kv` (a step of
    slipstream.generation.cache) stores this layer's keys and values and attends over its
    cache, with the same window, sinks and scale the family passed. Under sequence
    parallelism `seq.shard` (ops/ulysses.py) attends over the whole batch by all-to-alls.
    `seq.image_spans` (Gemma 3's and 4's images): those rows see their whole span
    (`with_image_spans`); `image_spans=False`: this layer stays causal there (Gemma 4's
    full-attention layers: transformers' mask makes only its sliding layers bidirectional).
    """
    if not causal and (seq.kv is not None or seq.shard is not None):
        raise ValueError("non-causal attention with a KV cache or a shard: not supported")
    spans = image_spans and bool(seq.image_spans)
    if spans and (sinks is not None or softcap is not None or seq.shard is not None):
        raise ValueError(
            "bidirectional image spans with attention sinks, softcapping or sequence "
            "parallelism: not supported"
        )
    if seq.kv is not None:
        if softcap is not None:
            raise ValueError("attention softcapping is not supported by the KV-cache engine")
        out = seq.kv.attend(q_THD, k_TGD, v_TGD, window=window, sinks=sinks, scale=scale)
    elif seq.shard is not None:  # sequence parallelism: ops/ulysses.py
        return seq.shard.attend(
            q_THD, k_TGD, v_TGD, window=window, sinks=sinks, scale=scale, softcap=softcap
        )
    else:
        out = attend_packed(q_THD, k_TGD, v_TGD, seq, window, sinks, scale, softcap, causal)
    if spans:  # a prefill's or a training batch's own keys: the spans index them
        out = with_image_spans(out, q_THD, k_TGD, v_TGD, seq, window, scale)
    return out


def with_image_spans(out_THD, q_THD, k_TGD, v_TGD, seq: SeqInfo, window=None, scale=None):
    """`out_THD` (causal attention) with the rows of each of `seq.image_spans` recomputed:
    a span's queries see every key of their sequence up to the span's end (the later keys of
    the span too), within `window` behind each query: transformers' Gemma 3 mask,
    OR(causal, same image) and, on sliding layers, AND(window, that). Host ints only: the
    spans and the sequence starts come from the collator (no sync)."""
    starts = list(itertools.accumulate(seq.lengths, initial=0))
    gqa = k_TGD.shape[1] != q_THD.shape[1]
    pieces, done = [], 0
    for s, e in seq.image_spans:
        first = starts[bisect.bisect_right(starts, s) - 1]  # the sequence holding the span
        lo = first if window is None else max(first, s - window + 1)
        mask = None
        if window is not None:  # key j visible to query i when j > i - window
            q_pos = torch.arange(s, e, device=q_THD.device)[:, None]
            k_pos = torch.arange(lo, e, device=q_THD.device)[None, :]
            mask = k_pos > q_pos - window
        o = F.scaled_dot_product_attention(
            q_THD[s:e].transpose(0, 1)[None], k_TGD[lo:e].transpose(0, 1)[None],
            v_TGD[lo:e].transpose(0, 1)[None], attn_mask=mask, scale=scale, enable_gqa=gqa,
        )  # fmt: skip
        pieces += [out_THD[done:s], o[0].transpose(0, 1).to(out_THD.dtype)]
        done = e
    return torch.cat([*pieces, out_THD[done:]])


def attend_packed(
    q_THD, k_TGD, v_TGD, seq: SeqInfo, window=None, sinks=None, scale=None, softcap=None,
    causal=True,
):  # fmt: skip
    """`attend` without a KV cache: the packed sequences hold all their keys."""
    assert causal or window is None, "a window is causal here"
    args = (q_THD, k_TGD, v_TGD, seq, window)
    if softcap is not None:  # the written-out softmax, one sequence at a time (any device)
        return _eager_per_sequence(*args, sinks, scale, softcap, causal)
    if q_THD.is_cuda:
        if sinks is None and _varlen_fits(q_THD) and _varlen_supports():
            return _varlen(*args, scale, causal)
        if causal and q_THD.shape[-1] >= FLEX_MIN_HEAD_DIM:
            return _flex(*args, sinks, scale)
        # Tiny test-sized heads, non-causal towers: the SDPA/eager paths below run on CUDA too.
    if per_sequence_wins(seq.lengths) or (q_THD.is_cuda and not causal):
        if sinks is not None:
            return _eager_per_sequence(*args, sinks, scale, None, causal)
        return _sdpa_per_sequence(*args, scale, causal)
    mask = dense_causal_mask(seq, window, causal)
    if sinks is not None:
        return _eager(q_THD, k_TGD, v_TGD, mask, sinks, scale)
    return _in_float32(sdpa_masked)(q_THD, k_TGD, v_TGD, mask, scale)


# ----------------------------------------------------------------------------- CPU paths


def dense_causal_mask(seq: SeqInfo, window: int | None = None, causal: bool = True) -> torch.Tensor:
    """(T, T) bool: query t may see key s. Built once per (seq, window, causal) and cached
    (`causal=False`: the block diagonal of whole sequences).

    Built from the host lengths as a block diagonal of causal triangles: at T=1024 that is
    ~0.3 ms against ~1.9 ms for comparing (T, T) grids of sequence ids and positions.
    """

    def build() -> torch.Tensor:
        blocks = []
        for n in seq.lengths:
            block = torch.ones(n, n, dtype=torch.bool)
            block = block.tril() if causal else block
            if window is not None:
                block = block.triu(-(window - 1))
            blocks.append(block)
        return torch.block_diag(*blocks).to(seq.device, non_blocking=True)

    return seq.cached(("dense_mask", window) if causal else ("dense_mask", "full"), build)


def sdpa_masked(q_THD, k_TGD, v_TGD, mask_TT: torch.Tensor, scale: float | None = None):
    """SDPA over the flat layout with an explicit (T, T) bool mask; GQA without copies."""
    out_1HTD = F.scaled_dot_product_attention(
        q_THD.transpose(0, 1)[None],
        k_TGD.transpose(0, 1)[None],
        v_TGD.transpose(0, 1)[None],
        attn_mask=mask_TT,
        scale=scale,
        enable_gqa=k_TGD.shape[1] != q_THD.shape[1],
    )
    return out_1HTD[0].transpose(0, 1)


def per_sequence_wins(lengths: Sequence[int]) -> bool:
    """CPU: one SDPA call per sequence rather than one with a dense (T, T) mask (host ints)."""
    T = sum(lengths)
    if T > DENSE_MASK_MAX_TOKENS:
        return True
    return sum(n * n for n in lengths) / 2 + PER_SEQUENCE_CALL_COST * len(lengths) < T * T


# bf16 SDPA on a CPU without AMX runs 1.5-2.5x slower than float32 (AVX512-BF16 EPYC, 1
# thread, T=1024 in 8 sequences, forward + backward: 59 vs 40 ms; 64 sequences: 151 vs 59 ms):
# the kernel's softmax and small GEMMs get nothing from bf16 there. So half-precision inputs
# are upcast (a T x (H + 2G) x Dh copy) and the output cast back. With AMX the bf16 kernel's
# GEMMs run on the tiles; unmeasured here, so it keeps its dtype.
CPU_HALF_IN_FLOAT32 = not (
    hasattr(torch.cpu, "_is_amx_tile_supported") and torch.cpu._is_amx_tile_supported()
)


def _in_float32(fn):
    """fn(q, k, v, *rest) computed in float32 for half-precision CPU inputs (see above)."""

    def run(q_THD, k_TGD, v_TGD, *rest):
        half = q_THD.dtype in (torch.bfloat16, torch.float16)
        if not (CPU_HALF_IN_FLOAT32 and half and q_THD.device.type == "cpu"):
            return fn(q_THD, k_TGD, v_TGD, *rest)
        return fn(q_THD.float(), k_TGD.float(), v_TGD.float(), *rest).to(q_THD.dtype)

    return run


def _split_heads_first(x_TGD: torch.Tensor, lengths: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """(T, G, Dh) -> one (1, G, n, Dh) view per sequence. `split`, not slicing: its backward
    is one concatenation, where each slice's backward writes a zero (T, G, Dh) gradient."""
    return tuple(x[None] for x in x_TGD.transpose(0, 1).split(list(lengths), dim=1))


def _window_mask(n: int, window: int, device) -> torch.Tensor | None:
    """(n, n) bool causal mask limited to `window` keys; None when the window covers it all."""
    if n <= window:
        return None
    pos = torch.arange(n, device=device)
    delta = pos[:, None] - pos[None, :]
    return (delta >= 0) & (delta < window)


@_in_float32
def _sdpa_per_sequence(q_THD, k_TGD, v_TGD, seq, window, scale, causal=True):
    gqa = k_TGD.shape[1] != q_THD.shape[1]
    outs = []
    parts = (_split_heads_first(x, seq.lengths) for x in (q_THD, k_TGD, v_TGD))
    for n, q, k, v in zip(seq.lengths, *parts, strict=True):  # host ints: no sync
        mask = None if window is None else _window_mask(n, window, q_THD.device)
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=scale,
            enable_gqa=gqa,
        )  # fmt: skip
        outs.append(o[0])
    return torch.cat(outs, dim=1).transpose(0, 1)


def _eager(q_THD, k_TGD, v_TGD, mask_TT, sinks_H, scale, softcap=None):
    """Softmax over [scores, sink] written out, under a (T, T) bool mask: the CPU path for
    sink attention (`mask_TT` block-diagonal over a packed batch, or one sequence's own), and
    the path for softcapped scores (`sinks_H` None: no sink column)."""
    T, H, Dh = q_THD.shape
    rep = H // k_TGD.shape[1]
    k_THD = k_TGD.repeat_interleave(rep, dim=1)
    v_THD = v_TGD.repeat_interleave(rep, dim=1)
    scale = Dh**-0.5 if scale is None else scale
    scores_HTT = torch.einsum("thd,shd->hts", q_THD, k_THD) * scale
    if softcap is not None:
        scores_HTT = torch.tanh(scores_HTT / softcap) * softcap
    scores_HTT = scores_HTT.masked_fill(~mask_TT, float("-inf"))
    if sinks_H is None:
        return torch.einsum("hts,shd->thd", torch.softmax(scores_HTT, -1).to(v_THD.dtype), v_THD)
    sink_HT1 = sinks_H.to(scores_HTT.dtype)[:, None, None].expand(H, T, 1)
    probs = torch.softmax(torch.cat([scores_HTT, sink_HT1], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("hts,shd->thd", probs.to(v_THD.dtype), v_THD)


def _eager_per_sequence(
    q_THD, k_TGD, v_TGD, seq, window, sinks_H, scale, softcap=None, causal=True
):
    outs = []
    parts = (x.split(list(seq.lengths)) for x in (q_THD, k_TGD, v_TGD))
    for n, q, k, v in zip(seq.lengths, *parts, strict=True):
        mask = torch.ones(n, n, dtype=torch.bool, device=q_THD.device)
        mask = mask.tril() if causal else mask
        if window is not None:
            mask = mask.triu(-(window - 1))
        outs.append(_eager(q, k, v, mask, sinks_H, scale, softcap))
    return torch.cat(outs)


# ----------------------------------------------------------------------------- CUDA paths


@functools.cache
def _varlen_params() -> frozenset[str] | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return frozenset(inspect.signature(varlen_attn).parameters)


def _varlen_supports() -> bool:
    """torch 2.11+ (`window_size`, causal by (-1, 0)); 2.10's is_causal-only form is not used.
    GQA needs no flag before 2.12's `enable_gqa`: the flash kernel takes fewer kv heads."""
    params = _varlen_params()
    return params is not None and "window_size" in params


def _varlen_fits(q_THD: torch.Tensor) -> bool:
    """FlashAttention's limits: half precision, head dim a multiple of 8 up to 256."""
    Dh = q_THD.shape[-1]
    return q_THD.dtype in (torch.float16, torch.bfloat16) and Dh % 8 == 0 and Dh <= 256


def _varlen(q_THD, k_TGD, v_TGD, seq, window, scale, causal=True):
    from torch.nn.attention.varlen import varlen_attn

    # (left, right): causal with `window - 1` keys before the query, or unlimited; (-1, -1)
    # non-causal: the whole sequence.
    right = 0 if causal else -1
    kwargs = {"window_size": (window - 1, right) if window is not None else (-1, right)}
    if "enable_gqa" in _varlen_params():
        kwargs["enable_gqa"] = k_TGD.shape[1] != q_THD.shape[1]
    return varlen_attn(
        q_THD, k_TGD, v_TGD, seq.cu_seqlens, seq.cu_seqlens, seq.max_seqlen, seq.max_seqlen,
        scale=scale, **kwargs,
    )  # fmt: skip


# FlexAttention works on tiles of FLEX_BLOCK queries x FLEX_BLOCK keys. The flex path pads the
# packed stream to a multiple of it with one extra "padding sequence" (which attends only to
# itself and whose output is dropped): no mask_mod ever indexes past the end, and every batch
# length meets the same divisibility guards, so the kernel compiled with dynamic shapes is
# reused across batches instead of recompiled for each new T.
FLEX_BLOCK = 128
FLEX_MIN_HEAD_DIM = 16  # inductor's flex kernel refuses smaller heads ("E=8 ... at least 16")


def flex_padded_tokens(seq: SeqInfo) -> int:
    return _round_up(seq.total_tokens, FLEX_BLOCK)


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def flex_block_tiles(
    lengths: Sequence[int], window: int | None = None, block: int = FLEX_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which (query tile, key tile) pairs a document-causal mask touches, from host lengths.

    -> (partial, full): (nb, nb) bool host tensors over the padded stream (the padding counts
    as one more sequence). `full` tiles are wholly visible (no mask_mod call needed); `partial`
    tiles are visible in part. Query tile i covers tokens [i*block, (i+1)*block). Each query q
    sees keys [max(start(q), q - window + 1), q]; over a tile those ranges join into one run,
    [lo_i, end of tile i], so tile i touches key tiles lo_i // block .. i. A tile pair is full
    when both tiles lie inside one sequence, the key tile is strictly before the query tile and
    the window (if any) reaches from the tile's last query back to the key tile's first key.
    """
    lengths = list(lengths)
    padded = _round_up(sum(lengths), block)
    if padded > sum(lengths):
        lengths.append(padded - sum(lengths))
    ends = torch.tensor([*itertools.accumulate(lengths)])
    starts = ends - torch.tensor(lengths)
    nb = padded // block
    i = torch.arange(nb)
    q_first = i * block
    # Start of the sequence holding each tile's first and last token.
    first = starts[torch.searchsorted(ends, q_first, right=True)]
    last = starts[torch.searchsorted(ends, q_first + block - 1, right=True)]
    lo = first if window is None else torch.maximum(first, q_first - window + 1)
    j = i[None, :]
    visible = (j >= (lo // block)[:, None]) & (j <= i[:, None])
    one_seq = (first == last)[:, None]  # query tile inside one sequence
    key_inside = j * block >= first[:, None]  # key tile starts inside that sequence
    full = visible & one_seq & key_inside & (j < i[:, None])
    if window is not None:
        full &= (q_first + block - 1)[:, None] - j * block < window
    return visible & ~full, full


def flex_block_mask(seq: SeqInfo, window: int | None = None):
    """Document-causal (optionally windowed) FlexAttention BlockMask over the padded stream.

    The tile structure comes from the host lengths (`flex_block_tiles`) and reaches the
    device in one non-blocking copy; only the partial tiles call `mask_mod`. Cached on `seq`.
    """
    return seq.cached(("block_mask", window), lambda: _build_flex_mask(seq, window))


def _build_flex_mask(seq: SeqInfo, window: int | None):
    from torch.nn.attention.flex_attention import BlockMask

    T, padded = seq.total_tokens, flex_padded_tokens(seq)
    partial, full = flex_block_tiles(seq.lengths, window)
    nb = partial.shape[0]
    # Ordered form: per query tile, the count, then the key tile indices (listed ones first).
    host = torch.cat([
        partial.sum(1), _listed_first(partial).flatten(),
        full.sum(1), _listed_first(full).flatten(),
    ]).to(torch.int32)  # fmt: skip
    if seq.device.type == "cuda":
        host = host.pin_memory()
    buf = host.to(seq.device, non_blocking=True)
    kv_num, kv_idx, full_num, full_idx = buf.split([nb, nb * nb, nb, nb * nb])
    # Sequence id of every padded position; the padding is one more sequence.
    seq_ids = torch.cat([seq.seq_ids, seq.seq_ids.new_full((padded - T,), seq.num_seqs)])

    def mask_mod(b, h, q_idx, kv_idx):
        ok = (seq_ids[q_idx] == seq_ids[kv_idx]) & (q_idx >= kv_idx)
        return ok & (q_idx - kv_idx < window) if window is not None else ok

    mask = BlockMask.from_kv_blocks(
        kv_num.view(1, 1, nb), kv_idx.view(1, 1, nb, nb),
        full_num.view(1, 1, nb), full_idx.view(1, 1, nb, nb),
        BLOCK_SIZE=FLEX_BLOCK, mask_mod=mask_mod, seq_lengths=(padded, padded),
    )  # fmt: skip
    # The tile counts change with the padded length: marked dynamic up front, or the first
    # compile specializes on them and each new count recompiles (dynamo stops at 8, then flex
    # runs eager over the full T x T scores).
    from torch import _dynamo

    for name in _BLOCK_MASK_TENSORS:
        t = getattr(mask, name, None)
        for dim in range(2, t.dim() if t is not None else 0):
            _dynamo.maybe_mark_dynamic(t, dim)
    return mask


_BLOCK_MASK_TENSORS = (
    "kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
    "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices",
)  # fmt: skip


def _listed_first(tiles_NN: torch.Tensor) -> torch.Tensor:
    """Per row, the column indices of the True entries first (in order), then the rest."""
    return torch.argsort((~tiles_NN).to(torch.int8), dim=1, stable=True)


@functools.cache
def _compiled_flex(backend: str = "inductor"):
    from torch.nn.attention.flex_attention import flex_attention

    # dynamic=True: T changes every batch; one shape-generic kernel instead of a recompile
    # per batch (and eager fallback once the recompile limit is hit).
    return torch.compile(flex_attention, dynamic=True, backend=backend)


def _flex(q_THD, k_TGD, v_TGD, seq, window, sinks_H, scale):
    """FlexAttention over the padded stream (compiled on CUDA; eager elsewhere, for tests)."""
    from torch.nn.attention.flex_attention import flex_attention

    T = seq.total_tokens
    pad = flex_padded_tokens(seq) - T
    block_mask = flex_block_mask(seq, window)
    padded = (F.pad(x, (0, 0, 0, 0, 0, pad)) if pad else x for x in (q_THD, k_TGD, v_TGD))
    q, k, v = (x.transpose(0, 1)[None] for x in padded)
    gqa = k_TGD.shape[1] != q_THD.shape[1]
    fn = _compiled_flex() if q_THD.is_cuda else flex_attention
    with opaque_to_audit():  # count_syncs' modes would force the eager T x T fallback
        if sinks_H is None:
            out = fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)
            return out[0, :, :T].transpose(0, 1)
        out, lse_1HT = _flex_with_lse(
            fn, q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa
        )
    rescale_1HT = torch.sigmoid(lse_1HT - sinks_H.float()[None, :, None])
    return (out * rescale_1HT[..., None].to(out.dtype))[0, :, :T].transpose(0, 1)


def _flex_with_lse(fn, *args, **kwargs):
    """(out, lse): `return_aux=AuxRequest(lse=True)` where torch has it, else `return_lse`."""
    from torch.nn.attention import flex_attention as fa

    if hasattr(fa, "AuxRequest"):
        out, aux = fn(*args, return_aux=fa.AuxRequest(lse=True), **kwargs)
        return out, aux.lse
    return fn(*args, return_lse=True, **kwargs)
