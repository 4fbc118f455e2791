"""The one packed-batch builder: sequences with their scored spans, plus named fields, in one
host buffer that reaches the device in one non-blocking copy.

Layout: the sequences' tokens concatenated, `input_ids (T,)`, no padding (the varlen
convention, ops/packing.py). A scored token u of a sequence is predicted at position u - 1:
*position t scores token t + 1*, decided here and nowhere else. From each sequence's
scored spans (token ranges) the builder makes `labels (T,)` (`labels[t]` the target of
position t; -100 where nothing is scored, always at a sequence's last position, so no label
crosses a packed boundary) and `label_positions (N,)` (the scored positions, ascending).

Fields beside them are named, of one of three kinds, and given per sequence to `add`:
"token" (one value per token, (T,)), "scored" (one per scored position, (N,), in
`label_positions` order; `PerSpan` gives one value for each span's tokens),
"sequence" (one per sequence, (S,)); `put` adds a whole host tensor of any shape (image
features and the positions they fill, a shard's offsets), or a `SeqInfo` (the boundaries of
another packed stream: a vision tower's images and windows, data/qwen_vit_meta.py), which
keeps its host lengths and moves by its own one copy.

Every field, the three above included, is a view of one host buffer (pinned when CUDA is
present; each field starts on an 8-byte boundary, so any dtype can view it), and a layout of
`Slot`s says where each lies. `PackedBatch.to(device)` copies that buffer once,
non-blocking, and cuts the same views from the copy (plus the SeqInfo's own copy): no host
sync, no field sliced at a hand-computed offset. An objective's batch is a `PackedView`
over a `PackedBatch` (objectives/pairs.py, grpo_data.py); SFT's `Batch` is a PackedBatch.

Shapes: T tokens, N scored positions, S sequences.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from slipstream.ops.packing import SeqInfo, to_device

IGNORE_INDEX = -100
KINDS = ("token", "scored", "sequence")
ALIGN = 8  # bytes


@dataclass(frozen=True)
class Slot:
    """Where one field lies in a packed buffer: `offset` bytes in, `shape` of `dtype`."""

    name: str
    dtype: torch.dtype
    offset: int
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def pack(tensors: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, tuple[Slot, ...]]:
    """(one buffer holding every tensor, on their device: on the host pinned when CUDA is
    present; its layout)."""
    slots, offset = [], 0
    for name, t in tensors.items():
        slots.append(Slot(name, t.dtype, offset, tuple(t.shape)))
        offset += -(-slots[-1].nbytes // ALIGN) * ALIGN
    device = next(iter(tensors.values())).device  # a hand-built batch on a device stays there
    pin = device.type == "cpu" and torch.cuda.is_available()
    buffer = torch.empty(offset // 8, dtype=torch.int64, device=device, pin_memory=pin)
    layout = tuple(slots)
    for view, t in zip(views(buffer, layout).values(), tensors.values(), strict=True):
        view.copy_(t)
    return buffer, layout


def views(buffer: torch.Tensor, layout: Sequence[Slot]) -> dict[str, torch.Tensor]:
    """Each slot's tensor, a view of `buffer` (on the host or a device)."""
    raw = buffer.view(torch.uint8)
    return {s.name: raw[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape) for s in layout}


@dataclass(eq=False)
class PackedBatch:
    """`input_ids` (T,), `labels` (T,) int64, the `seq` boundaries, the host count `num_labels`
    (N) and `label_positions` (N,) int64 (None in a hand-built batch: the model's plain
    path), `fields` by name (module docstring). `_host` is the buffer every tensor views and
    `_layout` where each lies; a batch built by hand (or changed: set `_host=None`) is packed
    when it is moved."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    seq: SeqInfo
    num_labels: int
    label_positions: torch.Tensor | None = None
    fields: dict[str, torch.Tensor | SeqInfo] = field(default_factory=dict)
    _host: torch.Tensor | None = field(default=None, repr=False)
    _layout: tuple[Slot, ...] = field(default=(), repr=False)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def to(self, device: torch.device | str) -> PackedBatch:
        """The batch on `device`: one non-blocking copy of the buffer, plus the SeqInfos'."""
        host, layout = self._host, self._layout
        seqs = {k: v for k, v in self.fields.items() if isinstance(v, SeqInfo)}
        if host is None:
            tensors = {"input_ids": self.input_ids.reshape(-1).long(),
                       "labels": self.labels.reshape(-1).long()}  # fmt: skip
            if self.label_positions is not None:
                tensors["label_positions"] = self.label_positions.reshape(-1).long()
            fields = {k: v for k, v in self.fields.items() if k not in seqs}
            host, layout = pack({**tensors, **fields})
        moved = {k: v.to(device) for k, v in seqs.items()}
        return _from_buffer(
            to_device(host, device), layout, self.seq.to(device), self.num_labels, moved
        )


def _from_buffer(
    buffer: torch.Tensor, layout, seq: SeqInfo, num_labels: int, seqs: Mapping | None = None
) -> PackedBatch:
    v = views(buffer, layout)
    ids, labels, positions = v.pop("input_ids"), v.pop("labels"), v.pop("label_positions", None)
    fields = {**v, **(seqs or {})}
    return PackedBatch(ids, labels, seq, num_labels, positions, fields, buffer, tuple(layout))


