"""Sequence parallelism, Ulysses-style: a packed batch's tokens split over N ranks, and
attention done by two all-to-alls around the usual `attend_packed`.

Each rank of a sequence-parallel group holds a contiguous shard of the packed stream
(`split_lengths`: T * r // N .. T * (r + 1) // N, cut on the host from the batch's lengths;
a sequence longer than a share spans ranks). Everything but attention works per token, so
it runs on the shard as is; RoPE reads each token's position in its own sequence from the
shard's `SeqInfo` (`from_lengths(..., starts=)`). In attention, `seq_to_heads` turns the
shard's (T_r, H, Dh) into (T, H / N, Dh): every token of the batch for this rank's H / N
heads; `attend_packed` runs over the whole batch's `SeqInfo` (every rank has it: host
lengths), and `heads_to_seq` turns the output back. Each all-to-all's backward is the other.

Why this split is balanced: per token the work is equal (projections, MLP, loss), and the
causal attention of every sequence is done whole by each rank for its H / N heads, so equal
token counts give equal work whatever the lengths (the split needs no causal balancing, as
ring attention's would).

Shapes: T tokens of the batch, T_r of this rank's shard, H query heads, G kv heads, h = H / N
(or G / N) heads of this rank, Dh head dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from slipstream.ops.packing import SeqInfo


def split_lengths(lengths: Sequence[int], ranks: int) -> list[tuple[list[int], list[int]]]:
    """Per rank, (its pieces' lengths, the position each piece starts at in its sequence):
    the packed stream cut into `ranks` contiguous shards of T // ranks or T // ranks + 1
    tokens (host ints)."""
    T = sum(lengths)
    if ranks > T:
        raise ValueError(
            f"a micro-batch of {T} tokens cannot be split over train.sequence_parallel={ranks} "
            "ranks; raise train.tokens_per_batch or lower train.sequence_parallel"
        )
    cuts = [T * r // ranks for r in range(ranks + 1)]
    shards: list[tuple[list[int], list[int]]] = [([], []) for _ in range(ranks)]
    start = 0  # the sequence's first token in the stream
    for n in lengths:
        for r in range(ranks):
            lo, hi = max(start, cuts[r]), min(start + n, cuts[r + 1])
            if lo < hi:
                shards[r][0].append(hi - lo)
                shards[r][1].append(lo - start)
        start += n
    return shards


def shard_seq(seq: SeqInfo, rank: int, ranks: int, group: Any) -> tuple[SeqInfo, slice]:
    """This rank's `SeqInfo` of the batch `seq` (host-built) and the slice of the packed
    stream it holds. Its `shard` carries the whole batch's `SeqInfo` for attention."""
    shards = split_lengths(seq.lengths, ranks)
    sizes = tuple(sum(p) for p, _ in shards)
    lo = sum(sizes[:rank])
    pieces, starts = shards[rank]
    local = SeqInfo.from_lengths(pieces, starts=starts)
    local.shard = SeqShard(full=seq, sizes=sizes, rank=rank, group=group)
    return local, slice(lo, lo + sizes[rank])


@dataclass(eq=False)
class SeqShard:
    """What `attend` needs of a sequence-parallel shard: the whole batch's `SeqInfo`, each
    rank's token count (host ints, rank order), this rank's place and the group."""

    full: SeqInfo
    sizes: tuple[int, ...]
    rank: int
    group: Any

    def to(self, device: torch.device | str) -> SeqShard:
        return SeqShard(self.full.to(device), self.sizes, self.rank, self.group)

    def attend(self, q_TrHD, k_TrGD, v_TrGD, *, window, sinks, scale, softcap):
        """`attend_packed` over the whole batch for this rank's heads -> (T_r, H, Dh)."""
        from slipstream.ops.attention import attend_packed

        q_ThD, k_ThD, v_ThD = (
            seq_to_heads(x, self.sizes, self.group) for x in (q_TrHD, k_TrGD, v_TrGD)
        )
        if sinks is not None:  # (H,): this rank's heads
            h = q_ThD.shape[1]
            sinks = sinks[self.rank * h : (self.rank + 1) * h]
        o_ThD = attend_packed(q_ThD, k_ThD, v_ThD, self.full, window, sinks, scale, softcap)
        return heads_to_seq(o_ThD, self.sizes, self.group)


def seq_to_heads(x_TrHD: torch.Tensor, sizes: tuple[int, ...], group: Any) -> torch.Tensor:
    """(T_r, H, Dh) of this rank's tokens -> (T, H / N, Dh) of this rank's heads."""
    return _SeqToHeads.apply(x_TrHD, sizes, group)


def heads_to_seq(x_ThD: torch.Tensor, sizes: tuple[int, ...], group: Any) -> torch.Tensor:
    """(T, H / N, Dh) of this rank's heads -> (T_r, H, Dh) of this rank's tokens."""
    return _HeadsToSeq.apply(x_ThD, sizes, group)


def _to_heads(x_TrHD: torch.Tensor, sizes: tuple[int, ...], group: Any) -> torch.Tensor:
    N, (T_r, H, Dh) = len(sizes), x_TrHD.shape
    # Rank j gets heads j * H / N ..: grouped by destination, each group's tokens in order.
    send = x_TrHD.reshape(T_r, N, H // N, Dh).transpose(0, 1).contiguous()
    out = x_TrHD.new_empty(sum(sizes), H // N, Dh)
    dist.all_to_all_single(out, send.view(N * T_r, H // N, Dh), list(sizes), [T_r] * N, group)
    return out


def _to_seq(x_ThD: torch.Tensor, sizes: tuple[int, ...], group: Any) -> torch.Tensor:
    N, (_, h, Dh) = len(sizes), x_ThD.shape
    T_r = sizes[dist.get_rank(group)]
    recv = x_ThD.new_empty(N * T_r, h, Dh)
    dist.all_to_all_single(recv, x_ThD.contiguous(), [T_r] * N, list(sizes), group)
    return recv.view(N, T_r, h, Dh).transpose(0, 1).reshape(T_r, N * h, Dh)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _to_heads(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _to_seq(grad, ctx.sizes, ctx.group), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _to_seq(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _to_heads(grad, ctx.sizes, ctx.group), None, None
