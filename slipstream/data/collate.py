"""Collator: packed examples -> one flat batch with labels shifted within each sequence.

`labels[t]` is the target of position t: `input_ids[t+1]` when token t+1 is a target of the
same sequence, else -100. Each sequence's last position is -100, so no label crosses a packed
boundary. Everything is built on the host from Python lists: `input_ids`, `labels` and
`label_positions` (the indices t with `labels[t] != -100`, for the model to run its LM head
on those rows only) share one (pinned, when CUDA is present) buffer, so `Batch.to(device)` is
one non-blocking copy for all three plus one for the `SeqInfo`, and the model never has to
find the labelled rows with a boolean mask (a host sync).

Shapes: T = total tokens in the batch, N = labelled positions (`num_labels`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from slipstream.data.labels import Example
from slipstream.ops.packing import SeqInfo, to_device

IGNORE_INDEX = -100


@dataclass
class Batch:
    """input_ids_T, labels_T (int64), seq boundaries, the host count N of labels != -100 and
    their positions label_positions_N (int64; None in hand-built batches: the plain path)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    seq: SeqInfo
    num_labels: int
    label_positions: torch.Tensor | None = None
    # One flat buffer: input_ids, labels, label_positions (2T + N); the fields are its views.
    _host: torch.Tensor | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def to(self, device: torch.device | str) -> Batch:
        """The batch on `device`: one non-blocking copy from the (pinned) host buffer."""
        device = torch.device(device)
        flat = self._host
        if flat is None:
            parts = [self.input_ids, self.labels]
            parts += [] if self.label_positions is None else [self.label_positions]
            flat = torch.cat([x.reshape(-1).long() for x in parts])
        flat = to_device(flat, device)
        T = self.input_ids.numel()
        positions = None if self.label_positions is None else flat[2 * T :]
        return Batch(
            flat[:T], flat[T : 2 * T], self.seq.to(device), self.num_labels, positions, flat
        )


def shifted_labels(ex: Example) -> list[int]:
    """Targets of each position of one sequence: next token if it is trainable, else -100."""
    ids, trainable = ex.input_ids, ex.trainable
    out = [ids[t + 1] if trainable[t + 1] else IGNORE_INDEX for t in range(len(ids) - 1)]
    out.append(IGNORE_INDEX)
    return out


def collate(examples: Sequence[Example]) -> Batch:
    """Concatenate examples into one packed batch (see module docstring)."""
    if not examples:
        raise ValueError("collate: no examples; a batch needs at least one.")
    ids: list[int] = []
    labels: list[int] = []
    for ex in examples:
        if len(ex.input_ids) != len(ex.trainable):
            raise ValueError(
                f"collate: example has {len(ex.input_ids)} ids but {len(ex.trainable)} mask values."
            )
        ids.extend(ex.input_ids)
        labels.extend(shifted_labels(ex))
    positions = [t for t, y in enumerate(labels) if y != IGNORE_INDEX]
    T, N = len(ids), len(positions)
    host = torch.tensor(ids + labels + positions, dtype=torch.int64)
    if torch.cuda.is_available():
        host = host.pin_memory()
    seq = SeqInfo.from_lengths([len(ex) for ex in examples])
    return Batch(host[:T], host[T : 2 * T], seq, N, host[2 * T :], host)