class PerSpan(tuple):
    """A scored field's values given one per span of `PackedBuilder.add`."""


class PackedBuilder:
    """Sequences in, one PackedBatch out. `fields`: name -> (kind, dtype), kind in KINDS."""

    def __init__(self, **fields: tuple[str, torch.dtype]) -> None:
        for name, (kind, _) in fields.items():
            if kind not in KINDS:
                raise ValueError(f"field {name!r}: kind {kind!r} is not one of {KINDS}")
        self.kinds = fields
        self.ids: list[int] = []
        self.labels: list[int] = []
        self.positions: list[int] = []
        self.lengths: list[int] = []
        self.values: dict[str, list] = {name: [] for name in fields}
        self.whole: dict[str, torch.Tensor] = {}

    def add(self, ids: Sequence[int], spans: Sequence[tuple[int, int]], **values: Any) -> int:
        """Append one sequence whose tokens `a <= u < b` of each span (a, b) are scored
        (sorted, disjoint; token 0 has nothing to predict it from and is never scored), with
        its value of every field: one number for all its entries, a sequence of them, or
        (a "scored" field) `PerSpan` values, one for each span's tokens. -> its scored count."""
        if set(values) != set(self.kinds):
            raise ValueError(f"add: fields {sorted(values)}; this batch has {sorted(self.kinds)}")
        start, n = len(self.ids), len(ids)
        self.ids.extend(ids)
        labels = [IGNORE_INDEX] * n
        scored = [range(max(a, 1), min(b, n)) for a, b in spans]  # each span's scored tokens
        for u in scored:
            if u:  # position t scores token t + 1
                labels[u.start - 1 : u.stop - 1] = ids[u.start : u.stop]
                self.positions.extend(range(start + u.start - 1, start + u.stop - 1))
        self.labels.extend(labels)
        self.lengths.append(n)
        num_scored = sum(map(len, scored))
        for name, value in values.items():
            kind = self.kinds[name][0]
            count = {"token": n, "scored": num_scored, "sequence": 1}[kind]
            if isinstance(value, PerSpan):
                if kind != "scored" or len(value) != len(spans):
                    raise ValueError(f"{name!r}: PerSpan is one value a span, scored fields only")
                value = [v for v, u in zip(value, scored) for _ in u]
            elif isinstance(value, (int, float)):
                value = [value] * count
            if len(value) != count:
                raise ValueError(f"add: field {name!r} has {len(value)} values, needs {count}")
            self.values[name].extend(value)
        return num_scored

    def put(self, name: str, tensor: torch.Tensor | SeqInfo) -> None:
        """A whole host tensor as a field of the batch (any shape and dtype), or a SeqInfo."""
        if name in self.kinds or name in ("input_ids", "labels", "label_positions"):
            raise ValueError(f"put: {name!r} is already a field of this batch")
        self.whole[name] = tensor

    def build(self) -> PackedBatch:
        """The packed batch, every tensor a view of one (pinned) host buffer."""
        if not self.lengths:
            raise ValueError("a packed batch needs at least one sequence")
        tensors = {
            "input_ids": torch.tensor(self.ids, dtype=torch.int64),
            "labels": torch.tensor(self.labels, dtype=torch.int64),
            "label_positions": torch.tensor(self.positions, dtype=torch.int64),
        }
        for name, (_, dtype) in self.kinds.items():
            tensors[name] = torch.tensor(self.values[name], dtype=dtype)
        seqs = {k: v for k, v in self.whole.items() if isinstance(v, SeqInfo)}
        whole = {k: v for k, v in self.whole.items() if k not in seqs}
        buffer, layout = pack({**tensors, **whole})
        seq = SeqInfo.from_lengths(self.lengths)
        return _from_buffer(buffer, layout, seq, len(self.positions), seqs)


def target_spans(trainable: Sequence[bool]) -> list[tuple[int, int]]:
    """The runs of True in a per-token target mask, as (start, end) spans."""
    spans, start = [], None
    for u, keep in enumerate(trainable):
        if keep and start is None:
            start = u
        elif not keep and start is not None:
            spans.append((start, u))
            start = None
    return spans if start is None else [*spans, (start, len(trainable))]


def packed_field(name: str, optional: bool = False) -> property:
    """A PackedView attribute that reads the packed batch's field `name` (None if absent and
    `optional`)."""
    if optional:
        return property(lambda self: self.packed.fields.get(name))
    return property(lambda self: self.packed.fields[name])


@dataclass(eq=False)
class PackedView:
    """An objective's batch: a PackedBatch (`packed`) and the objective's host numbers; the
    packed tensors read through (`positions` is `label_positions`), `to` moves `packed`."""

    packed: PackedBatch

    input_ids = property(lambda self: self.packed.input_ids)
    labels = property(lambda self: self.packed.labels)
    seq = property(lambda self: self.packed.seq)
    positions = property(lambda self: self.packed.label_positions)
    num_tokens = property(lambda self: self.packed.num_tokens)

    def to(self, device: torch.device | str) -> Any:
        return replace(self, packed=self.packed.to(device))
