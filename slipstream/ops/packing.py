"""Packed-sequence metadata, built once per batch on the host.

Layout: tokens of several sequences are concatenated into one flat `(T,)` stream with no
padding (the varlen convention). `SeqInfo` holds the boundaries. Everything here is computed
from a Python list of lengths on the host and reaches the device in one non-blocking copy, so
no layer ever has to ask the device how long a sequence is (each such question is a host sync:
one per layer is 28 stalls a step on a 28-layer model). Derived attention structures (masks)
are cached on the `SeqInfo` (`cached`), so every layer shares them.

Shapes: T = total tokens, N = number of sequences.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(eq=False)
class SeqInfo:
    """Boundaries of the sequences packed into one flat batch.

    lengths: host tuple of the N sequence lengths.
    cu_seqlens: (N+1,) int32 cumulative offsets, on the device.
    max_seqlen: longest sequence, a Python int (no sync to read it).
    position_ids: (T,) int64 position of each token inside its own sequence.
    seq_ids: (T,) int32 index of the sequence each token belongs to.
    image_spans: host ((start, end), ...) flat token ranges (an image's placeholder rows,
    Gemma 3) whose queries also see the span's later keys: bidirectional within the span,
    causal elsewhere (ops/attention.py `attend`). Empty for text.
    """

    lengths: tuple[int, ...]
    cu_seqlens: torch.Tensor
    max_seqlen: int
    position_ids: torch.Tensor
    seq_ids: torch.Tensor
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False)
    # The int32 host buffer the fields were cut from, so `.to(device)` is a copy, not a rebuild.
    _host: torch.Tensor | None = field(default=None, repr=False)
    # Generation only: a KV-cache step (slipstream.generation.cache) that `attend` hands each
    # layer's keys and values to. None in training.
    kv: Any = field(default=None, repr=False)
    # Sequence parallelism only: this rank's shard of a batch split over ranks
    # (slipstream.ops.ulysses.SeqShard), which `attend` hands each layer's q, k, v to.
    shard: Any = field(default=None, repr=False)
    image_spans: tuple[tuple[int, int], ...] = ()

    @property
    def total_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def num_seqs(self) -> int:
        return len(self.lengths)

    @property
    def device(self) -> torch.device:
        return self.position_ids.device

    @classmethod
    def from_lengths(
        cls,
        lengths: Sequence[int],
        device: torch.device | str | None = None,
        starts: Sequence[int] | None = None,
    ) -> SeqInfo:
        """Build all metadata on the host from `lengths`; one non-blocking copy to `device`.
        `starts`: the position of each sequence's first token (default 0; a sequence-parallel
        shard holds pieces of sequences that start further in)."""
        lengths = tuple(_check_lengths(lengths))
        cu = [0, *itertools.accumulate(lengths)]
        starts = [0] * len(lengths) if starts is None else starts
        positions = [s + p for n, s in zip(lengths, starts, strict=True) for p in range(n)]
        seq_ids = [i for i, n in enumerate(lengths) for _ in range(n)]
        # One host buffer: [cu_seqlens (N+1) | positions (T) | seq_ids (T)].
        host = torch.tensor([*cu, *positions, *seq_ids], dtype=torch.int32)
        return cls._from_host(lengths, host, device)

    @classmethod
    def _from_host(
        cls, lengths: tuple[int, ...], host: torch.Tensor, device: torch.device | str | None
    ) -> SeqInfo:
        device = torch.device(device) if device is not None else torch.device("cpu")
        buf = to_device(host, device)
        n, total = len(lengths), sum(lengths)
        return cls(
            lengths=lengths,
            cu_seqlens=buf[: n + 1],
            max_seqlen=max(lengths),
            position_ids=buf[n + 1 : n + 1 + total].long(),
            seq_ids=buf[n + 1 + total :],
            _host=host,
        )

    def to(self, device: torch.device | str) -> SeqInfo:
        """The same metadata on `device`: one non-blocking copy of the host buffer, no sync."""
        if torch.device(device) == self.device:
            return self
        if self._host is None:  # not built on the host: rebuild from the host lengths
            assert self.shard is None, "a shard's SeqInfo is built on the host"
            moved = SeqInfo.from_lengths(self.lengths, device)
            moved.image_spans = self.image_spans
            return moved
        moved = SeqInfo._from_host(self.lengths, self._host, device)
        moved.shard = None if self.shard is None else self.shard.to(device)
        moved.image_spans = self.image_spans
        return moved

    def cached(self, key: Any, build: Callable[[], Any]) -> Any:
        """Return the derived structure under `key`, building it on first use only."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host buffer on `device` in one non-blocking copy, pinned first for CUDA if it is not."""
    device = torch.device(device)
    if device.type == "cuda" and not host.is_pinned():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def _check_lengths(lengths: Sequence[int]) -> list[int]:
    if isinstance(lengths, torch.Tensor):
        raise ValueError(
            "SeqInfo.from_lengths takes a host list of ints, not a tensor "
            "(reading a device tensor would sync the host); pass lengths.tolist() once."
        )
    out = list(lengths)
    if not out:
        raise ValueError("SeqInfo.from_lengths: lengths is empty; a batch needs >= 1 sequence.")
    for i, n in enumerate(out):
        if not isinstance(n, int) or isinstance(n, bool):
            raise ValueError(f"SeqInfo.from_lengths: lengths[{i}] = {n!r} is not an int.")
        if n <= 0:
            raise ValueError(
                f"SeqInfo.from_lengths: lengths[{i}] = {n}; every sequence needs >= 1 token."
            )
    return out
